"""What the scheduler makes of a node's health: Xids, verdicts, lost agents.

Classification lives in ``pitstop.health`` (pure); this module turns a verdict into a
node state change, with its event, in the caller's transaction:

* fatal (an Xid such as 79, a lost GPU, uncorrected ECC) -> UNHEALTHY: replace the node;
* warning (pending row remap, Xid 63/92/94, NVLink errors growing, a recovery action)
  -> DRAINING: move its ranks at the next committed checkpoint;
* application Xid -> an event only: the rank restarts in place, the GPU is fine;
* degraded (a node daemon down, a daemon's disk full, memory pressure) -> an event
  when it starts and one when it ends; the node keeps its state and its work;
* a broken stream or a missed liveness deadline -> LOST.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.health.host import gist
from pitstop.health.xid import XidClass, classify_xid
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import HealthReport, HealthVerdict, LossCause, NodeState, XidReport
from pitstop.scheduler.services import catalog
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.nodes import move_node

# States a verdict may move a node out of. UNHEALTHY and LOST are left alone: the first
# is already the worst, the second means the agent is not talking at all.
_LIVE = (NodeState.READY, NodeState.CORDONED, NodeState.DRAINING)


async def locked_node(session: AsyncSession, node_id: str) -> models.Node | None:
    return await session.scalar(
        select(models.Node).where(models.Node.id == node_id).with_for_update(key_share=True)
    )


def live(node: models.Node) -> bool:
    """Whether a node may be quarantined or drained: not already UNHEALTHY or LOST."""
    return node.state in _LIVE


async def quarantine(
    session: AsyncSession,
    node: models.Node,
    *,
    reason: str,
    actor: str,
    attributes: Mapping[str, str] | None = None,
) -> None:
    """UNHEALTHY with its event (`node` locked, `live`), and the shards its checkpoint
    daemon held forgotten: no job places ranks there, and no restore reads from it."""
    move_node(
        session,
        node,
        NodeState.UNHEALTHY,
        kind="node.unhealthy",
        reason=reason,
        actor=actor,
        attributes=dict(attributes) if attributes else None,
    )
    await catalog.forget_node(session, node.id)


async def record_xid(
    session: AsyncSession, node_id: str, xid: XidReport, *, now: dt.datetime
) -> NodeState | None:
    """Store the Xid in the node's history and act on its class. Returns the new state if
    the node changed state."""
    info = classify_xid(xid.xid)
    verdict = {
        XidClass.FATAL: "fatal",
        XidClass.WARNING: "warning",
        XidClass.APPLICATION: "application",
        XidClass.INFO: "healthy",
    }[info.xid_class]
    session.add(
        models.XidRecord(
            node_id=node_id,
            gpu_index=xid.gpu_index,
            gpu_uuid=xid.gpu_uuid,
            xid=xid.xid,
            message=xid.message[:2000],
            source=xid.source,
            verdict=verdict,
            time=xid.time if xid.time is not None else now,
        )
    )
    reason = f"Xid {xid.xid} on GPU {xid.gpu_index}: {info.name}"
    attributes = {"xid": str(xid.xid), "gpu": str(xid.gpu_index), "class": info.xid_class.value}
    actor = f"agent:{node_id}"
    node = await locked_node(session, node_id)
    if node is None:
        return None
    if info.xid_class is XidClass.FATAL and node.state in _LIVE:
        await quarantine(session, node, reason=reason, actor=actor, attributes=attributes)
        return node.state
    if info.xid_class is XidClass.WARNING and node.state in (NodeState.READY, NodeState.CORDONED):
        move_node(
            session,
            node,
            NodeState.DRAINING,
            kind="node.draining",
            reason=reason,
            actor=actor,
            attributes=attributes,
        )
        return node.state
    record_event(
        session, "node.xid", actor=actor, node_id=node_id, reason=reason, attributes=attributes
    )
    return None


async def apply_health(
    session: AsyncSession, node_id: str, health: HealthReport
) -> NodeState | None:
    """Store the node's health (called only when the verdict or reasons changed) and act
    on a fatal or warning verdict. Returns the new state if the node changed state."""
    node = await locked_node(session, node_id)
    if node is None:
        return None
    was_degraded = health_verdict(node.health) is HealthVerdict.DEGRADED
    said_before = gist((node.health or {}).get("reasons", ()))
    node.health = health.document
    reason = "; ".join(health.reasons) or (health.verdict.value if health.verdict else "unknown")
    actor = f"agent:{node_id}"
    if health.verdict is HealthVerdict.FATAL and node.state in _LIVE:
        await quarantine(session, node, reason=reason, actor=actor)
        return node.state
    if health.verdict is HealthVerdict.WARNING and node.state in (
        NodeState.READY,
        NodeState.CORDONED,
    ):
        move_node(
            session, node, NodeState.DRAINING, kind="node.draining", reason=reason, actor=actor
        )
        return node.state
    degraded = health.verdict is HealthVerdict.DEGRADED
    # A degraded node is news when it starts, ends, or says something new: not when a
    # number in what it says moved (a disk filling, memory pressure rising).
    if degraded != was_degraded or (degraded and gist(health.reasons) != said_before):
        # The node keeps its state and its work; the event log says what is wrong, and
        # when it is over.
        record_event(
            session,
            "node.degraded" if degraded else "node.degraded_cleared",
            actor=actor,
            node_id=node_id,
            reason=reason if degraded else "nothing degrades the node any more",
        )
    return None


LAST_SEEN_AT = "last_seen_at"
"""A node.lost event's attribute: when its agent was last heard from (epoch seconds),
where the process that held its stream knew: the failure began there, not when it was
noticed (a silent host is noticed a liveness timeout later)."""


LOSS_CAUSE = "cause"
"""A node.lost event's attribute: how it was lost (LossCause: "stream" or "silent")."""


