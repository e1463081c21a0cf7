"""The agent's side of AgentService.Connect: one stream to the scheduler, kept open forever.

On every stream the agent registers (seq 1), then heartbeats with the node's health,
forwards Xids, step times and rank exits as they happen, and carries out the scheduler's
commands, acknowledging each. A broken stream is reopened with backoff and the node
registers again; running ranks are never touched because the scheduler went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import itertools
import logging
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, Protocol

import grpc
import psutil
from google.protobuf.timestamp_pb2 import Timestamp
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from pitstop.agent.conditions import ConditionSource, with_conditions
from pitstop.agent.config import AgentSettings
from pitstop.agent.gpu import GpuBackend
from pitstop.agent.metrics import AgentMetrics
from pitstop.health.verdict import assess_gpu, assess_node
from pitstop.health.xid import XidClass, classify_xid, verdict_for
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2, rank_pb2

log = logging.getLogger(__name__)

STEP_FLUSH_SAMPLES = 1024
"""Buffered step samples that trigger a batch before the next heartbeat."""
STEP_POLL_SECONDS = 0.1
CLOSE_GRACE_SECONDS = 2.0
"""How long a stopping agent waits for the scheduler to end the stream."""
STANDBY_WAIT_SECONDS = 60.0
"""How long a rank handed to a standby process still importing waits for it before it
starts afresh instead (a cold start takes as long as the import it would wait for)."""
_LOUD_CODES = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


class RankSupervision(Protocol):
    """What the link needs of the rank supervisor."""

    async def start_ranks(
        self, command: agent_pb2.StartRanks, only: Collection[int] | None = None
    ) -> list[int]: ...
    async def stop_ranks(self, command: agent_pb2.StopRanks) -> list[int]: ...
    def running(self) -> list[agent_pb2.RunningRank]: ...
    def renumber(self, job_id: str, rank_map: common_pb2.RankMap) -> dict[int, int]: ...
    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]: ...
    async def start_standbys(self, command: agent_pb2.StartRanks) -> list[int]: ...
    def standby_pid(self, job_id: str, gpu_index: int) -> int | None: ...
    def standby_command(self, job_id: str) -> agent_pb2.StartRanks | None: ...
    def adopt(self, job_id: str, gpu_index: int, rank: int, generation: int) -> int | None: ...


class RankChannel(Protocol):
    """What the link needs of the local endpoint: commands to ranks, generations."""

    async def send_command(self, job_id: str, rank: int, command: rank_pb2.RankCommand) -> bool: ...
    def set_generation(self, job_id: str, generation: int, restore_step: int) -> None: ...
    async def assign_standby(
        self, job_id: str, assignment: rank_pb2.StandbyAssignment, pid: int | None = None
    ) -> bool: ...
    async def wait_standby_process(
        self, job_id: str, pid: int, timeout: float, alive: Callable[[], bool]
    ) -> bool: ...


class StepSource(Protocol):
    """What the link needs of the step batcher."""

    def drain(self) -> list[agent_pb2.StepTimes]: ...
    @property
    def pending(self) -> int: ...
    @property
    def dropped(self) -> int: ...


class LinkDown(Exception):
    """The stream could not be opened or broke. `loud`: the scheduler refused us (a bug
    or a misconfiguration, not an outage); `stable`: it had been up long enough that the
    backoff starts over."""

    def __init__(self, reason: str, *, loud: bool = False, stable: bool = False) -> None:
        super().__init__(reason)
        self.loud = loud
        self.stable = stable


def _generation_command(message: agent_pb2.SchedulerMessage, kind: str) -> tuple[int, str] | None:
    """(generation, what) of a command that moves a job's ranks to a generation; None
    for any other command (standbys, stops, pauses, node-wide commands)."""
    if kind == "start_ranks" and not message.start_ranks.standby_gpus:
        return message.start_ranks.generation, "start"
    if kind == "reconfigure":
        adopting = bool(message.reconfigure.adopted_ranks)
        return message.reconfigure.generation, "adopt" if adopting else "reconfigure"
    return None


def agent_version() -> str:
    """The installed pitstop version."""
    try:
        return importlib.metadata.version("pitstop")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


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
    ) -> None:
        self._settings = settings
        self._conditions = tuple(conditions)
        self._backend = backend
        self._supervisor = supervisor
        self._steps = steps
        self._metrics = metrics
        self._clock = clock
        self._started_at = psutil.Process().create_time()
        self._token = settings.token
        # None ends the stream: the request iterator returns, which half-closes it.
        self._outbox: asyncio.Queue[agent_pb2.AgentMessage | None] = asyncio.Queue()
        self._local = local
        self._command_tasks: set[asyncio.Task[None]] = set()
        self._job_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # Per job, the (generation, command) pairs carried out, and the newest generation:
        # the scheduler re-sends a command until its ack arrives, and a repeat (or a
        # command of an older generation) must change nothing.
        self._carried_out: defaultdict[str, set[tuple[int, str]]] = defaultdict(set)
        self._newest: defaultdict[str, int] = defaultdict(int)
        self._rank_command_ids = itertools.count(1)
        self._xid_inbox: asyncio.Queue[common_pb2.XidEvent] = asyncio.Queue()
        self._recent_xids: defaultdict[int, list[int]] = defaultdict(list)
        self._previous: dict[int, common_pb2.GpuHealth] = {}
        self._beat_now = asyncio.Event()
        self._dropped_seen = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._registered_at: float | None = None
        self._registered_event = asyncio.Event()
        self.registrations = 0
        """Successful registrations so far (the first, then one per reconnect)."""
        self.registered: agent_pb2.Registered | None = None
        """The scheduler's answer on the current or last stream."""

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
        self._flush_steps()
        self._send(rank_exited=exited)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a registered stream to the scheduler until `stop` is set."""
        self._loop = asyncio.get_running_loop()
        self._backend.start_xid_watch(self._xid_from_driver)
        self._spawn(self._pump_xids())
        try:
            while not stop.is_set():
                try:
                    await self._connect_with_backoff(stop)
                except LinkDown as exc:  # a stream that had been up: start the backoff over
                    log.info("scheduler %s: %s; reconnecting", self._settings.scheduler, exc)
        finally:
            tasks = [*self._background, *self._command_tasks]
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
            register = await self._register_message()
        except Exception as exc:
            log.exception("building the registration failed")
            raise LinkDown(f"cannot build the registration: {exc}") from exc
        metadata = (("authorization", f"Bearer {self._token}"),) if self._token else None
        channel = grpc.aio.insecure_channel(self._settings.scheduler)
        call = agent_pb2_grpc.AgentServiceStub(channel).Connect(
            self._requests(register), metadata=metadata
        )
        conversation = asyncio.create_task(self._converse(call))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({conversation, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if conversation.done():
                conversation.result()  # raises LinkDown
            # Stopping: send what is queued, half-close, and give the scheduler a moment
            # to end the stream itself, so it sees a clean goodbye rather than a reset.
            self._outbox.put_nowait(None)
            await asyncio.wait({conversation}, timeout=CLOSE_GRACE_SECONDS)
        finally:
            stopped.cancel()
            conversation.cancel()
            call.cancel()
            await asyncio.gather(conversation, stopped, return_exceptions=True)
            await self._end_session()
            await channel.close()

    async def _converse(self, call: Any) -> None:
        try:
            first = await call.read()
            if first is grpc.aio.EOF:
                raise self._down("the scheduler closed the stream before answering Register")
            if first.WhichOneof("body") != "registered":
                raise self._down(f"expected Registered, got {first.WhichOneof('body')}", loud=True)
            self._on_registered(first.registered)
            while (message := await call.read()) is not grpc.aio.EOF:
                self._dispatch(message)
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

    async def _requests(self, register: agent_pb2.AgentMessage) -> AsyncIterator[Any]:
        # The only writer of the stream, so sequence numbers are gapless per stream.
        seq = 1
        register.seq = seq
        yield register
        while True:
            message = await self._outbox.get()
            if message is None:
                return
            seq += 1
            message.seq = seq
            if message.HasField("heartbeat"):
                self._metrics.heartbeats.labels(self._settings.node_id).inc()
            yield message

    async def _register_message(self) -> agent_pb2.AgentMessage:
        settings, backend = self._settings, self._backend
        gpus = await asyncio.to_thread(backend.inventory)
        return agent_pb2.AgentMessage(
            register=agent_pb2.Register(
                node_id=settings.node_id,
                inventory=common_pb2.Inventory(
                    hostname=settings.advertise_host or socket.gethostname(),
                    driver_version=backend.driver_version(),
                    gpus=gpus,
                    agent_version=agent_version(),
                    gpu_backend=backend.name,
                    checkpointd_address=settings.checkpointd_address,
                ),
                labels=common_pb2.TopologyLabels(
                    zone=settings.zone,
                    block=settings.block,
                    rack=settings.rack,
                    nvlink_domain=settings.nvlink_domain,
                ),
                requested_role=(
                    common_pb2.NODE_ROLE_SPARE
                    if settings.role == "spare"
                    else common_pb2.NODE_ROLE_WORKER
                ),
                running_ranks=self._supervisor.running(),
                agent_started_at=_timestamp(self._started_at),
            )
        )

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
            "registered with scheduler %s as node %s (%s, %s); heartbeat every %.1fs",
            self._settings.scheduler,
            registered.node_id,
            common_pb2.NodeRole.Name(registered.role),
            common_pb2.NodeState.Name(registered.state),
            interval,
        )
        self._heartbeat_task = asyncio.create_task(self._heartbeats(interval))
        if first:
            self._spawn(self._send_kernel_log_xids())
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
        self._outbox.put_nowait(agent_pb2.AgentMessage(**body))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # Heartbeats and step times

    async def _heartbeats(self, interval: float) -> None:
        assert self._loop is not None
        while True:
            self._beat_now.clear()
            try:
                await self._beat()
                self._flush_steps()
            except Exception:  # a bad beat must not end the heartbeats: liveness hangs on them
                log.exception("building a heartbeat failed")
            deadline = self._loop.time() + interval
            while (remaining := deadline - self._loop.time()) > 0:
                try:
                    await asyncio.wait_for(self._beat_now.wait(), min(remaining, STEP_POLL_SECONDS))
                    break
                except TimeoutError:
                    if self._steps.pending >= STEP_FLUSH_SAMPLES:
                        self._flush_steps()

    async def _beat(self) -> None:
        try:
            readings = await asyncio.to_thread(self._backend.read_health)
        except Exception as exc:
            log.exception("reading GPU health failed")
            health = common_pb2.NodeHealth(
                verdict=common_pb2.HEALTH_VERDICT_WARNING,
                reasons=[f"reading GPU health failed: {type(exc).__name__}: {exc}"],
            )
        else:
            self._drain_xid_inbox()
            recent, self._recent_xids = self._recent_xids, defaultdict(list)
            assessed = [
                assess_gpu(r, previous=self._previous.get(r.index), xids=recent.get(r.index, ()))
                for r in readings
            ]
            self._previous = {r.index: r for r in readings}
            health = assess_node(assessed)
            self._metrics.observe_health(health.gpus)
        # Beyond the GPUs: a node daemon that is down (the checkpoint daemon).
        health = with_conditions(health, [c for s in self._conditions for c in s.conditions()])
        running = self._supervisor.running()
        self._metrics.ranks_running.labels(self._settings.node_id).set(len(running))
        beat = agent_pb2.Heartbeat(
            time=_timestamp(self._clock()), health=health, running_ranks=running
        )
        self._send(heartbeat=beat)

    def beat_soon(self) -> None:
        """Send a heartbeat now rather than at the next interval (the node's health
        changed); a no-op while no stream is registered."""
        self._beat_now.set()

    def _flush_steps(self) -> None:
        dropped = self._steps.dropped
        if dropped > self._dropped_seen:
            self._metrics.samples_dropped.labels(self._settings.node_id).inc(
                dropped - self._dropped_seen
            )
            self._dropped_seen = dropped
        for batch in self._steps.drain():
            self._send(step_times=batch)
            self._metrics.steps_reported.labels(self._settings.node_id, batch.job_id).inc(
                len(batch.samples)
            )

    # Xids

    def _xid_from_driver(self, event: common_pb2.XidEvent) -> None:
        # Called on the backend's watch thread (or inline by the simulator).
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the agent is stopping
                loop.call_soon_threadsafe(self._xid_inbox.put_nowait, event)

    async def _pump_xids(self) -> None:
        while True:
            self._accept_xid(await self._xid_inbox.get())

    def _drain_xid_inbox(self) -> None:
        while not self._xid_inbox.empty():
            self._accept_xid(self._xid_inbox.get_nowait())

    def _accept_xid(self, event: common_pb2.XidEvent, *, live: bool = True) -> None:
        xid = common_pb2.XidEvent()
        xid.CopyFrom(event)
        info = classify_xid(xid.xid)
        xid.verdict = verdict_for(info.xid_class)
        if live:
            # Kernel-log Xids are history: sent for the record, not judged again.
            self._recent_xids[xid.gpu_index].append(xid.xid)
            self._metrics.observe_xid(xid)
            log.warning(
                "GPU %d (%s): Xid %d (%s): %s",
                xid.gpu_index,
                xid.gpu_uuid,
                xid.xid,
                info.name,
                common_pb2.HealthVerdict.Name(xid.verdict),
            )
            if info.xid_class in (XidClass.APPLICATION, XidClass.FATAL):
                # The contexts on the GPU are broken (application), or the GPU itself
                # (fatal): the ranks there would crash or hang in their next kernel, or
                # worse, step on with a GPU that computes wrong numbers. End them now:
                # their peers stop at the next collective and wait for the scheduler's
                # decision (restart in place; a replacement for a fatal Xid) instead of
                # waiting on a collective timeout or training on without the decision.
                self._supervisor.kill_gpu(xid.gpu_index, f"Xid {xid.xid} ({info.name})")
        self._send(xid=xid)

    async def _send_kernel_log_xids(self) -> None:
        try:
            events = await asyncio.to_thread(self._backend.kernel_log_xids)
        except Exception:
            log.exception("reading Xids from the kernel log failed")
            return
        for event in events:
            self._accept_xid(event, live=False)

    # Commands

    def _dispatch(self, message: agent_pb2.SchedulerMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "registered":
            log.warning("a second Registered on one stream ignored")
            return
        task = asyncio.create_task(self._carry_out(message, kind or "empty"))
        self._command_tasks.add(task)
        task.add_done_callback(self._command_tasks.discard)

    async def _carry_out(self, message: agent_pb2.SchedulerMessage, kind: str) -> None:
        # Commands of one job run in arrival order (a stop before the next start); other
        # jobs and node-wide commands do not wait behind a slow stop.
        job_id = getattr(getattr(message, kind), "job_id", "") if kind != "empty" else ""
        lock = self._job_locks[job_id] if job_id else contextlib.nullcontext()
        async with lock:
            try:
                key = _generation_command(message, kind)
                if key is not None and self._already(job_id, key, message.command_id):
                    error = ""
                else:
                    error = await self._command(message, kind)
                    if key is not None and not error:
                        self._carried_out[job_id].add(key)
                        self._newest[job_id] = max(self._newest[job_id], key[0])
            except Exception as exc:
                log.exception("command %d (%s) failed", message.command_id, kind)
                error = (
                    f"{kind} failed on node {self._settings.node_id}: {type(exc).__name__}: {exc}"
                )
        if error:
            log.warning("command %d (%s) not carried out: %s", message.command_id, kind, error)
        ack = agent_pb2.CommandAck(command_id=message.command_id, ok=not error, error=error)
        self._send(ack=ack)
        result = "error" if error else "ok"
        self._metrics.commands.labels(self._settings.node_id, kind, result).inc()

    def _already(self, job_id: str, key: tuple[int, str], command_id: int) -> bool:
        """True for a command to skip: carried out before, or of an older generation."""
        generation, what = key
        if key in self._carried_out[job_id]:
            log.debug("command %d: %s of generation %d repeated", command_id, what, generation)
            return True
        if generation < self._newest[job_id]:
            log.info(
                "command %d: %s of job %s generation %d ignored: generation %d runs here",
                command_id,
                what,
                job_id,
                generation,
                self._newest[job_id],
            )
            return True
        return False

    async def _command(self, message: agent_pb2.SchedulerMessage, kind: str) -> str:
        """Carry out one command; the error in words, or "" when done."""
        node_id = self._settings.node_id
        if kind == "start_ranks" and message.start_ranks.standby_gpus:
            start = message.start_ranks
            gpus = await self._supervisor.start_standbys(start)
            log.info("job %s: standby processes on GPUs %s", start.job_id, gpus)
            self._beat_now.set()  # the heartbeat lists them: the scheduler sees them at once
        elif kind == "start_ranks":
            start = message.start_ranks
            # Before the start, so a rank that attaches at once sees its generation.
            self._local.set_generation(start.job_id, start.generation, start.restore_step)
            started = await self._supervisor.start_ranks(start)
            log.info(
                "job %s generation %d: started ranks %s", start.job_id, start.generation, started
            )
        elif kind == "stop_ranks":
            stopped = await self._supervisor.stop_ranks(message.stop_ranks)
            log.info(
                "job %s: stopped ranks %s (%s)",
                message.stop_ranks.job_id,
                stopped,
                message.stop_ranks.reason or "no reason given",
            )
        elif kind == "reconfigure":
            new = message.reconfigure
            self._local.set_generation(new.job_id, new.generation, new.restore_step)
            adopted = await self._hand_to_standbys(new)
            # The ranks taken over here join the new generation on their own.
            relayed = await self._relay(
                new.job_id, rank_pb2.RankCommand(reconfigure=new), skip=set(new.adopted_ranks)
            )
            moved = self._supervisor.renumber(new.job_id, new.rank_map)
            if moved:
                log.info("job %s: ranks renumbered %s", new.job_id, moved)
            return "; ".join(error for error in (adopted, relayed) if error)
        elif kind == "pause":
            pause = rank_pb2.RankCommand(pause=message.pause)
            return await self._relay(message.pause.job_id, pause)
        elif kind == "resume":
            resume = rank_pb2.RankCommand(resume=message.resume)
            return await self._relay(message.resume.job_id, resume)
        elif kind == "drain":
            log.warning(
                "node %s is draining: %s", node_id, message.drain.reason or "no reason given"
            )
            self._metrics.drains.labels(node_id).inc()
        elif kind == "inject_fault":
            if not self._settings.allow_fault_injection:
                return (
                    f"fault injection is disabled on node {node_id}; "
                    "set allow_fault_injection: true in its agent config to allow drills"
                )
            await asyncio.to_thread(self._backend.inject_fault, message.inject_fault)
            log.warning("injected fault: %s", message.inject_fault)
            self._beat_now.set()  # an extra heartbeat now, so the fault is seen at once
        else:
            return f"command {kind!r} is unknown to the agent on node {node_id}; upgrade the agent"
        return ""

    async def _relay(
        self, job_id: str, command: rank_pb2.RankCommand, skip: set[int] | None = None
    ) -> str:
        """Queue `command` for every rank of the job running here (but those in `skip`).
        Done when queued: the ranks act on it at their next step boundary."""
        ranks = [
            r.rank
            for r in self._supervisor.running()
            if r.job_id == job_id and not r.standby and r.rank not in (skip or set())
        ]
        missed = []
        for rank in ranks:
            # Each rank acks its copy by id, so every copy gets an id of its own.
            copy = rank_pb2.RankCommand(command_id=next(self._rank_command_ids))
            copy.MergeFrom(command)
            if not await self._local.send_command(job_id, rank, copy):
                missed.append(rank)
        if missed:
            return (
                f"job {job_id}: ranks {missed} on node {self._settings.node_id} "
                "have no open command stream; they may have exited"
            )
        return ""

    async def _hand_to_standbys(self, new: agent_pb2.Reconfigure) -> str:
        """Give each rank this node adopts to the job's standby process on the rank's GPU.
        One still importing is waited for; where none is left (it died, or was never
        started here), the rank starts as a fresh process from the standby's command."""
        job_id, node_id = new.job_id, self._settings.node_id
        placed = {a.rank: a for a in new.rank_map.ranks if a.node_id == node_id}
        missed, fresh = [], []
        for rank in new.adopted_ranks:
            where = placed.get(rank)
            if where is None:
                missed.append(rank)
                continue
            if not await self._adopt(new, where):
                fresh.append(rank)
        if fresh:
            spec = self._supervisor.standby_command(job_id)
            if spec is None:
                missed += fresh
            else:
                log.warning(
                    "job %s: no standby process waits for ranks %s here: starting them afresh",
                    job_id,
                    fresh,
                )
                start = agent_pb2.StartRanks(
                    job_id=job_id,
                    generation=new.generation,
                    command=spec.command,
                    env=spec.env,
                    working_dir=spec.working_dir,
                    rank_map=new.rank_map,
                    rendezvous_address=new.rendezvous_address,
                    restore_step=new.restore_step,
                )
                await self._supervisor.start_ranks(start, only=fresh)
        if missed:
            return (
                f"job {job_id}: node {node_id} cannot take ranks {missed}: not placed here in "
                "the rank map, or no standby process of the job was ever started here"
            )
        return ""

    async def _adopt(self, new: agent_pb2.Reconfigure, where: common_pb2.RankAssignment) -> bool:
        """Hand rank `where` to the job's standby process on its GPU, once that process
        waits (at most STANDBY_WAIT_SECONDS); False when there is none to hand it to."""
        job_id, gpu = new.job_id, where.gpu_index
        pid = self._supervisor.standby_pid(job_id, gpu)
        if pid is None:
            return False

        def alive() -> bool:
            return self._supervisor.standby_pid(job_id, gpu) == pid

        # True: the process waits now, and no await comes before the hand-over, so it
        # cannot stop waiting in between.
        if not await self._local.wait_standby_process(job_id, pid, STANDBY_WAIT_SECONDS, alive):
            return False
        if self._supervisor.adopt(job_id, gpu, where.rank, new.generation) != pid:
            return False
        assignment = rank_pb2.StandbyAssignment(
            reconfigure=new, rank=where.rank, local_rank=where.local_rank, gpu_index=gpu
        )
        return await self._local.assign_standby(job_id, assignment, pid=pid)
