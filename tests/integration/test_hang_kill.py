"""A hung rank killed on the scheduler's word whose exit never comes (the process gone
with no exit on record, or a stop its agent never carried out) does not leave its job
waiting: once the kill's wait is over, the scheduler records the rank as killed and
the job restarts as it would from the exit. (A late report of the same exit is recorded
once: tests/integration/test_lost_exits.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from kit.events import follow_events
from kit.schedulers import hand_driven_leader
from kit.stores import StoreUrls, unique
from pitstop.scheduler.reconcile import hangs
from pitstop.v1 import agent_pb2, jobs_pb2, jobs_pb2_grpc

KILL_WAIT = 2.0


def summary(job_id: str, generation: int, step: int) -> agent_pb2.StepSummary:
    at = Timestamp()
    at.FromNanoseconds(time.time_ns())
    return agent_pb2.StepSummary(
        job_id=job_id,
        generation=generation,
        ranks=1,
        slowest_step=step,
        newest_step=step,
        samples=1,
        time=at,
    )


def test_a_hung_rank_killed_without_an_exit_is_recorded_killed_and_restarted(
    stores: StoreUrls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hangs, "KILL_EXIT_WAIT_SECONDS", KILL_WAIT)
    database = stores.fresh_database()
    thread = hand_driven_leader(stores, tmp_path, database=database)
    try:
        node = thread.open_stream("w0", gpus=1, rack="r0")
        jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
        spec = jobs_pb2.JobSpec(
            name=unique("hung"),
            command=["train"],
            dp=1,
            gpus_per_node=1,
            integrity=jobs_pb2.IntegrityPolicy(hang_floor_seconds=1),
        )
        job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
        started = node.acked_start()
        events = follow_events(thread.address, timeout=60)
        try:
            for step in (1, 2, 3):  # then no step: the rank hangs
                node.send(step_summary=summary(job.id, started.generation, step))
            while (asked := node.next_command(timeout=30)).WhichOneof("body") != "dump_stacks":
                pass
            node.send(
                stacks=agent_pb2.RankStacks(
                    job_id=job.id,
                    generation=started.generation,
                    rank=0,
                    incident=asked.dump_stacks.incident,
                    method="py-spy",
                    text='Thread 1 (idle): "MainThread"\n    train (train.py:10)\n',
                )
            )
            while (stop := node.next_command(timeout=60)).WhichOneof("body") != "stop_ranks":
                pass
            assert stop.stop_ranks.kill, stop
            assert list(stop.stop_ranks.ranks) == [0], stop
            stopped_at = time.monotonic()
            # The agent acknowledges the stop but never reports the rank's exit.
            node.send(ack=agent_pb2.CommandAck(command_id=stop.command_id, ok=True))
            again = node.acked_start(timeout=60)
            waited = time.monotonic() - stopped_at
            assert again.generation > started.generation, (again, started)
            assert waited >= KILL_WAIT, waited  # not before the exit's wait was over
            kinds = []
            for event in events:
                if event.job_id == job.id:
                    kinds.append(event.kind)
                if event.job_id == job.id and event.kind == "job.restarting":
                    break
            assert "rank.exited" in kinds, kinds
            with psycopg.connect(database) as db:
                exits = db.execute(
                    "SELECT actor, reason FROM events WHERE kind = 'rank.exited' AND job_id = %s",
                    (job.id,),
                ).fetchall()
            assert len(exits) == 1, exits
            actor, reason = exits[0]
            assert actor == "scheduler", exits
            assert "signal 9" in reason, reason
            assert "no exit within 2 s" in reason, reason
        finally:
            events.close()
    finally:
        thread.stop()
