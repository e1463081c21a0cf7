"""Nodes: registration from agents, operator actions (cordon, uncordon, drain, role)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import (
    TERMINAL_JOB_STATES,
    HealthVerdict,
    LossCause,
    NodeRole,
    NodeState,
    Registration,
)
from pitstop.scheduler.errors import FailedPrecondition, InvalidArgument, NotFound
from pitstop.scheduler.jobspec import check_text
from pitstop.scheduler.services.events import record_event

XID_HISTORY = 50


async def get_node(session: AsyncSession, node_id: str, *, for_update: bool = False) -> models.Node:
    if not node_id:
        raise InvalidArgument(
            "node_id", node_id, "give a node id; list them with pitstop node list"
        )
    check_text("node_id", node_id, max_len=253)
    query = (
        select(models.Node).where(models.Node.id == node_id).options(selectinload(models.Node.gpus))
    )
    if for_update:
        query = query.with_for_update(key_share=True)
    node = await session.scalar(query)
    if node is None:
        raise NotFound("node", node_id, "list nodes with `pitstop node list`")
    return node


async def list_nodes(
    session: AsyncSession, *, states: Sequence[NodeState], roles: Sequence[NodeRole]
) -> Sequence[models.Node]:
    query = select(models.Node).options(selectinload(models.Node.gpus)).order_by(models.Node.id)
    if states:
        query = query.where(models.Node.state.in_(states))
    if roles:
        query = query.where(models.Node.role.in_(roles))
    return (await session.scalars(query)).all()


async def xid_history(session: AsyncSession, node_id: str) -> Sequence[models.XidRecord]:
    query = (
        select(models.XidRecord)
        .where(models.XidRecord.node_id == node_id)
        .order_by(models.XidRecord.time.desc(), models.XidRecord.id.desc())
        .limit(XID_HISTORY)
    )
    return (await session.scalars(query)).all()


async def active_jobs_on(session: AsyncSession, node_id: str) -> list[str]:
    """Jobs whose current generation places a rank on the node."""
    query = (
        select(models.Job.id)
        .join(
            models.RankAssignment,
            (models.RankAssignment.job_id == models.Job.id) & models.RankAssignment.current(),
        )
        .where(models.RankAssignment.node_id == node_id)
        .where(models.Job.state.not_in(TERMINAL_JOB_STATES))
        .distinct()
        .order_by(models.Job.id)
    )
    return list((await session.scalars(query)).all())


def move_node(
    session: AsyncSession,
    node: models.Node,
    target: NodeState,
    *,
    kind: str,
    reason: str,
    actor: str,
    attributes: dict[str, str] | None = None,
) -> None:
    """One node state change with its reason, and its event; when the state changes, the
    time it did (LOST says how: `health.mark_all_lost` names a silent loss)."""
    previous = node.state
    node.state = target
    node.reason = reason
    if target is not previous:
        node.state_since = func.now()
        node.loss_cause = LossCause.STREAM if target is NodeState.LOST else LossCause.NONE
    record_event(
        session,
        kind,
        actor=actor,
        node_id=node.id,
        from_state=previous.value,
        to_state=target.value,
        reason=reason,
        attributes=attributes,
    )


async def cordon_node(
    session: AsyncSession, node_id: str, *, reason: str, actor: str
) -> models.Node:
    """READY -> CORDONED; already cordoned is a no-op."""
    check_text("reason", reason, max_len=1024)
    node = await get_node(session, node_id, for_update=True)
    if node.state is NodeState.CORDONED:
        return node
    if node.state is not NodeState.READY:
        raise FailedPrecondition(
            f"node {node.id} is {node.state.value}; only a ready node can be cordoned"
        )
    move_node(
        session,
        node,
        NodeState.CORDONED,
        kind="node.cordoned",
        reason=reason or f"cordoned by {actor}",
        actor=actor,
    )
    return node


async def revoke_node(
    session: AsyncSession, node_id: str, *, reason: str, actor: str
) -> models.Node:
    """Refuse the node's certificates issued until now; cordon it when it is ready. The
    caller closes its stream once this commits."""
    check_text("reason", reason, max_len=1024)
    node = await get_node(session, node_id, for_update=True)
    node.revoked_at = dt.datetime.now(dt.UTC)
    why = reason or f"certificate revoked by {actor}"
    record_event(session, "node.revoked", actor=actor, node_id=node.id, reason=why)
    if node.state is NodeState.READY:
        move_node(session, node, NodeState.CORDONED, kind="node.cordoned", reason=why, actor=actor)
    return node


async def uncordon_node(
    session: AsyncSession,
    node_id: str,
    *,
    reason: str,
    actor: str,
    live_verdict: HealthVerdict | None = None,
    live_received_at: float = 0.0,
) -> models.Node:
    """CORDONED or DRAINING -> READY; already ready is a no-op. An UNHEALTHY node may be
    returned to service only while its agent is connected and reports it healthy (the
    operator vouches for the repair) in a report received after it became unhealthy; a
    LOST node comes back when its agent reconnects."""
    check_text("reason", reason, max_len=1024)
    node = await get_node(session, node_id, for_update=True)
    if node.state is NodeState.READY:
        return node
    repaired = False
    if (
        node.state is NodeState.UNHEALTHY
        and node.connected
        and live_verdict is HealthVerdict.HEALTHY
    ):
        since = await session.scalar(
            select(func.max(models.Event.time))
            .where(models.Event.node_id == node.id)
            .where(models.Event.to_state == NodeState.UNHEALTHY.value)
        )
        repaired = since is None or live_received_at > since.timestamp()
    if node.state not in (NodeState.CORDONED, NodeState.DRAINING) and not repaired:
        raise FailedPrecondition(
            f"node {node.id} is {node.state.value} ({node.reason}); "
            + (
                "it returns when its agent reconnects"
                if node.state is NodeState.LOST
                else "it can be uncordoned once its agent is connected and reports it healthy "
                "(fix or clear the fault first), or restart its agent after the repair"
            )
        )
    move_node(
        session,
        node,
        NodeState.READY,
        kind="node.uncordoned",
        reason=reason or f"uncordoned by {actor}",
        actor=actor,
    )
    return node


async def drain_node(
    session: AsyncSession, node_id: str, *, reason: str, actor: str
) -> models.Node:
    """READY or CORDONED -> DRAINING; already draining is a no-op."""
    check_text("reason", reason, max_len=1024)
    node = await get_node(session, node_id, for_update=True)
    if node.state is NodeState.DRAINING:
        return node
    if node.state not in (NodeState.READY, NodeState.CORDONED):
        raise FailedPrecondition(
            f"node {node.id} is {node.state.value}; only a ready or cordoned node can be drained"
        )
    move_node(
        session,
        node,
        NodeState.DRAINING,
        kind="node.draining",
        reason=reason or f"drained by {actor}",
        actor=actor,
    )
    return node


async def set_node_role(
    session: AsyncSession, node_id: str, role: NodeRole, *, reason: str, actor: str
) -> models.Node:
    """Worker <-> spare, refused while the node runs ranks (their jobs would lose them)."""
    check_text("reason", reason, max_len=1024)
    node = await get_node(session, node_id, for_update=True)
    if node.role is role:
        return node
    jobs = await active_jobs_on(session, node.id)
    if jobs:
        raise FailedPrecondition(
            f"node {node.id} runs ranks of {', '.join(jobs)}; drain it first "
            f"(pitstop node drain {node.id}) and set its role once they moved"
        )
    previous = node.role
    node.role = role
    record_event(
        session,
        "node.role",
        actor=actor,
        node_id=node.id,
        reason=reason or f"role set to {role.value} by {actor}",
        attributes={"from_role": previous.value, "to_role": role.value},
    )
    return node


async def register_node(
    session: AsyncSession,
    reg: Registration,
    *,
    now: dt.datetime,
    connected_elsewhere: bool = False,
) -> tuple[models.Node, bool]:
    """Create or refresh a node from its agent's registration. Returns (node, created).

    The scheduler's record wins for role and state; inventory and labels are the agent's.
    A LOST node that registers again is READY; an UNHEALTHY one only when its agent
    process restarted (the repair). A node id already streaming from another agent with
    different GPUs is refused: two hosts share one id.
    """
    node = await session.scalar(
        select(models.Node)
        .where(models.Node.id == reg.node_id)
        .options(selectinload(models.Node.gpus))
        .with_for_update(key_share=True)
    )
    if node is not None and connected_elsewhere:
        known = sorted(g.uuid for g in node.gpus)
        offered = sorted(g.uuid for g in reg.gpus)
        if known != offered:
            raise FailedPrecondition(
                f"node {reg.node_id} is connected from another agent with different GPUs "
                f"({', '.join(known[:2])}...); give each host its own node_id"
            )
    offered_uuids = [g.uuid for g in reg.gpus]
    if offered_uuids:
        claimed = (
            await session.execute(
                select(models.Gpu.uuid, models.Gpu.node_id)
                .where(models.Gpu.uuid.in_(offered_uuids))
                .where(models.Gpu.node_id != reg.node_id)
                .limit(1)
            )
        ).first()
        if claimed is not None:
            raise FailedPrecondition(
                f"register.inventory.gpus: GPU {claimed.uuid} belongs to node "
                f"{claimed.node_id}; a node registers only its own GPUs (two hosts with one "
                "GPU uuid is a misconfigured simulator or a spoof)"
            )
    started_at = reg.agent_started_at
    created = node is None
    if node is None:
        node = models.Node(
            id=reg.node_id, role=reg.role, state=NodeState.READY, reason="registered", health={}
        )
        session.add(node)
    restarted = started_at is not None and node.agent_started_at != started_at
    node.hostname = reg.hostname
    node.driver_version = reg.driver_version
    node.gpu_backend = reg.gpu_backend
    node.agent_version = reg.agent_version
    node.checkpointd_address = reg.checkpointd_address
    node.zone, node.block = reg.zone, reg.block
    node.rack, node.nvlink_domain = reg.rack, reg.nvlink_domain
    node.connected = True
    node.last_seen_at = now
    node.agent_started_at = started_at
    by_index = {g.index: g for g in node.gpus}
    seen = set()
    for g in reg.gpus:
        seen.add(g.index)
        gpu = by_index.get(g.index)
        if gpu is None:
            gpu = models.Gpu(index=g.index)
            node.gpus.append(gpu)
        gpu.uuid, gpu.name, gpu.memory_bytes = g.uuid, g.name, g.memory_bytes
        gpu.pci_bus_id = g.pci_bus_id
        gpu.fabric_cluster_uuid, gpu.fabric_clique_id = g.fabric_cluster_uuid, g.fabric_clique_id
    node.gpus = [g for g in node.gpus if g.index in seen]
    actor = f"agent:{node.id}"
    record_event(
        session,
        "node.registered" if created else "node.reconnected",
        actor=actor,
        node_id=node.id,
        to_state=node.state.value,
        reason=f"{len(reg.gpus)} GPUs, backend {reg.gpu_backend or 'unknown'}",
    )
    if node.state is NodeState.LOST and node.revoked_at is not None:
        # Its certificates were revoked and it enrolled again: an admin says when it
        # takes work (uncordon).
        why = "agent reconnected after its certificates were revoked; uncordon to use it"
        move_node(session, node, NodeState.CORDONED, kind="node.cordoned", reason=why, actor=actor)
    elif node.state is NodeState.LOST or (node.state is NodeState.UNHEALTHY and restarted):
        why = "agent reconnected" if node.state is NodeState.LOST else "agent restarted"
        move_node(session, node, NodeState.READY, kind="node.recovered", reason=why, actor=actor)
    return node, created


async def mark_disconnected(session: AsyncSession, node_id: str) -> None:
    node = await session.get(models.Node, node_id, with_for_update=models.NO_KEY_UPDATE)
    if node is not None and node.connected:
        node.connected = False
        record_event(
            session,
            "node.disconnected",
            actor="scheduler",
            node_id=node_id,
            reason="agent stream closed",
        )


async def swap_roles(
    session: AsyncSession, taken: Sequence[str], replaced: Sequence[str], *, job_id: str
) -> list[tuple[str, str]]:
    """A recovery moved job `job_id`'s ranks from the `replaced` nodes onto the `taken`
    ones: each spare among the taken becomes a worker and, one for one, a worker among
    the replaced becomes a spare. A hot spare takes the failed node's place, and the
    failed node, once back, is the spare: the worker pool (where jobs are placed, a
    preempted one again) and the spare pool keep their sizes. Returns the (spare, worker)
    pairs swapped."""
    ids = sorted({*taken, *replaced})
    if not ids:
        return []
    roles: dict[str, NodeRole] = {
        node_id: role
        for node_id, role in await session.execute(
            select(models.Node.id, models.Node.role).where(models.Node.id.in_(ids))
        )
    }
    promoted = [n for n in taken if roles.get(n) is NodeRole.SPARE]
    demoted = [n for n in replaced if roles.get(n) is NodeRole.WORKER]
    pairs = list(zip(promoted, demoted, strict=False))
    for spare, worker in pairs:
        for node_id, role, other in (
            (spare, NodeRole.WORKER, worker),
            (worker, NodeRole.SPARE, spare),
        ):
            node = await session.get(models.Node, node_id, with_for_update=True)
            if node is None:
                continue
            previous, node.role = node.role, role
            record_event(
                session,
                "node.role",
                actor="scheduler",
                node_id=node_id,
                job_id=job_id,
                reason=(
                    f"took the place of {other} in job {job_id}'s recovery"
                    if role is NodeRole.WORKER
                    else f"its place in job {job_id} went to spare {other}: a spare once back"
                ),
                attributes={"from_role": previous.value, "to_role": role.value},
            )
    return pairs
