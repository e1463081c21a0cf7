"""Many nodes going silent at once are a partition, not many failures. A real scheduler
with its deciding loops, hand-driven agent streams whose hosts answer (a refused port)
or stay silent (`silent_address`): a job touched by a mass loss is held (nothing
replaced, its exits wait) and goes on when its nodes are back; nodes still away past the
replace deadline are replaced a bounded number at a time; a single silent node is still
replaced at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kit.events import follow_events
from kit.ports import free_port, silent_address
from kit.schedulers import SchedulerThread, hand_driven_leader
from kit.stores import StoreUrls, unique
from kit.streams import AgentStream
from pitstop.v1 import agent_pb2, jobs_pb2, jobs_pb2_grpc

DECISIONS = ("job.recovering", "job.reconfigured", "job.restarting")


@pytest.fixture
def silent() -> Iterator[str]:
    with silent_address() as address:
        yield address


def leader(stores: StoreUrls, tmp_path: Path, **mass_loss: Any) -> SchedulerThread:
    return hand_driven_leader(
        stores,
        tmp_path,
        loss_probe_seconds=0.3,
        # What the hosts answer is judged here, not the shedder (test_load_shedding):
        # a loop this busy machine makes late must not count every loss silent.
        shed_lag_seconds=5.0,
        mass_loss_nodes=3,
        **mass_loss,
    )


def cut(streams: list[AgentStream]) -> None:
    """End the streams all at once, as a partition does (the calls reset)."""
    with ThreadPoolExecutor(len(streams)) as pool:
        list(pool.map(AgentStream.cut, streams))


def start_job(thread: SchedulerThread, streams: list[AgentStream], dp: int) -> jobs_pb2.Job:
    """A dp-replica job, one rank per node, started on `streams` (each acks its start)."""
    jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
    spec = jobs_pb2.JobSpec(name=unique("held"), command=["train"], dp=dp, gpus_per_node=1)
    job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
    for stream in streams:
        stream.acked_start()
    return job


class Log:
    """The job's events, followed from the start, kept in order."""

    def __init__(self, address: str, job_id: str) -> None:
        self.job_id = job_id
        self.seen: list[Any] = []
        self._events = follow_events(address, timeout=120)

    def until(self, kind: str, *, count: int = 1) -> Any:
        """Read on until the job's `count`-th event of `kind`; that event."""
        while sum(1 for e in self.seen if e.kind == kind) < count:
            event = next(self._events)
            if event.job_id == self.job_id or (not event.job_id and event.node_id):
                self.seen.append(event)
        return [e for e in self.seen if e.kind == kind][count - 1]

    def kinds(self) -> list[str]:
        return [e.kind for e in self.seen if e.job_id == self.job_id]

    def __repr__(self) -> str:
        return "\n".join(f"{e.id} {e.kind} {e.node_id} {e.reason}" for e in self.seen)

    def close(self) -> None:
        self._events.close()


def test_a_mass_loss_holds_the_job_and_it_goes_on_when_its_nodes_are_back(
    stores: StoreUrls, tmp_path: Path, silent: str
) -> None:
    thread = leader(stores, tmp_path, mass_loss_replace_after_seconds=600.0)
    try:
        workers = [
            thread.open_stream(f"w{i}", gpus=1, rack=f"r{i}", checkpointd_address=silent)
            for i in range(4)
        ]
        thread.open_stream("s0", gpus=1, rack="r9", role="spare", checkpointd_address=silent)
        job = start_job(thread, workers, dp=4)
        log = Log(thread.address, job.id)
        try:
            cut(workers[1:])  # three hosts cut off at once: nothing answers for them
            held = log.until("job.held")
            assert held.attributes["lost_nodes"] == "3", dict(held.attributes)
            log.until("node.lost", count=3)  # their hosts asked, and silent
            # A survivor's rank gives up its collective meanwhile: not restarted while held.
            workers[0].send(
                rank_exited=agent_pb2.RankExited(job_id=job.id, generation=1, rank=0, exit_code=1)
            )
            for i in range(1, 4):  # the network is back: the agents register again
                thread.open_stream(f"w{i}", gpus=1, rack=f"r{i}", checkpointd_address=silent)
            released = log.until("job.released")
            assert float(released.attributes["held_seconds"]) > 0
            assert released.attributes["replacements"] == "0"
            log.until("job.restarting")  # the exit, handled once the job goes on
            kinds = log.kinds()
            assert not {"job.recovering", "job.reconfigured"} & set(kinds), log
            assert kinds.index("job.held") < kinds.index("job.released"), log
            assert kinds.index("job.released") < kinds.index("job.restarting"), log
            assert kinds.count("job.held") == 1, log
            lost = [e for e in log.seen if e.kind == "node.lost"]
            assert {e.node_id for e in lost} == {"w1", "w2", "w3"}
            assert {e.attributes["cause"] for e in lost} == {"silent"}
        finally:
            log.close()
    finally:
        thread.stop()


def test_nodes_that_stay_away_are_replaced_a_bounded_number_at_a_time(
    stores: StoreUrls, tmp_path: Path, silent: str
) -> None:
    thread = leader(
        stores,
        tmp_path,
        mass_loss_window_seconds=3.0,
        mass_loss_replace_after_seconds=1.0,
        mass_loss_replace_batch=2,
    )
    try:
        workers = [
            thread.open_stream(f"w{i}", gpus=1, rack=f"r{i}", checkpointd_address=silent)
            for i in range(4)
        ]
        for i in range(3):
            thread.open_stream(f"s{i}", gpus=1, rack=f"r{5 + i}", role="spare")
        job = start_job(thread, workers, dp=4)
        log = Log(thread.address, job.id)
        try:
            cut(workers[1:])
            log.until("job.held")
            began = time.monotonic()
            first = log.until("job.recovering")
            second = log.until("job.reconfigured")
            log.until("job.released")
            assert first.reason.count("ranks moved to spare") == 2, first.reason
            assert second.reason.count("ranks moved to spare") == 1, second.reason
            # The second batch waited for the window's budget to come back.
            gap = second.time.ToDatetime() - first.time.ToDatetime()
            assert gap.total_seconds() >= 2.0, (first.time, second.time)
            assert time.monotonic() - began < 30
        finally:
            log.close()
    finally:
        thread.stop()


def test_a_single_silent_node_is_replaced_at_once_and_an_answering_host_sooner(
    stores: StoreUrls, tmp_path: Path, silent: str
) -> None:
    thread = leader(stores, tmp_path)
    try:
        refused = f"127.0.0.1:{free_port()}"  # nothing listens: the host answers, refusing
        workers = [
            thread.open_stream("w0", gpus=1, rack="r0", checkpointd_address=silent),
            thread.open_stream("w1", gpus=1, rack="r1", checkpointd_address=refused),
            thread.open_stream("w2", gpus=1, rack="r2", checkpointd_address=silent),
        ]
        for i in range(2):
            thread.open_stream(f"s{i}", gpus=1, rack=f"r{5 + i}", role="spare")
        job = start_job(thread, workers, dp=3)
        log = Log(thread.address, job.id)
        try:
            workers[1].cut()  # its agent died on a live host
            lost = log.until("node.lost")
            assert (lost.node_id, lost.attributes["cause"]) == ("w1", "stream")
            log.until("job.recovering")
            workers[2].cut()  # a host gone silent, alone
            lost = log.until("node.lost", count=2)
            assert (lost.node_id, lost.attributes["cause"]) == ("w2", "silent")
            log.until("job.reconfigured")
            assert "job.held" not in log.kinds()
        finally:
            log.close()
    finally:
        thread.stop()
