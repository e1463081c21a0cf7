"""AgentService.Connect: one bidirectional stream per node.

The first message must be Register with seq 1; sequence numbers then increase by one.
Heartbeats land in Redis (liveness deadline, live health); PostgreSQL is written only
when something changes: a new verdict, an Xid, an exit, a lost stream.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from pitstop.scheduler.admission import PREEMPT_GRACE_SECONDS
from pitstop.scheduler.api.agent_input import check_agent_message
from pitstop.scheduler.api.agent_writes import AckWriter, JobGenerations
from pitstop.scheduler.auth import current_caller
from pitstop.scheduler.cancelling import reraise_if_cancelling
from pitstop.scheduler.convert import NODE_ROLE_TO_PB, NODE_STATE_TO_PB, node_roles_from_pb
from pitstop.scheduler.db import models
from pitstop.scheduler.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from pitstop.scheduler.gateway import AgentGateway, CloseStream
from pitstop.scheduler.hotstate import STANDBY_READY, HotState
from pitstop.scheduler.liveness import DEADLINE_REASON, STALL_SECONDS
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.services import enrollment
from pitstop.scheduler.services import health as health_service
from pitstop.scheduler.services import integrity as integrity_service
from pitstop.scheduler.services import jobs as job_service
from pitstop.scheduler.services import node_commands as node_command_service
from pitstop.scheduler.services import nodes as node_service
from pitstop.scheduler.services import records as record_service
from pitstop.scheduler.services import stacks as stacks_service
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
JUDGE_TICK_SECONDS = 1.0
"""How often a process judges the streams it holds (a quarter of a shorter timeout)."""
HEALTH_PATH = "heartbeat.health"
ENDED_CHECK_SECONDS = 5.0
"""How often the jobs a node reports running processes of are looked up."""


@dataclass
class StreamState:
    """What one open stream remembers, so unchanged heartbeats cost no database write."""

    node_id: str
    seq: int
    verdict: int = common_pb2.HEALTH_VERDICT_UNSPECIFIED
    reasons: tuple[str, ...] = ()
    # Commands sent down this stream and not yet acknowledged: id -> what an ack means.
    commands: dict[int, SentCommand | None] = field(default_factory=dict)
    ended_check_at: float = 0.0
    # The last heartbeat's health as sent (its bytes), and as kept in Redis (JSON text,
    # with the jobs whose standby waits): a health that did not change is not checked
    # or converted again (ingest reads thousands of heartbeats in a recovery's burst).
    health_sent: tuple[bytes, tuple[str, ...]] | None = None
    health_json: str = "{}"
    # When this process last read a message of the stream (time.monotonic(); a stalled
    # judge moves it on), and the wall time it did (the node's last sign of life).
    last_seen: float = field(default_factory=time.monotonic)
    heard_at: float = field(default_factory=time.time)
    # The stale-process check in flight: it reads PostgreSQL, so it runs beside the
    # stream's reader, never in its way (the next heartbeat must not wait for a pool).
    stale_check: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class SentCommand:
    """A job command whose acknowledgement is recorded (node_commands)."""

    job_id: str
    generation: int
    actions: tuple[node_command_service.NodeAction, ...]


def _tracked(message: agent_pb2.SchedulerMessage) -> SentCommand | None:
    kind = message.WhichOneof("body")
    if kind == "start_ranks" and not message.start_ranks.standby_gpus:
        start = message.start_ranks
        return SentCommand(
            start.job_id, start.generation, node_command_service.actions_of(kind, False)
        )
    if kind == "reconfigure":
        new = message.reconfigure
        actions = node_command_service.actions_of(kind, bool(new.adopted_ranks))
        return SentCommand(new.job_id, new.generation, actions)
    return None


@dataclass(frozen=True)
class Beats:
    """What agents are told about heartbeats, and the deadline that follows (seconds)."""

    interval: float
    """How often an agent looks at its node and flushes step times."""
    refresh: float
    """The longest an agent goes without a heartbeat."""
    liveness_timeout: float
    """No heartbeat for this long: the liveness scan declares the node LOST."""


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
    ) -> None:
        self.accept = accept
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
        reason = "agent stream closed"
        getter: asyncio.Task[object] | None = None
        try:
            yield agent_pb2.SchedulerMessage(registered=await self._registered(state.node_id))
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    try:
                        reader.result()  # re-raise a protocol error; else the agent hung up
                    except Exception as exc:
                        reason = f"agent stream broken: {exc}"
                        raise
                    return
                item = getter.result()
                if isinstance(item, CloseStream):
                    reason = item.reason
                    return
                assert isinstance(item, agent_pb2.SchedulerMessage)
                state.commands[item.command_id] = _tracked(item)
                yield item
        finally:
            pending = [
                t for t in (getter, reader, state.stale_check) if t is not None and not t.done()
            ]
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
                recording = asyncio.create_task(self._lost(state.node_id, reason, state.heard_at))
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

    async def _lost(self, node_id: str, reason: str, last_seen_at: float) -> None:
        try:
            async with self.store.write() as session:
                await health_service.mark_lost(
                    session, node_id, reason=reason, last_seen_at=last_seen_at
                )
            await self.hot.forget_node(node_id)
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
        if not NODE_ID_RE.match(reg.node_id):
            raise InvalidArgument(
                "register.node_id",
                reg.node_id,
                "use 1-253 letters, digits, '.', '_' or '-', starting with a letter or digit",
            )
        if reg.requested_role:
            node_roles_from_pb([reg.requested_role], field="register.requested_role")
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
        async with self.store.write() as session:
            if caller.node_id:
                await enrollment.check_not_revoked(session, reg.node_id, caller.issued_at)
            node, _created = await node_service.register_node(
                session,
                reg,
                now=dt.datetime.now(dt.UTC),
                connected_elsewhere=self.gateway.connected(reg.node_id),
            )
        await self.hot.record_heartbeat(node.id, self.liveness_timeout)
        return StreamState(node_id=node.id, seq=message.seq)

    async def _registered(self, node_id: str) -> agent_pb2.Registered:
        async with self.store.read() as session:
            node = await node_service.get_node(session, node_id)
        return agent_pb2.Registered(
            node_id=node.id,
            heartbeat_interval_seconds=self.beats.interval,
            refresh_interval_seconds=self.beats.refresh,
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
            if message.WhichOneof("body") == "heartbeat":
                # Its health is checked by _heartbeat, when it changed.
                check_agent_message(message.heartbeat, path="heartbeat", skip=HEALTH_PATH)
            else:
                check_agent_message(message)
            await self._handle(state, message)

    async def _handle(self, state: StreamState, message: agent_pb2.AgentMessage) -> None:
        kind = message.WhichOneof("body")
        node_id = state.node_id
        if kind == "heartbeat":
            await self._heartbeat(state, message.heartbeat)
        elif kind == "xid":
            async with self.store.write() as session:
                await health_service.record_xid(
                    session, node_id, message.xid, now=dt.datetime.now(dt.UTC)
                )
        elif kind == "step_summary":
            summary = message.step_summary
            summary.node_id = node_id  # the stream's node, whatever the agent wrote
            await self.hot.record_step_summary(summary)
        elif kind == "rank_exited":
            exited = message.rank_exited
            how = f"signal {exited.signal}" if exited.signal else f"exit code {exited.exit_code}"
            async with self.store.write() as session:
                record_event(
                    session,
                    "rank.exited",
                    actor=f"agent:{node_id}",
                    job_id=exited.job_id or None,
                    node_id=node_id,
                    reason=f"rank {exited.rank} ended with {how}",
                    attributes={
                        "rank": str(exited.rank),
                        "generation": str(exited.generation),
                        "exit_code": str(exited.exit_code),
                        "signal": str(exited.signal),
                        **{f"result.{k}": v[:1000] for k, v in list(exited.result.items())[:32]},
                    },
                )
        elif kind == "finding":
            await self._finding(node_id, message.finding)
        elif kind == "run_record":
            await self._run_record(node_id, message.run_record)
        elif kind == "stacks":
            async with self.store.write() as session:
                job = await session.get(models.Job, message.stacks.job_id)
                if job is not None:  # a job deleted since: its stacks have nowhere to go
                    stacks_service.store(session, node_id, message.stacks)
        elif kind == "ack":
            await self._ack(state, message.ack)
        elif kind == "register":
            raise FailedPrecondition("Register is only valid as a stream's first message")
        else:
            raise InvalidArgument("body", kind or "empty", "send one of the AgentMessage kinds")

    async def _finding(self, node_id: str, finding: agent_pb2.IntegrityFinding) -> None:
        async with self.store.write() as session:
            paused = await integrity_service.record_finding(session, node_id, finding)
            nodes = await job_service.job_nodes(session, paused) if paused is not None else []
        if paused is not None:
            # After the commit, as a user's pause: the ranks stop at their next boundary.
            pause = agent_pb2.SchedulerMessage(
                pause=agent_pb2.PauseJob(job_id=paused.id, generation=paused.generation)
            )
            for node in nodes:
                await self.send(node, pause)

    async def _run_record(self, node_id: str, record: agent_pb2.RunRecord) -> None:
        """Keep a generation's run record. One that cannot be kept is logged and dropped:
        it is the job's record, not worth the node's stream (the agent's endpoint refuses
        what would be refused here before it is sent)."""
        try:
            async with self.store.write() as session:
                kept = await record_service.store_run_record(session, node_id, record)
        except InvalidArgument as exc:
            log.warning("node %s: run record of job %s dropped: %s", node_id, record.job_id, exc)
            return
        if not kept:
            log.info("node %s: run record of unknown job %s dropped", node_id, record.job_id)

    async def _heartbeat(self, state: StreamState, beat: agent_pb2.Heartbeat) -> None:
        if beat.HasField("time"):
            lag = dt.datetime.now(dt.UTC) - beat.time.ToDatetime(dt.UTC)
            self.metrics.heartbeat_lag_seconds.observe(max(lag.total_seconds(), 0.0))
        sent = (
            beat.health.SerializeToString(deterministic=True),
            tuple(sorted({r.job_id for r in beat.running_ranks if r.standby and r.ready})),
        )
        if sent != state.health_sent:
            if state.health_sent is None or sent[0] != state.health_sent[0]:
                check_agent_message(beat.health, path=HEALTH_PATH)
            live = json_format.MessageToDict(beat.health, preserving_proto_field_name=True)
            live[STANDBY_READY] = list(sent[1])
            state.health_sent, state.health_json = sent, json.dumps(live)
        await self.hot.record_heartbeat(state.node_id, self.liveness_timeout, state.health_json)
        self._check_stale_soon(state, beat)
        reasons = tuple(beat.health.reasons)
        if (beat.health.verdict, reasons) == (state.verdict, state.reasons):
            return
        state.verdict, state.reasons = beat.health.verdict, reasons
        async with self.store.write() as session:
            await health_service.apply_health(session, state.node_id, beat.health)

    def _check_stale_soon(self, state: StreamState, beat: agent_pb2.Heartbeat) -> None:
        """Start `_stop_stale` beside the reader, every few seconds at most, one at a time."""
        now = asyncio.get_running_loop().time()
        if not beat.running_ranks or now < state.ended_check_at:
            return
        if state.stale_check is not None and not state.stale_check.done():
            return
        state.ended_check_at = now + ENDED_CHECK_SECONDS
        running = [(r.job_id, r.generation, r.rank, r.standby) for r in beat.running_ranks]
        state.stale_check = asyncio.create_task(self._stop_stale_logged(state, running))

    async def _stop_stale_logged(
        self, state: StreamState, running: list[tuple[str, int, int, bool]]
    ) -> None:
        try:
            await self._stop_stale(state, running)
        except Exception:  # the next heartbeats try again
            log.warning("node %s: stale-process check failed", state.node_id, exc_info=True)

    async def _stop_stale(
        self, state: StreamState, running: list[tuple[str, int, int, bool]]
    ) -> None:
        """Stop the node's processes of jobs that ended, and its ranks left behind in an
        older generation of a job that runs on without them. The leader tells a node
        when a job ends or leaves it, but that message can be lost (a leader change, a
        node cut off or frozen meanwhile), and nothing may run on — or hold a GPU —
        for nothing."""
        if await self.generations.nothing_to_stop(running):
            return
        async with self.store.read() as session:
            stale = await job_service.stale_processes(session, state.node_id, running)
        for job_id, ranks in sorted(stale.items()):
            if ranks is None:  # preempted: the ranks stop at a boundary, snapshot sealed
                why = "the job was sent back to the queue"
                stop = agent_pb2.StopRanks(
                    job_id=job_id, grace_seconds=PREEMPT_GRACE_SECONDS, reason=why, at_boundary=True
                )
            else:
                why = "the job ended" if not ranks else "its job runs on in a newer generation"
                stop = agent_pb2.StopRanks(job_id=job_id, ranks=ranks, grace_seconds=5, reason=why)
            log.info(
                "node %s: stopping %s of job %s: %s", state.node_id, ranks or "all", job_id, why
            )
            await self.gateway.forward(state.node_id, agent_pb2.SchedulerMessage(stop_ranks=stop))

    async def _ack(self, state: StreamState, ack: agent_pb2.CommandAck) -> None:
        if ack.command_id not in state.commands:
            log.warning(
                "node %s: ack for unknown command %d ignored", state.node_id, ack.command_id
            )
            return
        sent = state.commands.pop(ack.command_id)
        if ack.ok and sent is not None:
            self.acks.add(sent.job_id, state.node_id, sent.generation, sent.actions)
        if not ack.ok:
            async with self.store.write() as session:
                record_event(
                    session,
                    "node.command_failed",
                    actor=f"agent:{state.node_id}",
                    node_id=state.node_id,
                    reason=ack.error[:1000],
                    attributes={"command_id": str(ack.command_id)},
                )
