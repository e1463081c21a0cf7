"""JobService over real gRPC, PostgreSQL and Redis."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import psycopg
import pytest

from kit.schedulers import SchedulerThread
from kit.stores import unique
from pitstop.v1 import common_pb2, jobs_pb2, jobs_pb2_grpc


def spec(name: str, **fields: Any) -> jobs_pb2.JobSpec:
    values: dict[str, Any] = {"name": name, "command": ["python", "train.py"], "dp": 2}
    values.update(fields)
    return jobs_pb2.JobSpec(**values)


@pytest.fixture
def jobs(scheduler: SchedulerThread) -> Any:
    return jobs_pb2_grpc.JobServiceStub(scheduler.channel())


def test_submit_stores_a_pending_job_with_defaults_and_an_event(jobs: Any) -> None:
    name = unique("tiny")
    job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(name))).job
    assert job.id.startswith("j-")
    assert job.state == common_pb2.JOB_STATE_PENDING
    assert (job.spec.tp, job.spec.pp, job.spec.dp) == (1, 1, 2)
    assert job.spec.gpus_per_node == 8
    assert job.spec.min_dp == 2
    assert job.spec.max_restarts == 3
    assert job.spec.checkpoint.keep_in_memory == 2

    fetched = jobs.Get(jobs_pb2.GetJobRequest(job_id=job.id))
    assert fetched.spec == job.spec
    listed = jobs.List(jobs_pb2.ListJobsRequest(states=[common_pb2.JOB_STATE_PENDING]))
    assert job.id in [j.id for j in listed.jobs]


def test_submit_with_same_request_id_returns_the_first_job(
    jobs: Any, db: psycopg.Connection[Any]
) -> None:
    name = unique("idem")
    key = unique("req")
    first = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(name), request_id=key)).job
    second = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(name), request_id=key)).job
    assert first.id == second.id
    (count,) = db.execute("SELECT count(*) FROM jobs WHERE name = %s", (name,)).fetchone() or (0,)
    assert count == 1


def test_invalid_spec_is_invalid_argument_naming_the_field_and_leaves_no_row(
    jobs: Any, db: psycopg.Connection[Any]
) -> None:
    name = unique("bad")
    with pytest.raises(grpc.RpcError) as err:
        jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(name, tp=3)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.tp" in err.value.details()
    assert "gpus_per_node" in err.value.details()
    (count,) = db.execute("SELECT count(*) FROM jobs WHERE name = %s", (name,)).fetchone() or (0,)
    assert count == 0


def test_unknown_job_is_not_found(jobs: Any) -> None:
    with pytest.raises(grpc.RpcError) as err:
        jobs.Get(jobs_pb2.GetJobRequest(job_id="j-000000000000"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "j-000000000000" in err.value.details()


def test_cancel_is_one_transition_and_a_second_cancel_is_failed_precondition(jobs: Any) -> None:
    job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(unique("cancel")))).job
    cancelled = jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id, reason="not needed"))
    assert cancelled.state == common_pb2.JOB_STATE_CANCELLED
    assert cancelled.reason == "not needed"
    with pytest.raises(grpc.RpcError) as err:
        jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cancelled" in err.value.details()


def test_pause_of_a_pending_job_is_failed_precondition(jobs: Any) -> None:
    job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(unique("pause")))).job
    with pytest.raises(grpc.RpcError) as err:
        jobs.Pause(jobs_pb2.JobControlRequest(job_id=job.id))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only a running job can be paused" in err.value.details()


def test_list_pages_newest_first_without_gaps_or_repeats(jobs: Any) -> None:
    ids = [
        jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(unique("page")))).job.id for _ in range(5)
    ]
    seen: list[str] = []
    token = ""
    while True:
        page = jobs.List(jobs_pb2.ListJobsRequest(page_size=2, page_token=token))
        seen.extend(j.id for j in page.jobs)
        token = page.next_page_token
        if not token:
            break
    assert len(seen) == len(set(seen))
    positions = [seen.index(i) for i in ids]
    assert positions == sorted(positions, reverse=True)


def test_watch_replays_history_and_ends_with_the_terminal_event(jobs: Any) -> None:
    job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(unique("watch")))).job
    stream = jobs.Watch(jobs_pb2.WatchJobRequest(job_id=job.id), timeout=30)
    first = next(stream)
    assert first.kind == "job.submitted"
    assert first.to_state == "pending"
    # The cancel happens while the watcher waits: it must arrive live, then the stream ends.
    threading.Thread(
        target=lambda: jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id, reason="done"))
    ).start()
    rest = list(stream)
    assert [e.kind for e in rest] == ["job.cancel"]
    assert rest[0].from_state == "pending"
    assert rest[0].to_state == "cancelled"
    assert rest[0].id > first.id


def test_a_single_replica_job_is_told_at_submit_that_sdc_goes_unchecked(
    jobs: Any, db: psycopg.Connection[Any]
) -> None:
    single = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(unique("one"), dp=1))).job
    replicated = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec(unique("two"), dp=2))).job
    rows = db.execute(
        "SELECT job_id, reason FROM events WHERE kind = 'job.sdc_unchecked' AND job_id IN (%s, %s)",
        (single.id, replicated.id),
    ).fetchall()
    assert [job_id for job_id, _ in rows] == [single.id]
    assert "dp = 1" in rows[0][1]
    # Stored with the tables the API reads: the skipped steps start empty.
    assert list(jobs.Get(jobs_pb2.GetJobRequest(job_id=single.id)).skipped_steps) == []
