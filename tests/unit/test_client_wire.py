"""PitstopClient against an in-process gRPC server on port 0: retries on UNAVAILABLE with
one idempotency key, the bearer token, status mapping, paging, and watch resumption.

The servicer here is a scripted stand-in for the scheduler; the transport is real gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pitstop.client import PitstopClient, PitstopError
from pitstop.v1 import common_pb2, jobs_pb2, jobs_pb2_grpc


class ScriptedJobs(jobs_pb2_grpc.JobServiceServicer):
    # Method names are the RPC names the generated servicer dispatches to.

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unavailable_left = 0
        self.submit_request_ids: list[str] = []
        self.authorization: list[str | None] = []
        self.watch_cursors: list[int] = []
        self.page_tokens: list[str] = []

    def Submit(self, request: jobs_pb2.SubmitJobRequest, context: Any) -> Any:  # noqa: N802
        with self.lock:
            self.submit_request_ids.append(request.request_id)
            self.authorization.append(dict(context.invocation_metadata()).get("authorization"))
            if self.unavailable_left > 0:
                self.unavailable_left -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "leader election in progress")
        return jobs_pb2.SubmitJobResponse(job=jobs_pb2.Job(id="j-1", spec=request.spec))

    def Get(self, request: jobs_pb2.GetJobRequest, context: Any) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.job_id!r} not found")

    def Cancel(self, request: jobs_pb2.JobControlRequest, context: Any) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "job j-1 already ended")

    def List(self, request: jobs_pb2.ListJobsRequest, context: Any) -> Any:  # noqa: N802
        self.page_tokens.append(request.page_token)
        page = int(request.page_token or "0")
        jobs = [jobs_pb2.Job(id=f"j-{page}-{i}") for i in range(request.page_size)]
        return jobs_pb2.ListJobsResponse(
            jobs=jobs, next_page_token=str(page + 1) if page < 2 else ""
        )

    def Watch(self, request: jobs_pb2.WatchJobRequest, context: Any) -> Iterator[common_pb2.Event]:  # noqa: N802
        self.watch_cursors.append(request.after_event_id)
        for event_id in range(request.after_event_id + 1, 5):
            yield common_pb2.Event(id=event_id, kind="job.state", job_id=request.job_id)
            if len(self.watch_cursors) == 1 and event_id == 2:
                # The first stream breaks after two events, as on a scheduler failover.
                context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler shutting down")


@pytest.fixture
def scripted() -> Iterator[tuple[ScriptedJobs, str]]:
    servicer = ScriptedJobs()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    jobs_pb2_grpc.add_JobServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_submit_retries_unavailable_with_one_request_id(scripted: tuple[ScriptedJobs, str]) -> None:
    servicer, address = scripted
    servicer.unavailable_left = 2
    with PitstopClient(address, token="s3cret", timeout=5) as client:
        job = client.submit_job(jobs_pb2.JobSpec(name="tiny"))
    assert job.id == "j-1"
    assert len(servicer.submit_request_ids) == 3
    assert len(set(servicer.submit_request_ids)) == 1
    assert len(servicer.submit_request_ids[0]) == 32  # a uuid4 hex
    assert servicer.authorization == ["Bearer s3cret"] * 3


def test_caller_request_id_is_kept(scripted: tuple[ScriptedJobs, str]) -> None:
    servicer, address = scripted
    with PitstopClient(address) as client:
        client.submit_job(jobs_pb2.JobSpec(name="tiny"), request_id="mine")
    assert servicer.submit_request_ids == ["mine"]
    assert servicer.authorization == [None]


def test_unavailable_gives_up_after_bounded_attempts(scripted: tuple[ScriptedJobs, str]) -> None:
    servicer, address = scripted
    servicer.unavailable_left = 100
    with PitstopClient(address, max_attempts=3) as client, pytest.raises(PitstopError) as caught:
        client.submit_job(jobs_pb2.JobSpec(name="tiny"))
    assert len(servicer.submit_request_ids) == 3
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details == "leader election in progress"
    assert not caught.value.unreachable


def test_status_codes_surface_as_pitstop_errors(scripted: tuple[ScriptedJobs, str]) -> None:
    _, address = scripted
    with PitstopClient(address) as client:
        with pytest.raises(PitstopError) as not_found:
            client.get_job("j-404")
        with pytest.raises(PitstopError) as ended:
            client.cancel_job("j-1")
    assert str(not_found.value) == "job 'j-404' not found (NOT_FOUND)"
    assert ended.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_list_jobs_follows_pages(scripted: tuple[ScriptedJobs, str]) -> None:
    servicer, address = scripted
    with PitstopClient(address) as client:
        jobs = client.list_jobs(page_size=2)
    assert [job.id for job in jobs] == ["j-0-0", "j-0-1", "j-1-0", "j-1-1", "j-2-0", "j-2-1"]
    assert servicer.page_tokens == ["", "1", "2"]


def test_watch_resumes_after_the_last_event(scripted: tuple[ScriptedJobs, str]) -> None:
    servicer, address = scripted
    with PitstopClient(address) as client:
        ids = [event.id for event in client.watch_job("j-1")]
    assert ids == [1, 2, 3, 4]
    assert servicer.watch_cursors == [0, 2]


def test_unreachable_server_is_recognised() -> None:
    # Port 1 on loopback refuses connections; no server is involved.
    with (
        PitstopClient("127.0.0.1:1", max_attempts=2) as client,
        pytest.raises(PitstopError) as caught,
    ):
        client.list_nodes()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.unreachable


def test_from_env(monkeypatch: pytest.MonkeyPatch, scripted: tuple[ScriptedJobs, str]) -> None:
    servicer, address = scripted
    monkeypatch.setenv("PITSTOP_SERVER", address)
    monkeypatch.setenv("PITSTOP_TOKEN", "from-env")
    with PitstopClient.from_env() as client:
        assert client.server == address
        client.submit_job(jobs_pb2.JobSpec(name="tiny"))
    assert servicer.authorization == ["Bearer from-env"]
