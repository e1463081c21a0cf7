"""The scheduler's request check: a NUL anywhere in a request's text is named by its
path (PostgreSQL text cannot hold NUL, so no such value can be stored or looked up)."""

from __future__ import annotations

from typing import Any

import pytest

from pitstop.scheduler.rpcwrap import nul_field
from pitstop.v1 import common_pb2, jobs_pb2, nodes_pb2


@pytest.mark.parametrize(
    ("request_", "found"),
    [
        (nodes_pb2.WatchEventsRequest(job_id="\x00"), ("job_id", "\x00")),
        (jobs_pb2.SubmitJobRequest(spec=jobs_pb2.JobSpec(name="a\x00b")), ("spec.name", "a\x00b")),
        (
            jobs_pb2.SubmitJobRequest(spec=jobs_pb2.JobSpec(command=["python", "x\x00"])),
            ("spec.command[1]", "x\x00"),
        ),
        (
            jobs_pb2.SubmitJobRequest(spec=jobs_pb2.JobSpec(env={"K\x00": "v"})),
            ("spec.env key", "K\x00"),
        ),
        (
            jobs_pb2.SubmitJobRequest(spec=jobs_pb2.JobSpec(env={"K": "v\x00"})),
            ("spec.env['K']", "v\x00"),
        ),
        (
            common_pb2.RankMap(
                ranks=[common_pb2.RankAssignment(), common_pb2.RankAssignment(node_id="\x00")]
            ),
            ("ranks[1].node_id", "\x00"),
        ),
    ],
)
def test_a_nul_is_found_by_its_path(request_: Any, found: tuple[str, str]) -> None:
    assert nul_field(request_) == found


def test_a_request_without_nul_passes() -> None:
    spec = jobs_pb2.JobSpec(name="a", command=["python", "-m", "x"], env={"K": "v"})
    assert nul_field(jobs_pb2.SubmitJobRequest(spec=spec, request_id="r-1")) is None
    assert nul_field(jobs_pb2.ListJobsRequest()) is None
