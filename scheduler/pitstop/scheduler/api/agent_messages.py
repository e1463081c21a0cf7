"""What the scheduler does with each message an agent sends after Register.

One handler per AgentMessage kind, found in `HANDLERS` by the message's body field
(as the agent's executor finds its commands). A handler runs on the stream's reader,
so what it awaits holds up that node's next message.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from google.protobuf import json_format

from pitstop.health.host import gist
from pitstop.scheduler.admission import PREEMPT_GRACE_SECONDS
from pitstop.scheduler.api.agent_input import check_agent_message
from pitstop.scheduler.api.agent_stream import StreamState
from pitstop.scheduler.api.agent_writes import AckWriter, JobGenerations, StepWriter
from pitstop.scheduler.api.shedding import LoadShedder
from pitstop.scheduler.convert import health_from_pb, xid_from_pb
from pitstop.scheduler.db import models
from pitstop.scheduler.errors import FailedPrecondition, InvalidArgument
from pitstop.scheduler.gateway import AgentGateway
from pitstop.scheduler.hotstate import STANDBY_READY, HotState
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.services import health as health_service
from pitstop.scheduler.services import integrity as integrity_service
from pitstop.scheduler.services import jobs as job_service
from pitstop.scheduler.services import rank_exits
from pitstop.scheduler.services import records as record_service
from pitstop.scheduler.services import stacks as stacks_service
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2

log = logging.getLogger(__name__)

HEALTH_PATH = "heartbeat.health"
ENDED_CHECK_SECONDS = 5.0
"""How often the jobs a node reports running processes of are looked up."""


@dataclass(frozen=True)
class StreamLink:
    """What the handlers reach: the stores, the streams, and how commands go out."""

    store: Store
    hot: HotState
    gateway: AgentGateway
    send: Callable[[str, agent_pb2.SchedulerMessage], Awaitable[object]]
    """How a command reaches a node's agent (the command router)."""
    metrics: SchedulerMetrics
    acks: AckWriter
    generations: JobGenerations
    liveness_timeout: float
    steps: StepWriter
    shedder: LoadShedder
    """Drops telemetry while this process's event loop lags (shedding.py)."""


Handler = Callable[[StreamLink, StreamState, agent_pb2.AgentMessage], Awaitable[None]]


async def handle(link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage) -> None:
    """Act on one message of an open stream (its seq and fields already checked)."""
    kind = message.WhichOneof("body")
    handler = HANDLERS.get(kind or "")
    if handler is None:
        raise InvalidArgument("body", kind or "empty", "send one of the AgentMessage kinds")
    await handler(link, state, message)


async def _register_again(
    link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage
) -> None:
    raise FailedPrecondition("Register is only valid as a stream's first message")


async def _xid(link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage) -> None:
    async with link.store.write() as session:
        await health_service.record_xid(
            session, state.node_id, xid_from_pb(message.xid), now=dt.datetime.now(dt.UTC)
        )


async def _step_summary(
    link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage
) -> None:
    if link.shedder.drop("step_summary"):
        return
    summary = message.step_summary
    summary.node_id = state.node_id  # the stream's node, whatever the agent wrote
    link.steps.add(summary)


async def _rank_exited(
    link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage
) -> None:
    await link.steps.settle()  # its last steps first, as its agent sent them
    async with link.store.write() as session:
        await rank_exits.record_exits(session, state.node_id, [message.rank_exited])


async def _finding(link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage) -> None:
    await link.steps.settle()  # the steps its agent sent before it first
    async with link.store.write() as session:
        paused = await integrity_service.record_finding(session, state.node_id, message.finding)
        nodes = await job_service.job_nodes(session, paused) if paused is not None else []
    if paused is not None:
        # After the commit, as a user's pause: the ranks stop at their next boundary.
        pause = agent_pb2.SchedulerMessage(
            pause=agent_pb2.PauseJob(job_id=paused.id, generation=paused.generation)
        )
        for node in nodes:
            await link.send(node, pause)


async def _run_record(
    link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage
) -> None:
    """Keep a generation's run record. One that cannot be kept is logged and dropped:
    it is the job's record, not worth the node's stream (the agent's endpoint refuses
    what would be refused here before it is sent)."""
    node_id, record = state.node_id, message.run_record
    try:
        async with link.store.write() as session:
            kept = await record_service.store_run_record(session, node_id, record)
    except InvalidArgument as exc:
        log.warning("node %s: run record of job %s dropped: %s", node_id, record.job_id, exc)
        return
    if not kept:
        log.info("node %s: run record of unknown job %s dropped", node_id, record.job_id)


async def _stacks(link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage) -> None:
    async with link.store.write() as session:
        job = await session.get(models.Job, message.stacks.job_id)
        if job is not None:  # a job deleted since: its stacks have nowhere to go
            stacks_service.store(session, state.node_id, message.stacks)


