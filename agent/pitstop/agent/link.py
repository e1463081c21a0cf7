"""The agent's side of AgentService.Connect: one stream to the scheduler, kept open forever.

On every stream the agent registers (seq 1); then the heartbeats (`heartbeats.py`) send
the node's health, Xids, step times and rank exits as they happen, and the command
executor (`executor.py`) carries out the scheduler's commands, acknowledging each. This
module owns the stream itself: the registration (built by `registration.py`), the one
outbox every message leaves through (`outbox.py`), and the reconnect. A broken stream
is reopened with backoff and the node registers again; running ranks are never touched
because the scheduler went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import grpc
import psutil
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from pitstop.agent.conditions import ConditionSource
from pitstop.agent.config import AgentSettings
from pitstop.agent.executor import CommandExecutor
from pitstop.agent.gpu import GpuBackend
from pitstop.agent.heartbeats import Heartbeats, StepSource
from pitstop.agent.host.watch import HostWatch
from pitstop.agent.metrics import AgentMetrics
from pitstop.agent.outbox import Outbox, RecentExits, first_of
from pitstop.agent.rankports import RankChannel, RankSupervision
from pitstop.agent.registration import register_message
from pitstop.common.tls import NodeIdentity, open_channel
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

CLOSE_GRACE_SECONDS = 2.0
"""How long a stopping agent waits for the scheduler to end the stream."""
_LOUD_CODES = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


class LinkDown(Exception):
    """The stream could not be opened or broke. `loud`: the scheduler refused us (a bug
    or a misconfiguration, not an outage); `stable`: it had been up long enough that the
    backoff starts over."""

    def __init__(self, reason: str, *, loud: bool = False, stable: bool = False) -> None:
        super().__init__(reason)
        self.loud = loud
        self.stable = stable


def keepalive_options(settings: AgentSettings) -> list[tuple[str, int]]:
    """gRPC channel options: ping the scheduler, and break a stream whose ping goes
    unanswered (the scheduler accepts pings this often: AGENT_PING_FLOOR_MS)."""
    return [
        ("grpc.keepalive_time_ms", round(settings.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", round(settings.keepalive_timeout_seconds * 1000)),
        # The timeout gRPC enforces (keepalive_timeout_ms alone never fires: grpc#39239).
        ("grpc.http2.ping_timeout_ms", round(settings.keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class SchedulerLink:
    """The node's conversation with the scheduler. `run` it once; it returns when `stop`
    is set, and the caller then shuts the supervisor down."""

    def __init__(
        self,
        settings: AgentSettings,
        backend: GpuBackend,
        supervisor: RankSupervision,
        local: RankChannel,
        steps: StepSource,
        metrics: AgentMetrics,
        *,
        clock: Callable[[], float] = time.time,
        conditions: Collection[ConditionSource] = (),
        identity: NodeIdentity | None = None,
        host: HostWatch | None = None,
        inject: Callable[[common_pb2.Fault], None] | None = None,
    ) -> None:
        self._settings = settings
        self._identity = identity
        self._backend = backend
        self._supervisor = supervisor
        self._metrics = metrics
        self._started_at = psutil.Process().create_time()
        self._token = settings.token
        self._outbox = Outbox()
        self.exits = RecentExits()
        self._heartbeats = Heartbeats(
            settings,
            backend,
            supervisor,
            steps,
            metrics,
            send=self._send,
            clock=clock,
            conditions=conditions,
            host=host,
        )
        self._commands = CommandExecutor(
            settings,
            backend,
            supervisor,
            local,
            metrics,
            send=self._send,
            beat_soon=self._heartbeats.beat_soon,
            heartbeat=self._heartbeats.carried,
            inject=inject,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._registered_at: float | None = None
        self._registered_event = asyncio.Event()
        self.registrations = 0
        """Successful registrations so far (the first, then one per reconnect)."""
        self.registered: agent_pb2.Registered | None = None
        """The scheduler's answer on the current or last stream."""

    def latest_health(self) -> common_pb2.NodeHealth | None:
        """The node's health as the last heartbeat judged it, while a stream is
        registered (its heartbeats keep judging); None otherwise."""
        return self._heartbeats.latest if self.connected else None

    @property
    def connected(self) -> bool:
        """Whether a stream is open and registered now."""
        return self._registered_at is not None

    async def wait_registered(self, count: int = 1, timeout: float = 10.0) -> agent_pb2.Registered:
        """Wait until the node has registered `count` times in all; the latest answer."""
        async with asyncio.timeout(timeout):
            while self.registrations < count or self.registered is None:
                await self._registered_event.wait()
        return self.registered

    async def report_rank_exit(self, exited: agent_pb2.RankExited) -> None:
        """Send a rank's exit at once (the supervisor's on_exit), after the step times
        still waiting: the scheduler must see a rank's last steps before its exit."""
        self._metrics.rank_exits.labels(self._settings.node_id, exited.job_id).inc()
        self._heartbeats.flush_steps()
        self.exits.add(exited)
        self._send(rank_exited=exited)

    def report_finding(self, finding: agent_pb2.IntegrityFinding) -> None:
        """Send a rank's integrity finding at once, after the step times still waiting."""
        kind = agent_pb2.FindingKind.Name(finding.kind).removeprefix("FINDING_KIND_").lower()
        self._metrics.findings.labels(self._settings.node_id, kind).inc()
        self._heartbeats.flush_steps()
        self._send(finding=finding)

    def report_run_record(self, record: agent_pb2.RunRecord) -> None:
        """Send what a rank's generation runs (its code, environment, data) for the
        job's record."""
        self._send(run_record=record)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a registered stream to the scheduler until `stop` is set."""
        self._loop = asyncio.get_running_loop()
        self._heartbeats.watch_xids()
        self._spawn(self._heartbeats.pump_xids())
        try:
            while not stop.is_set():
                try:
                    await self._connect_with_backoff(stop)
                except LinkDown as exc:  # a stream that had been up: start the backoff over
                    log.info("scheduler %s: %s; reconnecting", self._settings.scheduler, exc)
        finally:
            tasks = [*self._background, *self._commands.in_flight]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._metrics.set_connected(False)

    async def _connect_with_backoff(self, stop: asyncio.Event) -> None:
        async def sleep_unless_stopped(seconds: float) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), seconds)

        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, LinkDown) and not exc.stable),
            # Full jitter: a restarted scheduler is not hit by every agent at the same moment.
            wait=wait_random_exponential(multiplier=0.1, max=self._settings.reconnect_max_seconds),
            sleep=sleep_unless_stopped,
            before_sleep=self._log_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if not stop.is_set():
                    await self._session(stop)

    def _log_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        loud = isinstance(exc, LinkDown) and exc.loud
        log.log(
            logging.ERROR if loud else logging.INFO,
            "scheduler %s: %s%s; retrying in %.1fs (attempt %d)",
            self._settings.scheduler,
            exc,
            " -- the scheduler refused this agent; check its configuration" if loud else "",
            wait,
            state.attempt_number,
        )

    async def _session(self, stop: asyncio.Event) -> None:
        """One stream: returns when `stop` is set, raises LinkDown when the stream ends."""
        try:
            register = await register_message(
                self._settings,
                self._backend,
                self._supervisor.running,
                self._started_at,
                self.exits.recent,
            )
        except Exception as exc:
            log.exception("building the registration failed")
            raise LinkDown(f"cannot build the registration: {exc}") from exc
        metadata = (("authorization", f"Bearer {self._token}"),) if self._token else None
        channel = open_channel(
            self._settings.scheduler,
            self._identity,
            to_scheduler=True,
            aio=True,
            options=keepalive_options(self._settings),
        )
        answered = asyncio.Event()  # the scheduler's first answer (or the session's end)
        ended = asyncio.Event()  # this stream is over: its writer stops reading the outbox
        call = agent_pb2_grpc.AgentServiceStub(channel).Connect(
            self._requests(register, answered, ended), metadata=metadata
        )
        conversation = asyncio.create_task(self._converse(call, answered))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({conversation, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if conversation.done():
                conversation.result()  # raises LinkDown
            # Stopping: send what is queued, half-close, and give the scheduler a moment
            # to end the stream itself, so it sees a clean goodbye rather than a reset.
            self._outbox.close()
            answered.set()
            await asyncio.wait({conversation}, timeout=CLOSE_GRACE_SECONDS)
        finally:
            # A call that already ended (refused, broken) does not cancel its writer: the
            # writer ends itself, or it would wait on the outbox and take the next
            # stream's first message.
            ended.set()
            stopped.cancel()
            conversation.cancel()
            call.cancel()
            await asyncio.gather(conversation, stopped, return_exceptions=True)
            await self._end_session()
            await channel.close()

    async def _converse(self, call: Any, answered: asyncio.Event) -> None:
        try:
            first = await call.read()
            answered.set()
            if first is grpc.aio.EOF:
                raise self._down("the scheduler closed the stream before answering Register")
            if first.WhichOneof("body") != "registered":
                raise self._down(f"expected Registered, got {first.WhichOneof('body')}", loud=True)
            self._on_registered(first.registered)
            while (message := await call.read()) is not grpc.aio.EOF:
                if message.WhichOneof("body") == "registered":
                    log.warning("a second Registered on one stream ignored")
                else:
                    self._commands.submit(message)
            raise self._down("the scheduler closed the stream")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            raise self._down(f"{code.name}: {exc.details()}", loud=code in _LOUD_CODES) from exc
        except (LinkDown, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("the scheduler stream failed")
            raise self._down(f"internal error: {type(exc).__name__}: {exc}") from exc

    def _down(self, reason: str, *, loud: bool = False) -> LinkDown:
        assert self._loop is not None
        up = self._registered_at
        stable = up is not None and self._loop.time() - up >= self._settings.reconnect_max_seconds
        return LinkDown(reason, loud=loud, stable=stable)

    async def _requests(
        self, register: agent_pb2.AgentMessage, answered: asyncio.Event, ended: asyncio.Event
    ) -> AsyncIterator[Any]:
        # The only writer of the stream, so sequence numbers are gapless per stream.
        seq = 1
        register.seq = seq
        yield register
        # Nothing more until the scheduler answers. A refusal ends the stream at once, and
        # a write in flight then makes grpc's asyncio client report "INTERNAL: Internal
        # error from Core" in place of the refusal's status and reason (grpc/grpc#36066).
        if not await first_of(answered, ended):
            return
        while True:
            message = await self._outbox.next_message(ended)
            if message is None:
                return
            seq += 1
            message.seq = seq
            if message.HasField("heartbeat"):
                self._metrics.heartbeats.labels(self._settings.node_id).inc()
            yield message

    def _on_registered(self, registered: agent_pb2.Registered) -> None:
        assert self._loop is not None
        first = self.registrations == 0
        self.registered = registered
        self.registrations += 1
        self._registered_at = self._loop.time()
        self._metrics.set_connected(True)
        if not first:
            self._metrics.reconnects.labels(self._settings.node_id).inc()
        interval = (
            registered.heartbeat_interval_seconds or self._settings.heartbeat_interval_seconds
        )
        log.info(
            "registered with scheduler %s as node %s (%s, %s); looking every %.1fs, "
            "a heartbeat on change and at least every %.1fs",
            self._settings.scheduler,
            registered.node_id,
            common_pb2.NodeRole.Name(registered.role),
            common_pb2.NodeState.Name(registered.state),
            interval,
            max(registered.refresh_interval_seconds, interval),
        )
        refresh = max(registered.refresh_interval_seconds, interval)
        self._heartbeat_task = asyncio.create_task(
            self._heartbeats.run(interval, refresh, registered.step_report_seconds)
        )
        if first:
            self._spawn(self._heartbeats.send_kernel_log_xids())
        self._registered_event.set()
        self._registered_event = asyncio.Event()

    async def _end_session(self) -> None:
        self._registered_at = None
        self._metrics.set_connected(False)
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _send(self, **body: Any) -> None:
        self._outbox.put(agent_pb2.AgentMessage(**body))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def beat_soon(self) -> None:
        """Send a heartbeat now rather than at the next interval (the node's health
        changed); a no-op while no stream is registered."""
        self._heartbeats.beat_soon()
