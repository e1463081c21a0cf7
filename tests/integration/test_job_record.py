"""JobService.Record over real gRPC, PostgreSQL and Redis: the code the client saw at
submit, each generation's run record as rank 0's agent sent it on its stream, the
complete durable checkpoints of the catalog, preemptions, goodput, skipped steps and
the result, all in one record."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import grpc
import psycopg
import pytest

from kit.schedulers import SchedulerThread
from kit.stores import StoreUrls, unique
from pitstop.scheduler.auth import Caller, current_caller
from pitstop.scheduler.db.engine import create_engine_for, session_factory
from pitstop.scheduler.domain import Role
from pitstop.scheduler.errors import PermissionDenied
from pitstop.scheduler.services import records
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2, jobs_pb2_grpc

CODE = agent_pb2.CodeVersion(
    git_commit="0123456789abcdef0123456789abcdef01234567",
    dirty=True,
    dirty_digest="ab" * 32,
    working_dir="/home/ada/gpt",
)


@pytest.fixture
def jobs(scheduler: SchedulerThread) -> Any:
    return jobs_pb2_grpc.JobServiceStub(scheduler.channel())


def submit(jobs: Any, code: agent_pb2.CodeVersion | None = None) -> jobs_pb2.Job:
    spec = jobs_pb2.JobSpec(
        name=unique("record"),
        command=["python", "train.py"],
        dp=2,
        env={"SEED": "7", "LR": "0.1"},
    )
    request = jobs_pb2.SubmitJobRequest(spec=spec, code=code)
    return jobs.Submit(request).job


def run_record(job_id: str, generation: int, start_step: int, **fields: Any) -> Any:
    values: dict[str, Any] = {
        "job_id": job_id,
        "generation": generation,
        "code": agent_pb2.CodeVersion(git_commit="f" * 40, working_dir="/srv/gpt"),
        "environment": agent_pb2.EnvironmentVersion(
            python="3.11.7", torch="2.13.0", pitstop="0.1.0", env={"FROM_THE_RANK": "1"}
        ),
        "data_digest": "d" * 64,
        "data_source": "s3://bucket/manifest.json",
        "start_step": start_step,
        **fields,
    }
    return agent_pb2.RunRecord(**values)


def record_with(
    jobs: Any, job_id: str, generations: int, timeout: float = 10.0
) -> jobs_pb2.JobRecord:
    """The job's record once it holds `generations` generations (the agent stream is
    read in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        found: jobs_pb2.JobRecord = jobs.Record(jobs_pb2.JobRecordRequest(job_id=job_id))
        if len(found.generations) >= generations or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def add_durable_shards(db: psycopg.Connection[Any], job_id: str) -> None:
    """Step 10 durable on both ranks (and in memory on a node: not durable), step 20 on
    rank 0 only (a flush in progress), both written by generation 1."""
    for step in (10, 20):
        db.execute(
            "INSERT INTO checkpoints (job_id, step, generation, committed, durable, "
            "manifest_url) VALUES (%s, %s, 1, true, false, '')",
            (job_id, step),
        )
    shards = [
        (10, 1, "", "c1", 300),
        (10, 0, "", "c0", 200),
        (10, 0, "node-a", "c0", 200),
        (20, 0, "", "c2", 100),
    ]
    for step, rank, node, checksum, size in shards:
        db.execute(
            "INSERT INTO checkpoint_shards (job_id, step, rank, node_id, tier, checksum, "
            "size_bytes) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (job_id, step, rank, node, "durable" if not node else "memory", checksum, size),
        )