async def _ack(link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage) -> None:
    ack = message.ack
    if ack.HasField("heartbeat"):  # what the heartbeat after the command would say
        await _beat(link, state, ack.heartbeat, path="ack.heartbeat.health")
    if ack.command_id not in state.commands:
        log.warning("node %s: ack for unknown command %d ignored", state.node_id, ack.command_id)
        return
    sent = state.commands.pop(ack.command_id)
    if ack.ok and sent is not None:
        link.acks.add(sent.job_id, state.node_id, sent.generation, sent.actions)
    if not ack.ok:
        async with link.store.write() as session:
            record_event(
                session,
                "node.command_failed",
                actor=f"agent:{state.node_id}",
                node_id=state.node_id,
                reason=ack.error[:1000],
                attributes={"command_id": str(ack.command_id)},
            )


async def _heartbeat(link: StreamLink, state: StreamState, message: agent_pb2.AgentMessage) -> None:
    await _beat(link, state, message.heartbeat, path=HEALTH_PATH)


async def _beat(
    link: StreamLink, state: StreamState, beat: agent_pb2.Heartbeat, *, path: str
) -> None:
    """A heartbeat, on its own or carried by an ack (`path`: where its health sits)."""
    if beat.HasField("time"):
        lag = dt.datetime.now(dt.UTC) - beat.time.ToDatetime(dt.UTC)
        link.metrics.heartbeat_lag_seconds.observe(max(lag.total_seconds(), 0.0))
    sent = (
        beat.health.SerializeToString(deterministic=True),
        tuple(sorted({r.job_id for r in beat.running_ranks if r.standby and r.ready})),
    )
    if sent == state.health_sent and link.shedder.drop("heartbeat"):
        return  # nothing new, and the node's deadline is this process's to keep
    if sent != state.health_sent:
        if state.health_sent is None or sent[0] != state.health_sent[0]:
            check_agent_message(beat.health, path=path)
        live = json_format.MessageToDict(beat.health, preserving_proto_field_name=True)
        live[STANDBY_READY] = list(sent[1])
        state.health_sent, state.health_json = sent, json.dumps(live)
    await link.hot.record_heartbeat(state.node_id, link.liveness_timeout, state.health_json)
    _check_stale_soon(link, state, beat)
    # Stored (and acted on) when the verdict or the reasons changed; a host reason's
    # numbers moving (a disk filling, memory pressure) is no change: the live health
    # above has them.
    host = set(beat.health.host.reasons)
    reasons = tuple(gist([r])[0] if r in host else r for r in beat.health.reasons)
    if (beat.health.verdict, reasons) == (state.verdict, state.reasons):
        return
    state.verdict, state.reasons = beat.health.verdict, reasons
    async with link.store.write() as session:
        await health_service.apply_health(session, state.node_id, health_from_pb(beat.health))


def _check_stale_soon(link: StreamLink, state: StreamState, beat: agent_pb2.Heartbeat) -> None:
    """Start `_stop_stale` beside the reader, every few seconds at most, one at a time."""
    now = asyncio.get_running_loop().time()
    if not beat.running_ranks or now < state.ended_check_at:
        return
    if state.stale_check is not None and not state.stale_check.done():
        return
    if link.shedder.drop("stale_check"):
        return  # a few seconds later: the processes it would stop are idle meanwhile
    state.ended_check_at = now + ENDED_CHECK_SECONDS
    running = [(r.job_id, r.generation, r.rank, r.standby) for r in beat.running_ranks]
    state.stale_check = asyncio.create_task(_stop_stale_logged(link, state, running))


async def _stop_stale_logged(
    link: StreamLink, state: StreamState, running: list[tuple[str, int, int, bool]]
) -> None:
    try:
        await _stop_stale(link, state, running)
    except Exception:  # the next heartbeats try again
        log.warning("node %s: stale-process check failed", state.node_id, exc_info=True)


async def _stop_stale(
    link: StreamLink, state: StreamState, running: list[tuple[str, int, int, bool]]
) -> None:
    """Stop the node's processes of jobs that ended, and its ranks left behind in an
    older generation of a job that runs on without them. The leader tells a node
    when a job ends or leaves it, but that message can be lost (a leader change, a
    node cut off or frozen meanwhile), and nothing may run on — or hold a GPU —
    for nothing."""
    if await link.generations.nothing_to_stop(running):
        return
    async with link.store.read() as session:
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
        log.info("node %s: stopping %s of job %s: %s", state.node_id, ranks or "all", job_id, why)
        await link.gateway.forward(state.node_id, agent_pb2.SchedulerMessage(stop_ranks=stop))


HANDLERS: dict[str, Handler] = {
    "heartbeat": _heartbeat,
    "xid": _xid,
    "step_summary": _step_summary,
    "rank_exited": _rank_exited,
    "finding": _finding,
    "run_record": _run_record,
    "stacks": _stacks,
    "ack": _ack,
    "register": _register_again,
}
"""AgentMessage body field -> what the scheduler does with it."""
