"""Desired state per node of a job (``node_commands``): written by the decision that
makes a generation, acknowledged by the node's agent, re-sent by whichever process
leads until acknowledged. Level-triggered, in the sense of docs/architecture.md, "Invariants".

A row whose generation is older than its job's is a node that keeps its place: its
command for the job's generation is to reconfigure. A recovery's decision so writes only
the nodes whose command is something else (a start, an adoption, a leave): a few rows,
whatever the job's size. The first claim of such a row writes it out in full
(`claim_due`), in the fan-out's statement, which marks every command sent anyway."""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Select,
    String,
    cast,
    delete,
    func,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState

RESEND_SECONDS = 0.5
"""An unacknowledged command goes out again after this long."""
IN_FLIGHT = (JobState.STARTING, JobState.RECOVERING)
"""States in which a job's commands are re-sent until acknowledged."""


class NodeAction(enum.StrEnum):
    """What a node does to run the job's current generation."""

    START = "start"  # start its ranks as fresh processes (StartRanks)
    ADOPT = "adopt"  # hand them to the job's standby processes waiting there
    RECONFIGURE = "reconfigure"  # its ranks keep their processes and join the generation
    LEAVE = "leave"  # not in the generation: its ranks leave at the agreed boundary


@dataclass(frozen=True)
class DueCommand:
    """A node's command that is due to be (re-)sent."""

    job_id: str
    node_id: str
    generation: int
    action: NodeAction
    sends: int


async def replace_plan(
    session: AsyncSession, job: models.Job, actions: Mapping[str, NodeAction]
) -> None:
    """The job's commands for its current generation, replacing the previous ones, in
    three statements whatever the job's size: the job's rows locked in node order, the
    nodes left out of the plan deleted, every node's command upserted from two arrays.
    (Built as one ORM row per node, the write cost the deciding process 0.1 s of Python
    per decision at 1,000 nodes, most of it turning a statement of 5,000 parameters into
    PostgreSQL's.)"""
    c = models.NodeCommand
    nodes = sorted(actions)
    job.decided_at = func.now()
    await session.execute(
        select(func.count()).select_from(_locked_in_node_order(c.job_id == job.id).subquery())
    )
    await session.execute(
        delete(c)
        .where(c.job_id == job.id)
        .where(c.node_id.not_in(select(func.unnest(cast(nodes, ARRAY(String))))))
    )
    await _upsert(session, job, nodes, [actions[n] for n in nodes])


async def change_plan(
    session: AsyncSession, job: models.Job, actions: Mapping[str, NodeAction]
) -> None:
    """A recovery's commands for the job's new generation (`actions`: every node of it,
    and those leaving it), writing only what is not a reconfigure: the nodes that keep
    their place are rows of an older generation, which is what a reconfigure is. The
    nodes that left in an earlier generation are deleted. Locks and writes the changed
    rows only (in node order): the decision's cost does not grow with the job."""
    c = models.NodeCommand
    changed = sorted(n for n, a in actions.items() if a is not NodeAction.RECONFIGURE)
    job.decided_at = func.now()
    stale_leave = (
        (c.job_id == job.id)
        & (c.action == NodeAction.LEAVE.value)
        & (c.generation < job.generation)
    )
    await session.execute(
        select(func.count()).select_from(
            _locked_in_node_order(
                stale_leave | ((c.job_id == job.id) & c.node_id.in_(changed))
            ).subquery()
        )
    )
    await session.execute(delete(c).where(stale_leave))
    await _upsert(session, job, changed, [actions[n] for n in changed])


async def _upsert(
    session: AsyncSession, job: models.Job, nodes: list[str], actions: list[NodeAction]
) -> None:
    if not nodes:
        return
    await session.execute(
        _UPSERT_PLAN,
        {
            "job_id": job.id,
            "generation": job.generation,
            "nodes": nodes,
            "actions": [a.value for a in actions],
        },
    )


