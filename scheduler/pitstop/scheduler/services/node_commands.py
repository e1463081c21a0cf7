"""Desired state per node of a job (``node_commands``): written by the decision that
makes a generation, acknowledged by the node's agent, re-sent by whichever process
leads until acknowledged. Level-triggered, in the sense of DESIGN.md "Recovery"."""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import and_, delete, func, or_, select, update
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
    """The job's commands for its current generation, replacing the previous ones."""
    await session.execute(delete(models.NodeCommand).where(models.NodeCommand.job_id == job.id))
    session.add_all(
        models.NodeCommand(
            job_id=job.id, node_id=node_id, generation=job.generation, action=action.value
        )
        for node_id, action in sorted(actions.items())
    )


async def plan(session: AsyncSession, job_id: str) -> dict[str, models.NodeCommand]:
    """The job's current commands by node."""
    rows = await session.scalars(
        select(models.NodeCommand).where(models.NodeCommand.job_id == job_id)
    )
    return {row.node_id: row for row in rows}


async def restart_node(session: AsyncSession, job_id: str, node_id: str) -> bool:
    """Make a node that was to reconfigure start its ranks afresh instead (a rank of it
    died before joining); True if its command changed."""
    result = await session.execute(
        update(models.NodeCommand)
        .where(models.NodeCommand.job_id == job_id)
        .where(models.NodeCommand.node_id == node_id)
        .where(models.NodeCommand.action.in_((NodeAction.RECONFIGURE, NodeAction.ADOPT)))
        .values(action=NodeAction.START.value, acked_generation=0, sent_at=None)
    )
    return bool(getattr(result, "rowcount", 0))


async def claim_due(session: AsyncSession, job_ids: set[str] | None = None) -> list[DueCommand]:
    """Mark as sent, and return, every command not acknowledged whose job is starting or
    recovering, whose backoff passed, and that was never sent or not for a while. The
    caller sends them after the commit (no network call inside a transaction)."""
    now = func.now()
    due_jobs = (
        select(models.Job.id)
        .where(models.Job.state.in_(IN_FLIGHT))
        .where(or_(models.Job.commands_after.is_(None), models.Job.commands_after <= now))
    )
    if job_ids is not None:
        due_jobs = due_jobs.where(models.Job.id.in_(sorted(job_ids)))
    rows = await session.execute(
        update(models.NodeCommand)
        .where(models.NodeCommand.job_id.in_(due_jobs))
        .where(models.NodeCommand.acked_generation < models.NodeCommand.generation)
        .where(
            or_(
                models.NodeCommand.sent_at.is_(None),
                models.NodeCommand.sent_at < now - dt.timedelta(seconds=RESEND_SECONDS),
            )
        )
        .values(sent_at=now, sends=models.NodeCommand.sends + 1)
        .returning(
            models.NodeCommand.job_id,
            models.NodeCommand.node_id,
            models.NodeCommand.generation,
            models.NodeCommand.action,
            models.NodeCommand.sends,
        )
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


async def acknowledge(
    session: AsyncSession,
    job_id: str,
    node_id: str,
    generation: int,
    actions: tuple[NodeAction, ...],
) -> None:
    """The node's agent carried out the job's command for `generation`; an ack of an
    action the node no longer has (it was changed meanwhile) acknowledges nothing."""
    await session.execute(
        update(models.NodeCommand)
        .where(and_(models.NodeCommand.job_id == job_id, models.NodeCommand.node_id == node_id))
        .where(models.NodeCommand.generation <= generation)
        .where(models.NodeCommand.action.in_([a.value for a in actions]))
        .values(acked_generation=func.greatest(models.NodeCommand.acked_generation, generation))
    )


async def acknowledge_nodes(
    session: AsyncSession,
    job_id: str,
    node_ids: list[str],
    generation: int,
    actions: tuple[NodeAction, ...],
) -> None:
    """`acknowledge` for many nodes of one job, generation and actions: one statement."""
    await session.execute(
        update(models.NodeCommand)
        .where(and_(models.NodeCommand.job_id == job_id, models.NodeCommand.node_id.in_(node_ids)))
        .where(models.NodeCommand.generation <= generation)
        .where(models.NodeCommand.action.in_([a.value for a in actions]))
        .values(acked_generation=func.greatest(models.NodeCommand.acked_generation, generation))
    )
