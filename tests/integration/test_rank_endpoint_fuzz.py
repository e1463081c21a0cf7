"""Bad input at the agent's rank endpoint (issue 28): RankControl, the Unix socket a
node's ranks call, fuzzed with hypothesis-built requests.

The endpoint runs as the agent runs it, on its own event loop, with two held ranks of
one job started by its supervisor; the requests mostly name those ranks, so they reach
past the first check. Whatever the request: it is answered, or refused with a code a
rank can act on and details (never UNKNOWN or INTERNAL, never a traceback), and the
endpoint still serves.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import event, given
from hypothesis import strategies as st

from kit.dirs import short_tempdir
from kit.fuzzing import FUZZ_TIMEOUT, assert_clear, call_method, fuzz_settings, messages
from kit.ranks import NODE, ExitLog
from pitstop.agent.gpu import open_backend
from pitstop.agent.local import LocalEndpoint
from pitstop.agent.steps import StepSummarizer
from pitstop.agent.supervisor import RankSupervisor
from pitstop.rankside.rankclient import RANK_KEY_METADATA
from pitstop.v1 import agent_pb2, common_pb2, rank_pb2

pytestmark = FUZZ_TIMEOUT
JOB = "job-fuzz"
KEY = "the-fuzzer-is-a-process-the-agent-started"
TIMEOUT = 10.0
# Commands and Standby wait for the agent: they get a short deadline, and reaching it
# is fine.
WAIT_TIMEOUT = 0.3
WAITING = {"Commands", "Standby"}
METHODS = {m.name: m for m in rank_pb2.DESCRIPTOR.services_by_name["RankControl"].methods}


class RankEndpoint:
    """A LocalEndpoint and its supervisor on an event loop of their own (as in the
    agent), holding ranks 0 and 1 of JOB; calls come from the test's thread."""

    def __init__(self, root: Path) -> None:
        self.socket_path = root / "agent.sock"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start(root))
        self.channel = grpc.insecure_channel(f"unix:{self.socket_path}")

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(60)

    async def _start(self, root: Path) -> None:
        self.backend = open_backend("sim:2", NODE)
        self.supervisor = RankSupervisor(
            NODE, self.socket_path, root / "logs", ExitLog(), "127.0.0.1:7070"
        )
        started = self.supervisor.started
        self.supervisor.started = lambda key: key == KEY or started(key)  # type: ignore[method-assign]
        self.endpoint = LocalEndpoint(
            self.socket_path, self.backend, self.supervisor, StepSummarizer(), "127.0.0.1:7070"
        )
        await self.endpoint.start()
        ranks = [
            common_pb2.RankAssignment(rank=r, node_id=NODE, gpu_index=r, local_rank=r)
            for r in (0, 1)
        ]
        await self.supervisor.start_ranks(
            agent_pb2.StartRanks(
                job_id=JOB,
                generation=1,
                command=[sys.executable, "-c", "import signal; signal.pause()"],
                rank_map=common_pb2.RankMap(generation=1, world_size=2, ranks=ranks),
            )
        )

    def stop(self) -> None:
        self.channel.close()
        self._call(self.supervisor.shutdown(grace_seconds=1.0))
        self._call(self.endpoint.stop())
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def call(self, method: MethodDescriptor, request: Any) -> None:
        waits = method.name in WAITING
        timeout = WAIT_TIMEOUT if waits else TIMEOUT
        metadata = ((RANK_KEY_METADATA, KEY),)
        call_method(self.channel, method, request, metadata, timeout, until_deadline=waits)


@pytest.fixture
def rank_endpoint() -> Iterator[RankEndpoint]:
    """One endpoint per fuzzed method (hypothesis runs all of a test's examples in one
    set-up): a fault one method injects does not change what the next one sees."""
    with short_tempdir("ps-fz-") as root:  # Unix socket paths are short
        endpoint = RankEndpoint(root)
        try:
            yield endpoint
        finally:
            endpoint.stop()


@st.composite
def requests(draw: st.DrawFn, method: MethodDescriptor) -> Any:
    """Any request; most name one of the endpoint's ranks, so they get past the first
    check."""
    request = draw(messages(method.input_type))
    fields = method.input_type.fields_by_name
    if "job_id" in fields and draw(st.integers(0, 3)):
        request.job_id = JOB
        if "rank" in fields:
            request.rank = draw(st.sampled_from([0, 1, request.rank]))
    return request


def assert_still_serving(rank_endpoint: RankEndpoint) -> None:
    """The endpoint answers a held rank's Attach."""
    attach = rank_pb2.AttachRequest(job_id=JOB, rank=1)
    rank_endpoint.call(METHODS["Attach"], attach)


@pytest.mark.parametrize("name", sorted(METHODS))
@fuzz_settings(20)
@given(data=st.data())
def test_any_rank_request_is_answered_or_refused_clearly(
    rank_endpoint: RankEndpoint, name: str, data: Any
) -> None:
    method = METHODS[name]
    request = data.draw(requests(method), label="request")
    try:
        rank_endpoint.call(method, request)
        event("served")
    except grpc.RpcError as err:
        assert_clear(err, (name, request))
        event(err.code().name)  # type: ignore[attr-defined]
    if name != "InjectFault":  # a fault may end the held ranks: that is its point
        assert_still_serving(rank_endpoint)
