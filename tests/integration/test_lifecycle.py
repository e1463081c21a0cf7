"""The scheduler's decisions end to end, with real agents on simulated GPUs and real
rank processes: a gang is placed, started, runs and succeeds; a fatal Xid moves its
ranks to a spare; a failing rank is restarted with backoff until max_restarts; a slow
GPU is flagged as a straggler while a noisy healthy run raises no flag; ranks that exit
while the leader's lease lapses still finish their job."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from kit.agents import AgentSpec, run_agents
from kit.events import follow_events, wait_for
from kit.ranks import FAKE_RANK
from kit.schedulers import (
    AGENTS_LIVENESS_INTERVALS,
    SchedulerThread,
    agents_leader,
    scheduler_settings,
)
from kit.stores import StoreUrls, unique
from pitstop.v1 import common_pb2, jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc


@pytest.fixture
def deciding(stores: StoreUrls, tmp_path: Path) -> Iterator[SchedulerThread]:
    """A leading scheduler on a database of its own, with a short heartbeat. No test here
    waits on a liveness deadline: a broken stream or an Xid is noticed at once."""
    thread = agents_leader(stores, tmp_path, "life")
    yield thread
    thread.stop()


def rank(*options: str) -> list[str]:
    return [sys.executable, str(FAKE_RANK), *options]


def submit(thread: SchedulerThread, **fields: Any) -> jobs_pb2.Job:
    jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
    fields.setdefault("gpus_per_node", 1)
    spec = jobs_pb2.JobSpec(name=unique("life"), **fields)
    return jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job


def get(thread: SchedulerThread, job_id: str) -> jobs_pb2.Job:
    return jobs_pb2_grpc.JobServiceStub(thread.channel()).Get(jobs_pb2.GetJobRequest(job_id=job_id))


def rank_pids(job_id: str) -> list[int]:
    """The job's rank processes (not its standbys), by their environment."""
    import psutil

    pids = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("PITSTOP_JOB_ID") == job_id and env.get("PITSTOP_STANDBY") != "1":
            pids.append(proc.pid)
    return pids


def job_event(events: Iterator[Any], job_id: str, kind: str) -> Any:
    return wait_for(events, lambda e: e.job_id == job_id and e.kind == kind)


def registered(events: Iterator[Any], nodes: list[str]) -> None:
    missing = set(nodes)
    while missing:
        event = wait_for(events, lambda e: e.kind == "node.registered")
        missing.discard(event.node_id)


