"""AgentService.Connect: one bidirectional stream per node.

The first message must be Register with seq 1; sequence numbers then increase by one.
Heartbeats land in Redis (liveness deadline, live health); PostgreSQL is written only
when something changes: a new verdict, an Xid, an exit, a lost stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from redis.exceptions import RedisError

from pitstop.scheduler.api.agent_input import (
    check_agent_message,
    check_recent_exits,
    check_step_summary,
)
from pitstop.scheduler.api.agent_messages import HEALTH_PATH, StreamLink, handle
from pitstop.scheduler.api.agent_stream import Beats, StreamState, tracked
from pitstop.scheduler.api.agent_writes import AckWriter, JobGenerations, StepWriter
from pitstop.scheduler.api.shedding import LoadShedder
from pitstop.scheduler.auth import current_caller
from pitstop.scheduler.cancelling import reraise_if_cancelling
from pitstop.scheduler.convert import (
    NODE_ROLE_TO_PB,
    NODE_STATE_TO_PB,
    node_roles_from_pb,
    registration_from_pb,
)
from pitstop.scheduler.domain import LossCause
from pitstop.scheduler.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    PitstopError,
)
from pitstop.scheduler.gateway import AgentGateway, CloseStream
from pitstop.scheduler.hostprobe import loss_cause
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.liveness import DEADLINE_REASON, STALL_SECONDS
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.services import enrollment, rank_exits
from pitstop.scheduler.services import health as health_service
from pitstop.scheduler.services import nodes as node_service
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2

__all__ = ["NODE_ID_RE", "AgentServicer", "Beats"]

log = logging.getLogger(__name__)

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
READER_DONE = object()
"""Put on a stream's command queue when its reader ends."""
JUDGE_TICK_SECONDS = 1.0
"""How often a process judges the streams it holds (a quarter of a shorter timeout)."""