_UPSERT_PLAN = text(
    """
    INSERT INTO node_commands (job_id, node_id, generation, action)
    SELECT :job_id, p.node_id, :generation, p.action
    FROM unnest(CAST(:nodes AS text[]), CAST(:actions AS text[])) AS p (node_id, action)
    ORDER BY p.node_id
    ON CONFLICT (job_id, node_id) DO UPDATE SET
        generation = EXCLUDED.generation,
        action = EXCLUDED.action,
        acked_generation = 0,
        sends = 0,
        sent_at = NULL,
        decided_at = now()
    """
)


def _locked_in_node_order(*where: ColumnElement[bool]) -> Select[str, str]:
    """The rows `where` selects, locked in (job, node) order. Every statement that
    writes several rows takes them this way, so a decision's plan write, the leader's
    send marks and an ingest process's acknowledgements never wait on each other in a
    cycle (PostgreSQL then aborts one of them as a deadlock; acks did, at 1,000 nodes)."""
    c = models.NodeCommand
    return select(c.job_id, c.node_id).where(*where).order_by(c.job_id, c.node_id).with_for_update()


def _locked(*where: ColumnElement[bool]) -> ColumnElement[bool]:
    c = models.NodeCommand
    return tuple_(c.job_id, c.node_id).in_(_locked_in_node_order(*where))


async def starting_nodes(session: AsyncSession, job: models.Job) -> set[str]:
    """The job's nodes whose command for its current generation starts (or adopts)
    their ranks (the others keep their place: older rows reconfigure)."""
    c = models.NodeCommand
    rows = await session.scalars(
        select(c.node_id)
        .where(c.job_id == job.id)
        .where(c.generation == job.generation)
        .where(c.action.in_((NodeAction.START.value, NodeAction.ADOPT.value)))
    )
    return set(rows)


@dataclass(frozen=True)
class NodeCommandState:
    """A node's command for its job's current generation, as it stands."""

    action: NodeAction
    decided_at: dt.datetime
    """When the decision that made it committed."""


async def command(session: AsyncSession, job: models.Job, node_id: str) -> NodeCommandState | None:
    """The node's command for the job's current generation, if it has one: its row's,
    or reconfigure for a row of an older generation (decided with the job's)."""
    row = await session.get(models.NodeCommand, (job.id, node_id))
    if row is None:
        return None
    if row.generation < job.generation:
        return NodeCommandState(NodeAction.RECONFIGURE, job.decided_at or row.decided_at)
    return NodeCommandState(NodeAction(row.action), row.decided_at)


async def restart_node(session: AsyncSession, job: models.Job, node_id: str) -> bool:
    """Make a node that was to reconfigure (or adopt) start its ranks afresh instead (a
    rank of it died before joining); True if its command changed."""
    current = await command(session, job, node_id)
    if current is None or current.action not in (NodeAction.RECONFIGURE, NodeAction.ADOPT):
        return False
    c = models.NodeCommand
    await session.execute(
        update(c)
        .where(c.job_id == job.id)
        .where(c.node_id == node_id)
        .values(
            generation=job.generation,
            action=NodeAction.START.value,
            acked_generation=0,
            sends=0,
            sent_at=None,
        )
    )
    return True


async def claim_due(session: AsyncSession, job_ids: set[str] | None = None) -> list[DueCommand]:
    """Mark as sent, and return, every command not acknowledged whose job is starting or
    recovering, whose backoff passed, and that was never sent or not for a while: a row
    of an older generation is its node's reconfigure for the job's current one, written
    out in full as it is claimed. The rows are locked in (job, node) order first. The
    caller sends them after the commit (no network call inside a transaction)."""
    only = "" if job_ids is None else "AND j.id = ANY(CAST(:job_ids AS text[]))"
    params: dict[str, object] = {
        "states": [state.value for state in IN_FLIGHT],
        "resend": dt.timedelta(seconds=RESEND_SECONDS),
    }
    if job_ids is not None:
        params["job_ids"] = sorted(job_ids)
    rows = await session.execute(text(_CLAIM_DUE.format(only=only)), params)
    return [
        DueCommand(job_id, node_id, int(generation), NodeAction(action), int(sends))
        for job_id, node_id, generation, action, sends in rows.all()
    ]


