"""The agent's local endpoint: the RankControl service on a Unix socket.

Ranks attach, report steps and results, receive commands and acknowledge them;
standby processes on a spare wait here to be handed a rank; drills inject faults.
The socket file is made mode 0600 in a 0700 directory, so only the agent's user (the
user the ranks run as) can reach it; and every call must carry the secret rank key the
agent gave the process it started (PITSTOP_RANK_KEY), so the user's other processes
cannot talk to it either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.agent import rankerrors as errors
from pitstop.agent.gpu.base import FaultNotSupported, GpuBackend
from pitstop.agent.rankerrors import RankErrorInterceptor
from pitstop.agent.steps import StepSummarizer
from pitstop.agent.supervisor import RankSupervisor
from pitstop.common import timestamps
from pitstop.common.rpcguard import refusing
from pitstop.rankside.rankclient import RANK_KEY_ENV, RANK_KEY_METADATA
from pitstop.v1 import agent_pb2, common_pb2, rank_pb2, rank_pb2_grpc

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH_BYTES = 107
# Ack futures kept for late waiters; the oldest go first beyond this.
MAX_TRACKED_ACKS = 4096

_Key = tuple[str, int]
_Stream = asyncio.Queue[rank_pb2.RankCommand | None]
# A waiting standby call: its future, its gRPC context and the process id it gave.
_Waiter = tuple[asyncio.Future[rank_pb2.StandbyAssignment], Any, int]


class LocalEndpoint:
    """Serves RankControl to the ranks of this node over `socket_path`.

    Its state lives on the event loop: call every method from the loop.
    """

    def __init__(
        self,
        socket_path: Path,
        backend: GpuBackend,
        supervisor: RankSupervisor,
        steps: StepSummarizer,
        checkpointd_address: str = "",
        allow_fault_injection: bool = True,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.backend = backend
        self.supervisor = supervisor
        self.steps = steps
        self.checkpointd_address = checkpointd_address
        self.allow_fault_injection = allow_fault_injection
        self.inject: Callable[[common_pb2.Fault], None] = backend.inject_fault
        """Carries out a drill: the node's FaultInjector where the agent has one."""
        self._server: Any = None
        self._generations: dict[str, tuple[int, int]] = {}
        self._streams: dict[_Key, _Stream] = {}
        # Commands each rank has not acknowledged, with the pid of the process they went
        # to: a restarted rank must not get its predecessor's commands.
        self._unacked: dict[_Key, tuple[int, dict[int, rank_pb2.RankCommand]]] = {}
        self._acks: OrderedDict[int, asyncio.Future[rank_pb2.RankAck]] = OrderedDict()
        self._standby: dict[str, list[_Waiter]] = {}
        # GPU and pid of ranks handed to standby processes, which the supervisor did not
        # spawn as those ranks.
        self._adopted: dict[_Key, tuple[int, int]] = {}
        # Replaced on every change, so waiters wake without polling.
        self._changed = asyncio.Event()
        self.on_finding: Callable[[agent_pb2.IntegrityFinding], None] = lambda _finding: None
        """Called with each integrity finding a rank reports (its GPU filled in)."""
        self.on_run_record: Callable[[agent_pb2.RunRecord], None] = lambda _record: None
        """Called with each run record a rank reports (what its generation runs)."""
        self.report_soon: Callable[[], None] = lambda: None
        """Called when something the scheduler acts on changed here: a standby process
        started waiting for a rank or was handed one, a job stepped in a new generation
        (it resumed). The agent reports it at once rather than at the next heartbeat."""

    async def start(self) -> None:
        """Serve on `unix:<socket_path>`, replacing a stale socket file. Raises
        RuntimeError when another process serves that path."""
        path = self.socket_path
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"agent socket path {str(path)!r} is longer than {MAX_SOCKET_PATH_BYTES} "
                "bytes, the Unix socket limit; choose a shorter path"
            )
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_stale_socket(path)
        interceptors = [_StartedHere(self.supervisor.started), RankErrorInterceptor()]
        server = grpc.aio.server(interceptors=interceptors)
        rank_pb2_grpc.add_RankControlServicer_to_server(_RankControlServicer(self), server)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        os.chmod(path, 0o600)
        self._server = server
        logger.info("rank endpoint serving on unix:%s", path)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (open streams and standby calls end) and remove the socket."""
        # End the calls that would otherwise hold the server for the whole grace.
        for queue in self._streams.values():
            queue.put_nowait(None)
        for waiting in self._standby.values():
            for future, _, _ in waiting:
                if not future.done():
                    future.set_exception(_Stopping())
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    async def send_command(self, job_id: str, rank: int, command: rank_pb2.RankCommand) -> bool:
        """Queue `command` on the rank's Commands stream; False when it has none open.

        A new stream of the rank gets it again until the rank acknowledges it. Acks are
        matched by id alone, so every command sent needs its own nonzero command_id.
        """
        if command.command_id == 0:
            raise ValueError(f"command for rank {rank} of job {job_id!r} has command_id 0")
        pending = self._acks.get(command.command_id)
        if pending is not None and not pending.done():
            raise ValueError(
                f"command_id {command.command_id} still waits for an ack; give each "
                "rank's command its own id"
            )
        queue = self._streams.get((job_id, rank))
        if queue is None:
            return False
        self._track_ack(command.command_id)
        unacked = self._unacked_by_current((job_id, rank))
        if not unacked:
            self._unacked[(job_id, rank)] = (self._pid_of((job_id, rank)) or 0, unacked)
        unacked[command.command_id] = command
        queue.put_nowait(command)
        return True

    async def wait_ack(self, command_id: int, timeout: float) -> rank_pb2.RankAck | None:
        """The rank's ack of `command_id`, or None when none comes within `timeout` s."""
        future = self._acks.get(command_id)
        if future is None:
            future = self._track_ack(command_id)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return None

    def set_generation(
        self,
        job_id: str,
        generation: int,
        restore_step: int,
        windows: agent_pb2.StepWindows | None = None,
    ) -> None:
        """The generation and restore step Attach answers for `job_id`; `windows`: how
        its step times are folded (the job's straggler policy)."""
        self._generations[job_id] = (generation, restore_step)
        self.steps.expect(job_id, generation, restore_step, windows)

    async def assign_standby(
        self, job_id: str, assignment: rank_pb2.StandbyAssignment, pid: int | None = None
    ) -> bool:
        """Hand `assignment` to the longest-waiting standby call of `job_id` (of process
        `pid` when given); False when none waits."""
        for waiter in list(self._standby.get(job_id, [])):
            future, context, caller = waiter
            if future.done() or context.cancelled() or (pid is not None and caller != pid):
                continue
            self._standby[job_id].remove(waiter)
            future.set_result(assignment)
            self._adopted[(job_id, assignment.rank)] = (assignment.gpu_index, caller)
            self._notify()
            self.report_soon()
            return True
        return False

    def standby_waits(self, job_id: str, pid: int) -> bool:
        """Whether process `pid` waits in a standby call of `job_id` now."""
        return any(
            caller == pid and not future.done() and not context.cancelled()
            for future, context, caller in self._standby.get(job_id, [])
        )

    async def wait_standby_process(
        self, job_id: str, pid: int, timeout: float, alive: Callable[[], bool]
    ) -> bool:
        """Wait up to `timeout` s for process `pid` to wait in a standby call of `job_id`
        (it may still be importing); False at once when `alive()` turns false."""
        deadline = asyncio.get_running_loop().time() + timeout
        while alive() and not self.standby_waits(job_id, pid):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            # Woken by any change here; `alive` is looked at again at least twice a second.
            await self._wait_until(lambda: self.standby_waits(job_id, pid), min(left, 0.5))
        return self.standby_waits(job_id, pid)

    @property
    def standby_count(self) -> int:
        """Standby processes waiting for a rank, all jobs together."""
        return sum(self._standby_waiting(job_id) for job_id in self._standby)

    async def wait_command_stream(self, job_id: str, rank: int, timeout: float) -> bool:
        """Whether the rank has a Commands stream open, waiting up to `timeout` s."""
        return await self._wait_until(lambda: (job_id, rank) in self._streams, timeout)

    async def wait_standby(self, job_id: str, timeout: float) -> bool:
        """Whether a standby process waits for `job_id`, waiting up to `timeout` s."""
        return await self._wait_until(lambda: self._standby_waiting(job_id) > 0, timeout)

    def _gpu_of(self, job_id: str, rank: int) -> int | None:
        gpu = self.supervisor.gpu_index(job_id, rank)
        adopted = self._adopted.get((job_id, rank))
        return adopted[0] if gpu is None and adopted is not None else gpu

    def _pid_of(self, key: _Key) -> int | None:
        pid = self.supervisor.pid(*key)
        adopted = self._adopted.get(key)
        return adopted[1] if pid is None and adopted is not None else pid

    def _unacked_by_current(self, key: _Key) -> dict[int, rank_pb2.RankCommand]:
        """Commands the rank's current process has not acknowledged; those an earlier
        process of the rank left unacknowledged are dropped."""
        pid, commands = self._unacked.get(key, (0, {}))
        if commands and pid != self._pid_of(key):
            del self._unacked[key]
            return {}
        return commands

    def _open_stream(self, key: _Key) -> _Stream:
        older = self._streams.get(key)
        if older is not None:
            older.put_nowait(None)  # ends the older stream
        queue: _Stream = asyncio.Queue()
        for command in self._unacked_by_current(key).values():
            queue.put_nowait(command)
        self._streams[key] = queue
        self._notify()
        return queue

    def _close_stream(self, key: _Key, queue: _Stream) -> None:
        if self._streams.get(key) is queue:
            del self._streams[key]
            self._notify()

    def _acknowledge(self, ack: rank_pb2.RankAck) -> None:
        self._unacked_by_current((ack.job_id, ack.rank)).pop(ack.command_id, None)
        future = self._acks.get(ack.command_id)
        if future is not None and not future.done():
            future.set_result(ack)

    async def _wait_for_assignment(
        self, request: rank_pb2.StandbyRequest, context: Any
    ) -> rank_pb2.StandbyAssignment:
        job_id = request.job_id
        future: asyncio.Future[rank_pb2.StandbyAssignment] = (
            asyncio.get_running_loop().create_future()
        )
        waiter = (future, context, request.pid)
        self._standby.setdefault(job_id, []).append(waiter)
        self._notify()
        self.report_soon()
        try:
            return await future
        finally:
            waiting = self._standby.get(job_id, [])
            with contextlib.suppress(ValueError):
                waiting.remove(waiter)
            if not waiting:
                self._standby.pop(job_id, None)

    def _standby_waiting(self, job_id: str) -> int:
        return sum(1 for future, _, _ in self._standby.get(job_id, []) if not future.done())

    def _track_ack(self, command_id: int) -> asyncio.Future[rank_pb2.RankAck]:
        future: asyncio.Future[rank_pb2.RankAck] = asyncio.get_running_loop().create_future()
        self._acks[command_id] = future
        while len(self._acks) > MAX_TRACKED_ACKS:
            self._acks.popitem(last=False)
        return future

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True