class AgentServicer:
    def __init__(
        self,
        store: Store,
        hot: HotState,
        gateway: AgentGateway,
        beats: Beats,
        metrics: SchedulerMetrics,
        *,
        accept: bool = True,
        send: Callable[[str, agent_pb2.SchedulerMessage], Awaitable[object]] | None = None,
        loss_probe_seconds: float = 1.0,
        shed_lag_seconds: float = 0.25,
    ) -> None:
        self.accept = accept
        self.loss_probe_seconds = loss_probe_seconds
        """How long a lost stream's host is asked whether it is up (hostprobe)."""
        self.send = send if send is not None else gateway.forward
        """How a command reaches a node's agent (the command router, which finds the
        process holding its stream)."""
        self.store = store
        self.hot = hot
        self.gateway = gateway
        self.beats = beats
        self.liveness_timeout = beats.liveness_timeout
        self.metrics = metrics
        # Set while the scheduler shuts down: streams it closes itself are not failures.
        self.stopping = False
        # Acks and the stale-process check stay off each stream's reader (agent_writes).
        self.acks = AckWriter(store)
        # Lost streams being recorded (see Connect); stop() waits for them.
        self._recording: set[asyncio.Task[None]] = set()
        # The streams this process holds, by node: judged here (judge_streams).
        self._streams: dict[str, StreamState] = {}
        self.generations = JobGenerations(store)
        self.steps = StepWriter(hot)
        self.shedder = LoadShedder(shed_lag_seconds, metrics.telemetry_shed)
        metrics.lag_listeners.append(self.shedder.observe)
        self.link = StreamLink(
            store,
            hot,
            gateway,
            self.send,
            metrics,
            self.acks,
            self.generations,
            beats.liveness_timeout,
            self.steps,
            self.shedder,
        )

    async def Connect(  # noqa: N802 (gRPC method name)
        self,
        requests: AsyncIterator[agent_pb2.AgentMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[agent_pb2.SchedulerMessage]:
        if not self.accept:
            raise FailedPrecondition(
                "this scheduler process holds no agent streams (agent_streams: false): "
                "point the agent at one of the processes that do"
            )
        first = await anext(aiter(requests), None)
        if first is None:
            return
        state = await self._register(first)
        queue = self.gateway.attach(state.node_id)
        self._streams[state.node_id] = state
        reader = asyncio.create_task(self._read(state, requests), name=state.node_id)
        # The reader's end comes down the same queue as the commands: one await a command,
        # not a task and a wait (a recovery's fan-out is a command for every stream).
        reader.add_done_callback(lambda _: queue.put_nowait(READER_DONE))
        reason = "agent stream closed"
        # A message of the agent's refused ended the stream: its bytes came from its
        # host, so the host is up and not asked. (A stream whose requests merely end is
        # asked: gRPC ends them alike when the agent hung up and when keepalive closed
        # the connection to a host cut off.)
        agent_ended = False
        try:
            yield agent_pb2.SchedulerMessage(registered=await self._registered(state.node_id))
            while True:
                item = await queue.get()
                if item is READER_DONE:
                    try:
                        reader.result()  # re-raise a protocol error; else the agent hung up
                    except asyncio.CancelledError:
                        return
                    except Exception as exc:
                        reason = f"agent stream broken: {exc}"
                        agent_ended = isinstance(exc, PitstopError)
                        raise
                    return
                if isinstance(item, CloseStream):
                    reason = item.reason
                    return
                assert isinstance(item, agent_pb2.SchedulerMessage)
                state.commands[item.command_id] = tracked(item)
                yield item
        finally:
            pending = [t for t in (reader, state.stale_check) if t is not None and not t.done()]
            for task in pending:
                task.cancel()
            if self._streams.get(state.node_id) is state:
                del self._streams[state.node_id]
            # Before any await: gRPC cancels this handler when the call ends (a reset
            # stream), often while it cleans up; whatever it interrupts, the loss is
            # recorded, in a task of its own (half of bench/scale.py's broken streams
            # waited for the liveness deadline while it was awaited here).
            recording = None
            if self.gateway.detach(state.node_id, queue) and not self.stopping:
                recording = asyncio.create_task(self._lost(state, reason, agent_ended))
                self._recording.add(recording)
                recording.add_done_callback(self._recording.discard)
            if pending:
                # Bounded: a read stuck in a dying stream must not hold up server shutdown.
                await asyncio.wait(pending, timeout=2.0)
            if recording is not None:
                await asyncio.shield(recording)

    async def judge_streams(self) -> None:
        """Judge the streams this process holds, for as long as it runs: a stream silent
        past the liveness timeout (an agent hung in Python: its process still answers
        the keepalive pings) is closed and its node LOST here; the others' Redis
        deadlines are kept fresh, so the leader, however busy this process or the
        leader is, only judges nodes whose holder is gone. A tick that came late (this
        process starved or paused) first forgives every stream as long: what arrived
        meanwhile is unread, not missing."""
        tick = min(JUDGE_TICK_SECONDS, self.liveness_timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            late, last = now - last - tick, now
            if late >= STALL_SECONDS:
                log.warning(
                    "judging the agent streams ran %.1fs late (this process was starved or "
                    "paused); every stream is given as long again",
                    late,
                )
                for state in self._streams.values():
                    state.last_seen = min(now, state.last_seen + late)
            alive = []
            for node_id, state in list(self._streams.items()):
                if now - state.last_seen > self.liveness_timeout:
                    # Judged once: its handler records the loss as the stream closes.
                    del self._streams[node_id]
                    log.warning("node %s lost: %s", node_id, DEADLINE_REASON)
                    self.gateway.close(node_id, DEADLINE_REASON)
                else:
                    alive.append(node_id)
            try:
                await self.hot.keep_deadlines(alive, time.time() + self.liveness_timeout)
            except Exception:
                reraise_if_cancelling()
                log.warning("could not keep the held streams' deadlines", exc_info=True)

    async def drain(self) -> None:
        """Wait for the lost streams still being recorded (a stopping scheduler)."""
        if self._recording:
            await asyncio.wait(set(self._recording))

    async def _lost(self, state: StreamState, reason: str, agent_ended: bool = False) -> None:
        """Record a node whose stream ended as LOST, once its host said whether it is up
        (hostprobe): meanwhile it is a suspect, which the leader counts toward a mass
        loss. A stream that ended on a message of its agent's refused (`agent_ended`: its
        bytes arrived) is lost at once, unasked. A node that registered again since this
        stream did is not lost (a healed partition delivers the old connection's end
        with the new one's Register, often after it). A stream that ended while this
        process was behind (shedding) counts as silent whatever its host says: the
        keepalive ping it missed may have waited on this process, and its own lag must
        not turn into lost nodes (many at once are a mass loss, and held)."""
        node_id, ended = state.node_id, dt.datetime.now(dt.UTC)
        behind = self.shedder.shedding
        try:
            with contextlib.suppress(RedisError):
                # The leader's scan must not judge it meanwhile (if this process dies
                # while asking, the scan still does, a probe and a timeout later).
                await self.hot.keep_deadlines(
                    [node_id], time.time() + self.loss_probe_seconds + self.liveness_timeout
                )
                await self.hot.suspects.add(node_id, ended.timestamp())
            if agent_ended:
                cause = LossCause.STREAM
            else:
                cause = await loss_cause(state.probe_address, self.loss_probe_seconds)
            if behind or self.shedder.shedding:
                cause = LossCause.SILENT
            async with self.store.write() as session:
                lost = await health_service.mark_lost(
                    session,
                    node_id,
                    reason=reason,
                    last_seen_at=state.heard_at,
                    cause=cause,
                    unless_registered_since=state.registered_at,
                )
            if lost:
                await self.hot.forget_node(node_id)
            await self.hot.suspects.discard(node_id)
        except Exception:
            # The liveness deadline still catches it; never let cleanup kill the server.
            log.exception("node %s: could not record the lost stream", node_id)

    async def _register(self, message: agent_pb2.AgentMessage) -> StreamState:
        if message.WhichOneof("body") != "register":
            raise FailedPrecondition(
                "the first message on an agent stream must be Register; reconnect and send it"
            )
        if message.seq != 1:
            raise InvalidArgument("seq", message.seq, "a stream's first message has seq 1")
        check_agent_message(message)
        reg = message.register
        if not NODE_ID_RE.fullmatch(reg.node_id):
            raise InvalidArgument(
                "register.node_id",
                reg.node_id,
                "use 1-253 letters, digits, '.', '_' or '-', starting with a letter or digit",
            )
        if reg.requested_role:
            node_roles_from_pb([reg.requested_role], field="register.requested_role")
        check_recent_exits(reg.recent_exits)
        indexes = [g.index for g in reg.inventory.gpus]
        if len(set(indexes)) != len(indexes) or len({g.uuid for g in reg.inventory.gpus}) != len(
            indexes
        ):
            raise InvalidArgument(
                "register.inventory.gpus", indexes, "each GPU needs its own index and uuid"
            )
        caller = current_caller.get()
        if caller.node_id and caller.node_id != reg.node_id:
            raise PermissionDenied(
                f"register.node_id: this stream's certificate names node {caller.node_id!r}; it "
                f"cannot register as {reg.node_id!r} (each node enrolls with its own token)"
            )
        registered_at = dt.datetime.now(dt.UTC)
        async with self.store.write() as session:
            if caller.node_id:
                await enrollment.check_not_revoked(session, reg.node_id, caller.issued_at)
            node, _created = await node_service.register_node(
                session,
                registration_from_pb(reg),
                now=registered_at,
                connected_elsewhere=self.gateway.connected(reg.node_id),
            )
            missed = await rank_exits.record_exits(session, node.id, reg.recent_exits)
        if missed:
            log.warning(
                "node %s: %d rank exits it reported were not recorded; now", node.id, missed
            )
        await self.hot.record_heartbeat(node.id, self.liveness_timeout)
        return StreamState(
            node_id=node.id,
            seq=message.seq,
            probe_address=reg.inventory.checkpointd_address,
            registered_at=registered_at,
        )

    async def _registered(self, node_id: str) -> agent_pb2.Registered:
        async with self.store.read() as session:
            node = await node_service.get_node(session, node_id)
        return agent_pb2.Registered(
            node_id=node.id,
            heartbeat_interval_seconds=self.beats.interval,
            refresh_interval_seconds=self.beats.refresh,
            step_report_seconds=self.beats.steps,
            role=NODE_ROLE_TO_PB[node.role],
            state=NODE_STATE_TO_PB[node.state],
        )

    async def _read(
        self, state: StreamState, requests: AsyncIterator[agent_pb2.AgentMessage]
    ) -> None:
        async for message in requests:
            if message.seq != state.seq + 1:
                log.warning(
                    "node %s: seq %d after %d; closing the stream",
                    state.node_id,
                    message.seq,
                    state.seq,
                )
                raise InvalidArgument(
                    "seq",
                    message.seq,
                    f"expected {state.seq + 1}: sequence numbers increase by one",
                )
            state.seq = message.seq
            state.last_seen, state.heard_at = time.monotonic(), time.time()
            kind = message.WhichOneof("body")
            # A heartbeat's health, alone or with an ack, is checked by the heartbeat
            # handler, when it changed.
            if kind == "heartbeat":
                check_agent_message(message.heartbeat, path="heartbeat", skip=HEALTH_PATH)
            elif kind == "ack":
                check_agent_message(message.ack, path="ack", skip="ack.heartbeat.health")
            elif kind == "step_summary":
                check_step_summary(message.step_summary)
            else:
                check_agent_message(message)
            await handle(self.link, state, message)