async def mark_lost(
    session: AsyncSession,
    node_id: str,
    *,
    reason: str,
    last_seen_at: float | None = None,
    cause: LossCause = LossCause.STREAM,
    unless_registered_since: dt.datetime | None = None,
) -> bool:
    """LOST with its event, unless already lost, or registered again since the
    registration `unless_registered_since` (the stream that ended made it; its agent has
    another stream now, here or at another scheduler process: a healed partition
    delivers the old connection's end and the new one's Register together). Compared
    for equality under the row's lock, so neither clocks nor a registration still being
    written can make a connected node lost. An unhealthy node stays unhealthy (the worse
    news) but is recorded as disconnected. True if the state changed."""
    if unless_registered_since is not None:
        registered = await session.scalar(
            select(models.Node.last_seen_at)
            .where(models.Node.id == node_id)
            .with_for_update(key_share=True)
        )
        if registered is not None and registered != unless_registered_since:
            return False
    last_seen = {node_id: last_seen_at} if last_seen_at is not None else None
    lost = await mark_all_lost(session, [node_id], reason=reason, last_seen=last_seen, cause=cause)
    return bool(lost)


async def mark_all_lost(
    session: AsyncSession,
    node_ids: Sequence[str],
    *,
    reason: str,
    last_seen: Mapping[str, float] | None = None,
    cause: LossCause = LossCause.SILENT,
) -> list[str]:
    """``mark_lost`` for any number of nodes in the session's one transaction: one
    statement locks their rows (in id order, so two callers never deadlock on each
    other), one forgets the shards their daemons held; the state changes and events go
    out in the flush's batches. Returns the nodes that became LOST. `last_seen`: when
    each node's agent was last heard from, kept on its event (LAST_SEEN_AT); `cause`:
    how they were lost (a missed deadline is silence: nothing answered)."""
    nodes = (
        await session.scalars(
            select(models.Node)
            .where(models.Node.id.in_(sorted(set(node_ids))))
            .order_by(models.Node.id)
            .with_for_update(key_share=True)
        )
    ).all()
    lost = []
    for node in nodes:
        node.connected = False
        if node.state in _LIVE:
            heard = (last_seen or {}).get(node.id)
            attributes = {LOSS_CAUSE: cause.value}
            if heard is not None:
                attributes[LAST_SEEN_AT] = f"{heard:.6f}"
            move_node(
                session,
                node,
                NodeState.LOST,
                kind="node.lost",
                reason=reason,
                actor="scheduler",
                attributes=attributes,
            )
            node.loss_cause = cause
            lost.append(node.id)
        else:
            record_event(
                session, "node.disconnected", actor="scheduler", node_id=node.id, reason=reason
            )
    await catalog.forget_nodes(session, lost)
    return lost


def health_verdict(health_json: dict[str, Any]) -> HealthVerdict:
    """The verdict stored in a node's health JSON (UNSPECIFIED when unknown)."""
    try:
        return HealthVerdict(str(health_json.get("verdict", HealthVerdict.UNSPECIFIED)))
    except ValueError:
        return HealthVerdict.UNSPECIFIED
