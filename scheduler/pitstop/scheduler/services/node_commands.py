"""Desired state per node of a job (``node_commands``): written by the decision that
makes a generation, acknowledged by the node's agent, re-sent by whichever process
leads until acknowledged. Level-triggered, in the sense of docs/architecture.md, "Invariants"."""

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
    or_,
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
    await session.execute(
        select(func.count()).select_from(_locked_in_node_order(c.job_id == job.id).subquery())
    )
    await session.execute(
        delete(c)
        .where(c.job_id == job.id)
        .where(c.node_id.not_in(select(func.unnest(cast(nodes, ARRAY(String))))))
    )
    await session.execute(
        _UPSERT_PLAN,
        {
            "job_id": job.id,
            "generation": job.generation,
            "nodes": nodes,
            "actions": [actions[n].value for n in nodes],
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


async def starting_nodes(session: AsyncSession, job_id: str) -> set[str]:
    """The job's nodes whose current command starts (or adopts) their ranks."""
    c = models.NodeCommand
    rows = await session.scalars(
        select(c.node_id)
        .where(c.job_id == job_id)
        .where(c.action.in_((NodeAction.START.value, NodeAction.ADOPT.value)))
    )
    return set(rows)


async def command(session: AsyncSession, job_id: str, node_id: str) -> models.NodeCommand | None:
    """The node's current command of the job, if it has one."""
    return await session.get(models.NodeCommand, (job_id, node_id))


async def restart_node(session: AsyncSession, job_id: str, node_id: str) -> bool:
    """Make a node that was to reconfigure start its ranks afresh instead (a rank of it
    died before joining); True if its command changed."""
    c = models.NodeCommand
    result = await session.execute(
        update(c)
        .where(c.job_id == job_id)
        .where(c.node_id == node_id)
        .where(c.action.in_((NodeAction.RECONFIGURE, NodeAction.ADOPT)))
        .values(action=NodeAction.START.value, acked_generation=0, sent_at=None)
    )
    return bool(getattr(result, "rowcount", 0))


async def claim_due(session: AsyncSession, job_ids: set[str] | None = None) -> list[DueCommand]:
    """Mark as sent, and return, every command not acknowledged whose job is starting or
    recovering, whose backoff passed, and that was never sent or not for a while. The
    caller sends them after the commit (no network call inside a transaction)."""
    c = models.NodeCommand
    now = func.now()
    due_jobs = (
        select(models.Job.id)
        .where(models.Job.state.in_(IN_FLIGHT))
        .where(or_(models.Job.commands_after.is_(None), models.Job.commands_after <= now))
    )
    if job_ids is not None:
        due_jobs = due_jobs.where(models.Job.id.in_(sorted(job_ids)))
    rows = await session.execute(
        update(c)
        .where(
            _locked(
                c.job_id.in_(due_jobs),
                c.acked_generation < c.generation,
                or_(c.sent_at.is_(None), c.sent_at < now - dt.timedelta(seconds=RESEND_SECONDS)),
            )
        )
        .values(sent_at=now, sends=c.sends + 1)
        .returning(c.job_id, c.node_id, c.generation, c.action, c.sends)
    )
    return [
        DueCommand(job_id, node_id, int(generation), NodeAction(action), int(sends))
        for job_id, node_id, generation, action, sends in rows.all()
    ]


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
    await session.execute(
        update(c)
        .where(
            _locked(
                c.job_id == job_id,
                c.node_id.in_(node_ids),
                c.generation <= generation,
                c.action.in_([a.value for a in actions]),
            )
        )
        .values(acked_generation=func.greatest(c.acked_generation, generation))
    )