class _RankControlServicer:
    """Decodes RankControl calls, checks them, and hands them to the endpoint. A call it
    refuses raises a RankCallError (pitstop.agent.rankerrors); the interceptor there
    ends the call with its status code."""

    def __init__(self, endpoint: LocalEndpoint) -> None:
        self._endpoint = endpoint

    async def _gpu(self, job_id: str, rank: int, context: Any) -> int:
        if not job_id:
            raise errors.InvalidArgument("job_id is empty")
        gpu = self._endpoint._gpu_of(job_id, rank)
        if gpu is None:
            raise errors.NotFound(
                f"rank {rank} of job {job_id!r} does not run on this node; "
                "only ranks the agent started (or handed to a standby) may call"
            )
        return gpu

    async def Attach(  # noqa: N802 (gRPC method names)
        self, request: rank_pb2.AttachRequest, context: Any
    ) -> rank_pb2.AttachResponse:
        gpu = await self._gpu(request.job_id, request.rank, context)
        endpoint = self._endpoint
        generation, restore_step = endpoint._generations.get(request.job_id, (0, 0))
        return rank_pb2.AttachResponse(
            generation=generation,
            restore_step=restore_step,
            checkpointd_address=endpoint.checkpointd_address,
            slow_multiplier=self._slow_multiplier(gpu),
        )

    def _slow_multiplier(self, gpu: int) -> float:
        try:
            return self._endpoint.backend.slow_multiplier(gpu)
        except ValueError:  # a GPU the backend does not know cannot be simulated slow
            return 1.0

    def _rank_fault(self, gpu: int) -> int:
        try:
            return self._endpoint.backend.take_rank_fault(gpu)
        except ValueError:  # nor have a fault injected
            return rank_pb2.RANK_FAULT_NONE

    async def ReportStep(  # noqa: N802
        self, request: rank_pb2.StepReport, context: Any
    ) -> rank_pb2.StepReportResponse:
        gpu = await self._gpu(request.job_id, request.rank, context)
        sample = request.sample
        sample.rank = request.rank
        if not sample.HasField("time"):
            sample.time.CopyFrom(_now())
        elif (wrong := timestamps.out_of_range(sample.time)) is not None:
            raise errors.InvalidArgument(
                f"sample.time={wrong}: {timestamps.FIX}; or none (the agent stamps it)"
            )
        if self._endpoint.steps.add(request.job_id, request.generation, sample):
            self._endpoint.report_soon()  # the first step of a generation: it resumed
        supervisor = self._endpoint.supervisor
        supervisor.record_step(request.job_id, request.rank, sample.step)
        supervisor.record_generation(request.job_id, request.rank, request.generation)
        pending = self._endpoint._unacked_by_current((request.job_id, request.rank))
        return rank_pb2.StepReportResponse(
            command_pending=bool(pending),
            slow_multiplier=self._slow_multiplier(gpu),
            rank_fault=self._rank_fault(gpu),  # type: ignore[arg-type]
        )

    async def Commands(  # noqa: N802
        self, request: rank_pb2.CommandStreamRequest, context: Any
    ) -> AsyncIterator[rank_pb2.RankCommand]:
        await self._gpu(request.job_id, request.rank, context)
        key = (request.job_id, request.rank)
        queue = self._endpoint._open_stream(key)
        try:
            while (command := await queue.get()) is not None:
                yield command
        finally:
            self._endpoint._close_stream(key, queue)

    async def Acknowledge(  # noqa: N802
        self, request: rank_pb2.RankAck, context: Any
    ) -> rank_pb2.RankAckResponse:
        await self._gpu(request.job_id, request.rank, context)
        self._endpoint._acknowledge(request)
        return rank_pb2.RankAckResponse()

    async def Standby(  # noqa: N802
        self, request: rank_pb2.StandbyRequest, context: Any
    ) -> rank_pb2.StandbyAssignment:
        if not request.job_id:
            raise errors.InvalidArgument("job_id is empty")
        try:
            return await self._endpoint._wait_for_assignment(request, context)
        except _Stopping:
            raise errors.Unavailable("the agent is stopping; retry") from None

    async def ReportResult(  # noqa: N802
        self, request: rank_pb2.RankResult, context: Any
    ) -> rank_pb2.RankResultResponse:
        await self._gpu(request.job_id, request.rank, context)
        self._endpoint.supervisor.record_result(request.job_id, request.rank, request.result)
        return rank_pb2.RankResultResponse()

    async def ReportFinding(  # noqa: N802
        self, request: agent_pb2.IntegrityFinding, context: Any
    ) -> rank_pb2.FindingResponse:
        request.gpu_index = await self._gpu(request.job_id, request.rank, context)
        self._endpoint.on_finding(request)
        return rank_pb2.FindingResponse()

    async def ReportRunRecord(  # noqa: N802
        self, request: agent_pb2.RunRecord, context: Any
    ) -> rank_pb2.RunRecordResponse:
        await self._gpu(request.job_id, request.rank, context)
        problem = _unstorable_text(request)
        if problem:
            raise errors.InvalidArgument(problem)
        self._endpoint.on_run_record(request)
        return rank_pb2.RunRecordResponse()

    async def InjectFault(  # noqa: N802
        self, request: rank_pb2.LocalFaultRequest, context: Any
    ) -> rank_pb2.LocalFaultResponse:
        if not self._endpoint.allow_fault_injection:
            raise errors.PermissionDenied(
                "fault injection is disabled on this agent; enable it for drills and tests only"
            )
        try:
            self._endpoint.inject(request.fault)
        except FaultNotSupported as exc:
            raise errors.FailedPrecondition(f"cannot inject this fault here: {exc}") from exc
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from exc
        return rank_pb2.LocalFaultResponse()