def test_the_record_holds_what_was_submitted_what_ran_and_what_came_out(
    jobs: Any, scheduler: SchedulerThread, db: psycopg.Connection[Any]
) -> None:
    job = submit(jobs, CODE)
    other = submit(jobs)
    node = unique("record-node")
    stream = scheduler.open_stream(node)
    # Generation 2 first, generation 1 twice (the second replaces the first), a record of
    # an unknown job (dropped; the stream stays) and one that cannot be kept (likewise).
    stream.send(run_record=run_record(job.id, 2, 40, data_digest="e" * 64))
    stream.send(run_record=run_record(job.id, 1, 0, data_digest="stale"))
    stream.send(run_record=run_record(job.id, 1, 0))
    stream.send(run_record=run_record("j-000000000000", 1, 0))
    stream.send(run_record=run_record(job.id, 3, 0, data_source="x" * 5000))
    stream.send(run_record=run_record(other.id, 1, 0))
    add_durable_shards(db, job.id)
    db.execute(
        "UPDATE jobs SET current_step = 57, result = %s, integrity = %s WHERE id = %s",
        (
            json.dumps({"final_weights_sha256": "9" * 64, "steps": "57"}),
            json.dumps({"skipped_steps": [40, 17]}),
            job.id,
        ),
    )
    db.execute(
        "INSERT INTO events (kind, job_id, from_state, to_state, reason, actor, attributes) "
        "VALUES ('job.preempted', %s, 'running', 'pending', 'for a higher priority', "
        "'scheduler', %s)",
        (job.id, json.dumps({"by": other.id, "step": "30"})),
    )

    assert len(record_with(jobs, other.id, 1).generations) == 1  # sent last: all were read
    found = record_with(jobs, job.id, 2)
    assert found.job_id == job.id
    assert found.spec.name == job.spec.name
    assert found.state == common_pb2.JOB_STATE_PENDING
    assert found.created_at == job.created_at
    assert found.submitted_by == "user:anonymous"
    assert found.submitted_code == CODE
    assert found.current_step == 57

    assert [(g.generation, g.start_step) for g in found.generations] == [(1, 0), (2, 40)]
    first, second = found.generations
    assert first.data_digest == "d" * 64  # the second report of generation 1 won
    assert second.data_digest == "e" * 64
    assert first.data_source == "s3://bucket/manifest.json"
    assert first.code.git_commit == "f" * 40
    assert (first.environment.python, first.environment.torch) == ("3.11.7", "2.13.0")
    assert dict(first.environment.env) == {"SEED": "7", "LR": "0.1"}  # the spec's, not the rank's
    assert first.node_id == node
    assert first.recorded_at.seconds > 0

    (checkpoint,) = found.durable_checkpoints
    assert (checkpoint.step, checkpoint.shards, checkpoint.bytes) == (10, 2, 500)
    assert checkpoint.digest == hashlib.sha256(b"c0\nc1\n").hexdigest()
    assert checkpoint.digest == records.shards_digest(["c0", "c1"])

    (preempted,) = found.preemptions
    assert (preempted.by_job_id, preempted.step) == (other.id, 30)
    assert preempted.at.seconds > 0

    assert list(found.skipped_steps) == [17, 40]
    assert dict(found.result) == {"final_weights_sha256": "9" * 64, "steps": "57"}
    assert found.final_weights_hash == "9" * 64
    assert found.HasField("goodput")


def test_a_job_submitted_without_code_has_none_and_no_generations(jobs: Any) -> None:
    job = submit(jobs)
    found = jobs.Record(jobs_pb2.JobRecordRequest(job_id=job.id))
    assert not found.HasField("submitted_code")
    assert (list(found.generations), list(found.durable_checkpoints)) == ([], [])
    assert found.final_weights_hash == ""


def test_the_record_of_an_unknown_job_is_not_found(jobs: Any) -> None:
    with pytest.raises(grpc.RpcError) as err:
        jobs.Record(jobs_pb2.JobRecordRequest(job_id="j-000000000000"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "j-000000000000" in err.value.details()


async def test_a_token_of_another_project_may_not_read_the_record(
    jobs: Any, stores: StoreUrls
) -> None:
    job = submit(jobs)
    engine = create_engine_for(stores.database_url, pool_size=1)
    sessions = session_factory(engine)
    limited = Caller("token:other", frozenset({Role.VIEWER}), projects=frozenset({"other"}))
    reset = current_caller.set(limited)
    try:
        async with sessions() as session:
            with pytest.raises(PermissionDenied, match=f"read the record of job {job.id}"):
                await records.job_record(session, job.id)
        current_caller.set(Caller("token:default", limited.roles, projects=frozenset({"default"})))
        async with sessions() as session:
            assert (await records.job_record(session, job.id)).job_id == job.id
    finally:
        current_caller.reset(reset)
        await engine.dispose()
