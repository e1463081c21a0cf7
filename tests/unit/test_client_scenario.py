"""The fault driver never waits forever: a job that stops stepping, or that is not over
by its deadline, ends the run with JobStuck, whose message is what the scheduler last
decided and why. A fake cluster and client, and an injected clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.client.localcluster import LocalCluster
from pitstop.client.scenario import (
    Driver,
    JobStuck,
    _pace,
    example_command,
    example_spec,
    format_event,
    run_deadline,
)
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2


def event(id_: int, kind: str, reason: str, job_id: str = "", node_id: str = "") -> Any:
    return common_pb2.Event(
        id=id_,
        time=Timestamp(seconds=1_700_000_000 + id_),
        kind=kind,
        job_id=job_id,
        node_id=node_id,
        reason=reason,
    )


EVENTS = [
    event(1, "job.running", "every rank started", job_id="j1"),
    event(2, "node.lost", "stream broken", node_id="node-2"),
    event(3, "job.recovering", "node-2 lost; waiting for a spare", job_id="j1"),
]


class FakeClient:
    def __init__(self, steps: Iterator[int]) -> None:
        self.steps = steps

    def submit_job(
        self, spec: jobs_pb2.JobSpec, code: agent_pb2.CodeVersion | None = None
    ) -> jobs_pb2.Job:
        return jobs_pb2.Job(id="j1", state=common_pb2.JOB_STATE_PENDING)

    def job_record(self, job_id: str) -> jobs_pb2.JobRecord:
        return jobs_pb2.JobRecord(job_id=job_id)

    def get_job(self, job_id: str) -> jobs_pb2.Job:
        return jobs_pb2.Job(
            id=job_id,
            state=common_pb2.JOB_STATE_RECOVERING,
            current_step=next(self.steps),
            reason="node-2 lost",
        )

    def list_events(
        self, job_id: str = "", node_id: str = "", after_event_id: int = 0, limit: int = 100
    ) -> list[common_pb2.Event]:
        return [e for e in EVENTS if not job_id or e.job_id == job_id]

    def watch_events(self) -> Iterator[common_pb2.Event]:
        return iter(())

    def close(self) -> None:
        pass


class FakeCluster:
    def __init__(self, state_dir: Path, steps: Iterator[int]) -> None:
        self.state_dir = state_dir
        self._client = FakeClient(steps)

    def client(self, timeout: float = 10.0) -> FakeClient:
        return self._client


class Clock:
    """Each look at the time is `tick` seconds after the last."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def driver(tmp_path: Path, steps: Iterator[int], **options: Any) -> Driver:
    cluster = cast(LocalCluster, FakeCluster(tmp_path, steps))
    return Driver(cluster, poll=0.0, clock=Clock(5.0), **options)


def spec(steps: int = 100) -> jobs_pb2.JobSpec:
    return example_spec("t", dp=2, steps=steps, step_seconds=0.1, spares=1)


def test_a_job_without_steps_is_stuck(tmp_path: Path) -> None:
    forever_at_7 = iter(lambda: 7, None)
    d = driver(tmp_path, forever_at_7, stall_timeout=60)
    with pytest.raises(JobStuck) as stuck:
        d.run(spec(), [])
    message = str(stuck.value)
    assert message.startswith("no step for 6")
    assert "job j1 is recovering at step 7 (node-2 lost); what the scheduler last decided:" in (
        message
    )
    lines = message.splitlines()[1:]
    assert [line.strip().split(" ", 2)[1:] for line in lines] == [
        ["job.running", "j1: every rank started"],
        ["node.lost", "node-2: stream broken"],
        ["job.recovering", "j1: node-2 lost; waiting for a spare"],
    ]
    assert stuck.value.job.current_step == 7


def test_a_stepping_job_past_its_deadline_is_stuck(tmp_path: Path) -> None:
    counting = iter(range(10**6))
    d = driver(tmp_path, counting, stall_timeout=60)
    with pytest.raises(JobStuck, match=r"^not over after 100 s: job j1 is recovering"):
        d.run(spec(), [], timeout=100)


def test_steps_in_rank_logs_count_as_progress(tmp_path: Path) -> None:
    """The scheduler's step may lag (or roll back in a recovery): a rank logging steps
    is progress too."""
    log = tmp_path / "nodes" / "node-1" / "agent" / "ranks" / "j1" / "rank-0.log"
    log.parent.mkdir(parents=True)
    log.touch()
    written = 0

    def steps() -> Iterator[int]:
        nonlocal written
        while written < 40:  # ranks log a step per look for a while, then stop
            with log.open("a") as out:
                out.write(f'{{"rank": 0, "step": {written % 5}, "loss": 1.0}}\n')
            written += 1
            yield 3
        while True:
            yield 3

    d = driver(tmp_path, steps(), stall_timeout=30)
    with pytest.raises(JobStuck, match="no step for"):
        d.run(spec(), [], timeout=10_000)
    assert written == 40  # 40 looks x 5 s, far past the 30 s stall: logged steps kept it going


def test_run_deadline_grows_with_steps_pace_and_faults() -> None:
    assert run_deadline(150, 0.1, 2) == pytest.approx(120 + 150 * 0.8 + 120)
    assert run_deadline(300, 0.1, 2) > run_deadline(150, 0.1, 2)
    assert run_deadline(150, 0.2, 2) > run_deadline(150, 0.1, 2)
    assert run_deadline(150, 0.1, 3) > run_deadline(150, 0.1, 2)


def test_pace_is_read_from_the_example_command() -> None:
    assert _pace(spec(123)) == (123, 0.1)
    assert _pace(jobs_pb2.JobSpec(command=example_command(50, 0.0))) == (50, 0.0)
    assert _pace(jobs_pb2.JobSpec(command=["train.py"])) == (200, 0.0)


def test_format_event() -> None:
    line = format_event(
        common_pb2.Event(
            kind="job.state",
            job_id="j1",
            from_state="running",
            to_state="recovering",
            reason="node-2 lost",
        )
    )
    assert line.split(" ", 1)[1] == "job.state j1 running -> recovering: node-2 lost"
