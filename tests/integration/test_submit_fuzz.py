"""Fuzzing Submit: no input crashes the server or leaves a partial row."""

from __future__ import annotations

from typing import Any

import grpc
import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit.fuzzing import FUZZ_TIMEOUT, fuzz_settings
from kit.schedulers import SchedulerThread
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc

# Valid UTF-8 only: protobuf itself refuses to encode lone surrogates.
text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=80)
small_uint = st.one_of(st.integers(0, 20), st.integers(0, 2**32 - 1))
names = st.one_of(text, st.from_regex(r"[a-z][a-z0-9-]{0,62}", fullmatch=True))

checkpoints = st.builds(
    jobs_pb2.CheckpointPolicy,
    snapshot_every_steps=small_uint,
    durable_every_steps=small_uint,
    durable_url=st.one_of(text, st.just("file:///tmp/ckpt"), st.just("s3://b/p")),
    keep_in_memory=small_uint,
    keep_durable=small_uint,
    auto_interval=st.booleans(),
)
stragglers = st.builds(
    jobs_pb2.StragglerPolicy,
    action=st.integers(0, 5),
    threshold=st.floats(allow_nan=True, allow_infinity=True),
    windows=small_uint,
    window_steps=small_uint,
    warmup_steps=small_uint,
)
specs = st.builds(
    jobs_pb2.JobSpec,
    name=names,
    command=st.lists(text, max_size=4),
    tp=small_uint,
    pp=small_uint,
    dp=small_uint,
    gpus_per_node=small_uint,
    min_dp=small_uint,
    spares=small_uint,
    priority=st.integers(-(2**31), 2**31 - 1),
    max_restarts=small_uint,
    checkpoint=checkpoints,
    env=st.dictionaries(text, text, max_size=3),
    straggler=stragglers,
    working_dir=text,
)


def counts(db: psycopg.Connection[Any]) -> tuple[int, int]:
    row = db.execute("SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM events)")
    jobs, events = row.fetchone() or (0, 0)
    return int(jobs), int(events)


@FUZZ_TIMEOUT
@fuzz_settings(150)
@given(spec=specs, request_id=st.one_of(st.just(""), text))
def test_submit_is_accepted_whole_or_refused_with_nothing_written(
    scheduler: SchedulerThread,
    db: psycopg.Connection[Any],
    spec: jobs_pb2.JobSpec,
    request_id: str,
) -> None:
    jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
    before = counts(db)
    request = jobs_pb2.SubmitJobRequest(spec=spec, request_id=request_id)
    try:
        reply = jobs.Submit(request, timeout=10)
    except grpc.RpcError as err:
        code, details = err.code(), err.details()
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.split(":")[0]  # names a field
        assert counts(db) == before
        return
    after = counts(db)
    created = reply.job.id
    stored = db.execute("SELECT name FROM jobs WHERE id = %s", (created,)).fetchone()
    assert stored is not None
    if after[0] == before[0]:
        assert request_id  # an idempotent repeat returns the first job and writes nothing
        assert after == before
    else:
        # job.submitted, and for a single replica job.sdc_unchecked (no replica to compare)
        told = (
            2 if reply.job.spec.dp == 1 and not reply.job.spec.integrity.sdc_check_disabled else 1
        )
        assert after == (before[0] + 1, before[1] + told)


def test_garbage_bytes_do_not_take_the_server_down(
    scheduler: SchedulerThread, db: psycopg.Connection[Any]
) -> None:
    channel = scheduler.channel()
    raw = channel.unary_unary(
        "/pitstop.v1.JobService/Submit",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    before = counts(db)
    for garbage in (b"\xff\xff\xff", b"\x0a\x05\x0a\x03\xff\xfe\xfd", bytes(range(256))):
        with pytest.raises(grpc.RpcError) as err:
            raw(garbage, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("request: ")
    assert counts(db) == before
    jobs = jobs_pb2_grpc.JobServiceStub(channel)
    jobs.List(jobs_pb2.ListJobsRequest(page_size=1), timeout=5)