_CLAIM_DUE = """
    WITH due AS (
        SELECT c.job_id, c.node_id
        FROM node_commands c JOIN jobs j ON j.id = c.job_id
        WHERE j.state = ANY(CAST(:states AS text[]))
          AND (j.commands_after IS NULL OR j.commands_after <= now())
          {only}
          AND c.acked_generation < j.generation
          AND (c.generation < j.generation OR c.sent_at IS NULL
               OR c.sent_at < now() - CAST(:resend AS interval))
        ORDER BY c.job_id, c.node_id
        FOR UPDATE OF c
    )
    UPDATE node_commands c SET
        generation = j.generation,
        action = CASE WHEN c.generation < j.generation THEN 'reconfigure' ELSE c.action END,
        sends = CASE WHEN c.generation < j.generation THEN 1 ELSE c.sends + 1 END,
        sent_at = now()
    FROM due, jobs j
    WHERE c.job_id = due.job_id AND c.node_id = due.node_id AND j.id = c.job_id
    RETURNING c.job_id, c.node_id, c.generation, c.action, c.sends
"""


def actions_of(message_kind: str, adopting: bool) -> tuple[NodeAction, ...]:
    """The node actions a command of `message_kind` carries out."""
    if message_kind == "start_ranks":
        return (NodeAction.START,)
    if adopting:
        return (NodeAction.ADOPT,)
    return (NodeAction.RECONFIGURE, NodeAction.LEAVE)


AckKey = tuple[str, int, tuple[NodeAction, ...]]
"""A batch's acknowledgements are grouped by job, generation and actions carried out."""


async def acknowledge_batch(session: AsyncSession, batch: Mapping[AckKey, Collection[str]]) -> None:
    """Record a batch of acknowledgements (`acknowledge_nodes` per group). Every row the
    batch writes is locked first, in one statement and in (job, node) order: groups of
    one job name their nodes in no common order, and a decision writing the job's plan
    meanwhile would otherwise hold one of them while waiting for another."""
    c = models.NodeCommand
    pairs = sorted(
        {(job_id, node_id) for (job_id, _, _), nodes in batch.items() for node_id in nodes}
    )
    if not pairs:
        return
    wanted = select(
        func.unnest(cast([j for j, _ in pairs], ARRAY(String))).label("job_id"),
        func.unnest(cast([n for _, n in pairs], ARRAY(String))).label("node_id"),
    ).subquery()
    await session.execute(
        select(func.count()).select_from(
            select(c.job_id)
            .join(wanted, (c.job_id == wanted.c.job_id) & (c.node_id == wanted.c.node_id))
            .order_by(c.job_id, c.node_id)
            .with_for_update(of=c)
            .subquery()
        )
    )
    for (job_id, generation, actions), nodes in sorted(batch.items()):
        await acknowledge_nodes(session, job_id, sorted(nodes), generation, actions)


async def acknowledge_nodes(
    session: AsyncSession,
    job_id: str,
    node_ids: list[str],
    generation: int,
    actions: tuple[NodeAction, ...],
) -> None:
    """The nodes' agents carried out the job's command for `generation`, one statement
    for all of them; an ack of an action a node no longer has (it was changed meanwhile)
    acknowledges nothing."""
    c = models.NodeCommand
    # A row of an older generation is a reconfigure for this one (see claim_due).
    carried = (c.generation == generation) & c.action.in_([a.value for a in actions])
    if NodeAction.RECONFIGURE in actions:
        carried = carried | (c.generation < generation)
    await session.execute(
        update(c)
        .where(_locked(c.job_id == job_id, c.node_id.in_(node_ids), carried))
        .values(acked_generation=func.greatest(c.acked_generation, generation))
    )