def test_a_gang_is_placed_started_and_succeeds_with_its_result(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    events = follow_events(deciding.address)
    nodes = ["a0", "a1"]
    with run_agents(deciding.address, short_dir, [AgentSpec(n, gpus=1) for n in nodes]):
        registered(events, nodes)
        job = submit(
            deciding,
            dp=2,
            command=rank(
                "--attach",
                "--steps",
                "5",
                "--step-seconds",
                "0.01",
                "--result",
                "final_weights_sha256=abc123",
            ),
        )
        placed = job_event(events, job.id, "job.placed")
        assert placed.reason == "2 ranks on 2 nodes"
        job_event(events, job.id, "job.starting")
        job_event(events, job.id, "job.running")
        done = job_event(events, job.id, "job.succeeded")
        assert done.to_state == "succeeded"
        finished = get(deciding, job.id)
        assert finished.result["final_weights_sha256"] == "abc123"
        assert {r.node_id for r in finished.rank_map.ranks} == set(nodes)
        assert finished.current_step == 5


def test_a_fatal_xid_moves_the_ranks_to_the_nearest_spare(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    events = follow_events(deciding.address)
    specs = [
        AgentSpec("w0", gpus=1, rack="r1"),
        AgentSpec("w1", gpus=1, rack="r2"),
        AgentSpec("far", gpus=1, rack="r3", role="spare"),
        AgentSpec("near", gpus=1, rack="r1", role="spare"),
    ]
    with run_agents(deciding.address, short_dir, specs):
        registered(events, [s.node_id for s in specs])
        job = submit(deciding, dp=2, command=rank("--attach", "--steps", "3", "--hold"))
        job_event(events, job.id, "job.running")
        before = get(deciding, job.id)
        assert {r.node_id for r in before.rank_map.ranks} == {"w0", "w1"}
        nodes = nodes_pb2_grpc.NodeServiceStub(deciding.channel())
        nodes.InjectFault(
            nodes_pb2.InjectFaultRequest(node_id="w0", fault=common_pb2.Fault(xid=79))
        )
        recovering = job_event(events, job.id, "job.recovering")
        assert "w0" in recovering.reason
        assert "spare near" in recovering.reason  # same rack as w0 beats rack r3
        job_event(events, job.id, "job.recovered")
        after = get(deciding, job.id)
        assert after.generation == before.generation + 1
        assert {r.node_id for r in after.rank_map.ranks} == {"near", "w1"}
        assert after.state == common_pb2.JOB_STATE_RUNNING
        jobs_pb2_grpc.JobServiceStub(deciding.channel()).Cancel(
            jobs_pb2.JobControlRequest(job_id=job.id, reason="test over")
        )


def test_a_rank_a_fatal_xid_ended_waits_for_a_spare_and_never_restarts_on_the_broken_gpu(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    """The agent ends the ranks on a GPU that reported a fatal Xid, so a rank exit follows
    the node's failure: that exit is the node's, and with no spare the job waits for
    capacity rather than restarting its rank in place on the broken GPU. The spare that
    joins later takes the rank, in one new generation."""
    events = follow_events(deciding.address)
    with run_agents(deciding.address, short_dir, [AgentSpec(n, gpus=1) for n in ("x0", "x1")]):
        registered(events, ["x0", "x1"])
        job = submit(deciding, dp=2, min_dp=2, command=rank("--attach", "--steps", "3", "--hold"))
        job_event(events, job.id, "job.running")
        before = get(deciding, job.id)
        nodes_pb2_grpc.NodeServiceStub(deciding.channel()).InjectFault(
            nodes_pb2.InjectFaultRequest(node_id="x0", fault=common_pb2.Fault(xid=79))
        )
        seen: dict[str, Any] = {}
        while not {"job.recovering", "rank.exited"} <= set(seen):
            event = wait_for(events, lambda e: e.job_id == job.id and e.kind not in seen)
            seen[event.kind] = event
        assert "waiting for capacity" in seen["job.recovering"].reason
        assert seen["rank.exited"].node_id == "x0"
        with run_agents(deciding.address, short_dir, [AgentSpec("x2", gpus=1, role="spare")]):
            job_event(events, job.id, "job.recovered")
            after = get(deciding, job.id)
            assert {r.node_id for r in after.rank_map.ranks} == {"x1", "x2"}
            assert (after.generation, after.restarts) == (before.generation + 1, 0)
            log = nodes_pb2_grpc.EventServiceStub(deciding.channel()).List(
                nodes_pb2.ListEventsRequest(job_id=job.id, limit=1000)
            )
            kinds = [e.kind for e in log.events]
            assert "job.restarting" not in kinds, kinds
            jobs_pb2_grpc.JobServiceStub(deciding.channel()).Cancel(
                jobs_pb2.JobControlRequest(job_id=job.id, reason="test over")
            )


def test_a_failing_rank_is_restarted_until_max_restarts_then_the_job_fails(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    events = follow_events(deciding.address)
    with run_agents(deciding.address, short_dir, [AgentSpec("c0", gpus=1)]):
        registered(events, ["c0"])
        job = submit(deciding, dp=1, max_restarts=1, command=rank("--exit-code", "3"))
        restarting = job_event(events, job.id, "job.restarting")
        assert "exit code 3" in restarting.reason
        assert "restart 1 of 1" in restarting.reason
        failed = job_event(events, job.id, "job.failed")
        assert "restarts exhausted" in failed.reason
        final = get(deciding, job.id)
        assert (final.state, final.restarts, final.generation) == (
            common_pb2.JOB_STATE_FAILED,
            1,
            2,
        )


def test_a_slow_gpu_is_flagged_and_a_noisy_healthy_run_is_not(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    events = follow_events(deciding.address)
    with run_agents(
        deciding.address, short_dir, [AgentSpec("s0", gpus=4), AgentSpec("s1", gpus=4)]
    ):
        registered(events, ["s0", "s1"])
        nodes = nodes_pb2_grpc.NodeServiceStub(deciding.channel())
        nodes.InjectFault(
            nodes_pb2.InjectFaultRequest(
                node_id="s0", fault=common_pb2.Fault(gpu_index=1, slow_multiplier=1.3)
            )
        )
        steps = ["--attach", "--step-seconds", "0.1", "--noise", "0.1"]
        slow = submit(deciding, dp=8, gpus_per_node=4, command=rank(*steps, "--steps", "200"))
        job_event(events, slow.id, "job.running")
        placed = get(deciding, slow.id)
        (slow_rank,) = [
            r.rank for r in placed.rank_map.ranks if (r.node_id, r.gpu_index) == ("s0", 1)
        ]
        flagged = job_event(events, slow.id, "job.straggler")
        assert flagged.attributes["rank"] == str(slow_rank)
        assert 1.2 < float(flagged.attributes["slowdown"]) < 1.4
        # Windows of 20 steps after 10 of warm-up: flagged after 3 slow windows.
        job_event(events, slow.id, "job.succeeded")
        shown = get(deciding, slow.id)
        stats = {s.rank: s for s in shown.rank_stats}
        assert stats[slow_rank].straggler
        assert not any(s.straggler for r, s in stats.items() if r != slow_rank)

        nodes.InjectFault(
            nodes_pb2.InjectFaultRequest(
                node_id="s0", fault=common_pb2.Fault(gpu_index=1, clear=True)
            )
        )
        healthy = submit(deciding, dp=8, gpus_per_node=4, command=rank(*steps, "--steps", "1000"))
        job_event(events, healthy.id, "job.succeeded")
        log = nodes_pb2_grpc.EventServiceStub(deciding.channel()).List(
            nodes_pb2.ListEventsRequest(job_id=healthy.id, limit=1000)
        )
        assert "job.straggler" not in [e.kind for e in log.events]
        assert get(deciding, healthy.id).current_step == 1000


def test_pause_and_resume_reach_the_ranks(deciding: SchedulerThread, short_dir: Path) -> None:
    events = follow_events(deciding.address)
    with run_agents(deciding.address, short_dir, [AgentSpec("p0", gpus=1)]):
        registered(events, ["p0"])
        job = submit(deciding, dp=1, command=rank("--attach", "--steps", "2", "--wait-commands"))
        job_event(events, job.id, "job.running")
        jobs = jobs_pb2_grpc.JobServiceStub(deciding.channel())
        paused = jobs.Pause(jobs_pb2.JobControlRequest(job_id=job.id))
        assert paused.state == common_pb2.JOB_STATE_PAUSED
        resumed = jobs.Resume(jobs_pb2.JobControlRequest(job_id=job.id))
        assert resumed.state == common_pb2.JOB_STATE_RUNNING
        with pytest.raises(grpc.RpcError) as err:
            jobs.Resume(jobs_pb2.JobControlRequest(job_id=job.id))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id))


def _refused(record: logging.LogRecord) -> bool:
    """A reconcile step whose decision was refused by the fencing check."""
    if not record.name.startswith("pitstop.scheduler.reconcile") or not record.exc_info:
        return False
    return "leader lease" in str(record.exc_info[1])


def test_ranks_that_exit_while_the_lease_lapses_still_finish_the_job(
    stores: StoreUrls, tmp_path: Path, short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The leader's lease lapses (its renewal is late: a stalled event loop, a slow
    database) just as the ranks exit, with no other scheduler to take over. Decisions
    check the fencing token, not the expiry: nothing is refused, and the job finishes
    while the lease stays lapsed."""
    database_url = stores.fresh_database()
    thread = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path / "scheduler",
            database_url=database_url,
            redis_prefix=f"{stores.redis_prefix}{unique('lapse')}:",
            leader_loops=True,
            heartbeat_interval_seconds=0.5,
            liveness_timeout_intervals=AGENTS_LIVENESS_INTERVALS,
            liveness_startup_grace_seconds=0.0,
        )
    )
    stop = threading.Event()
    lapsed = threading.Event()

    def lapse() -> None:
        # The holder and token stay; only the expiry passes, as when a renewal is late.
        with psycopg.connect(database_url, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute("UPDATE leases SET expires_at = now() - interval '1 second'")
                lapsed.set()
                stop.wait(0.01)

    try:
        events = follow_events(thread.address)
        with run_agents(thread.address, short_dir, [AgentSpec(n, gpus=1) for n in ("x0", "x1")]):
            registered(events, ["x0", "x1"])
            job = submit(
                thread, dp=2, command=rank("--attach", "--steps", "20", "--step-seconds", "0.05")
            )
            job_event(events, job.id, "job.running")
            lapser = threading.Thread(target=lapse, daemon=True)
            lapser.start()
            try:
                assert lapsed.wait(10)
                job_event(events, job.id, "job.succeeded")
            finally:
                stop.set()
                lapser.join()
            done = get(thread, job.id)
            assert done.state == common_pb2.JOB_STATE_SUCCEEDED
            assert done.current_step == 20
            assert not [r.getMessage() for r in caplog.records if _refused(r)]
    finally:
        stop.set()
        thread.stop()


def test_a_dead_rank_is_taken_over_by_the_standby_beside_it(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    """A job with standby processes keeps one beside its ranks; when a rank dies, the
    restart hands it to that waiting process (no fresh start), and the job steps again
    in the new generation."""
    events = follow_events(deciding.address)
    nodes = nodes_pb2_grpc.NodeServiceStub(deciding.channel())
    with run_agents(deciding.address, short_dir, [AgentSpec("b0", gpus=1)]) as agents:
        registered(events, ["b0"])
        job = submit(
            deciding,
            dp=1,
            max_restarts=2,
            standby_processes=True,
            command=rank("--attach", "--steps", "3", "--standby", "--hold"),
        )
        job_event(events, job.id, "job.running")
        deadline = time.monotonic() + 60
        while job.id not in nodes.Get(nodes_pb2.GetNodeRequest(node_id="b0")).standby_job_ids:
            assert time.monotonic() < deadline, "no standby came to wait beside the rank"
            time.sleep(0.1)  # polled: the condition is the node's report
        victim = rank_pids(job.id)
        assert len(victim) == 1
        os.kill(victim[0], signal.SIGKILL)
        restarting = job_event(events, job.id, "job.restarting")
        assert "taken over by the standby beside it on b0" in restarting.reason
        job_event(events, job.id, "job.recovered")
        final = get(deciding, job.id)
        assert (final.state, final.generation) == (common_pb2.JOB_STATE_RUNNING, 2)
        assert agents["b0"].poll() is None


def test_a_job_over_its_project_quota_waits_with_that_reason_until_the_project_frees_gpus(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    """Project "team" may hold one GPU: its second job waits, first in the queue, saying
    so, while another project's job takes a free GPU; it starts once the team's first
    job is cancelled."""
    events = follow_events(deciding.address)
    nodes = ["q0", "q1", "q2"]
    with run_agents(deciding.address, short_dir, [AgentSpec(n, gpus=1) for n in nodes]):
        registered(events, nodes)
        projects = jobs_pb2_grpc.ProjectServiceStub(deciding.channel())
        projects.SetQuota(jobs_pb2.SetQuotaRequest(project="team", gpus=1))
        jobs = jobs_pb2_grpc.JobServiceStub(deciding.channel())
        endless = rank("--attach", "--steps", "100000", "--step-seconds", "0.05")
        first = submit(deciding, dp=1, project="team", command=endless)
        job_event(events, first.id, "job.running")
        second = submit(deciding, dp=1, project="team", command=rank("--attach", "--steps", "2"))
        deadline = time.monotonic() + 30
        while not (waiting := get(deciding, second.id)).reason.startswith("quota:"):
            assert waiting.state == common_pb2.JOB_STATE_PENDING, waiting
            assert time.monotonic() < deadline, f"no quota reason: {waiting.reason!r}"
            time.sleep(0.05)
        assert waiting.reason.startswith("quota: project team holds 1 of its 1 GPUs"), waiting
        assert waiting.queue_position == 1
        other = submit(deciding, dp=1, project="elsewhere", command=endless)
        job_event(events, other.id, "job.running")
        assert get(deciding, second.id).state == common_pb2.JOB_STATE_PENDING
        jobs.Cancel(jobs_pb2.JobControlRequest(job_id=first.id, reason="make room"))
        job_event(events, second.id, "job.succeeded")
        jobs.Cancel(jobs_pb2.JobControlRequest(job_id=other.id, reason="done"))