MAX_RECORD_TEXT = 4096
"""The longest text of a run record the scheduler keeps (a path, a digest, a version)."""


def _unstorable_text(message: Any, path: str = "") -> str:
    """What in `message`'s text the scheduler would refuse (a NUL, more than
    MAX_RECORD_TEXT characters), said with the field's path; "" when nothing. Caught
    here, the rank hears of it; sent on, it would cost the node's scheduler stream."""
    for field, value in message.ListFields():
        name = f"{path}{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            texts = [str(k) for k in value] + [v for v in value.values() if isinstance(v, str)]
        elif field.message_type is not None:
            found = _unstorable_text(value, f"{name}.")
            if found:
                return found
            continue
        else:
            texts = [value] if isinstance(value, str) else []
        for text in texts:
            if "\x00" in text or len(text) > MAX_RECORD_TEXT:
                return (
                    f"{name}: {text[:40]!r}... cannot be kept: send at most "
                    f"{MAX_RECORD_TEXT} characters and no NUL"
                )
    return ""


class _StartedHere(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses, PERMISSION_DENIED, every call that does not carry the rank key of a
    process the agent started: the socket's mode keeps other users out, this keeps out
    the user's other processes."""

    def __init__(self, started: Callable[[str], bool]) -> None:
        self._started = started

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        key = dict(details.invocation_metadata or ()).get(RANK_KEY_METADATA, "")
        if handler is None or self._started(str(key)):
            return handler
        return refusing(
            handler,
            grpc.StatusCode.PERMISSION_DENIED,
            f"the agent's socket takes calls only from the processes it started (their "
            f"{RANK_KEY_ENV} sent as {RANK_KEY_METADATA}); start ranks through the agent",
        )


class _Stopping(Exception):
    """The endpoint stops: a waiting standby call ends."""


def _now() -> Timestamp:
    now = Timestamp()
    now.FromNanoseconds(time.time_ns())
    return now


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket; remove it or choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
    raise RuntimeError(
        f"another process serves {path} (a running agent?); stop it or choose another path"
    )
