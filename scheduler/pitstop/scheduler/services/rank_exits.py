"""A rank's exit as its agent reported it: one `rank.exited` event per (job, generation,
rank). The exit follower (reconcile/exits.py) decides from these events: a job whose
ranks all exited 0 succeeds, a failed rank restarts."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.services.events import record_event
from pitstop.v1 import agent_pb2


def record_exit(
    session: AsyncSession, node_id: str, exited: agent_pb2.RankExited, actor: str = ""
) -> None:
    """The exit's event, with its code or signal and the result the rank reported; its
    actor the node's agent unless said (the scheduler, for an exit it concluded)."""
    how = f"signal {exited.signal}" if exited.signal else f"exit code {exited.exit_code}"
    cause = exited.cause.replace("\x00", "")[:500]
    record_event(
        session,
        "rank.exited",
        actor=actor or f"agent:{node_id}",
        job_id=exited.job_id or None,
        node_id=node_id,
        reason=f"rank {exited.rank} ended with {how}" + (f": {cause}" if cause else ""),
        attributes={
            "rank": str(exited.rank),
            "generation": str(exited.generation),
            "exit_code": str(exited.exit_code),
            "signal": str(exited.signal),
            **({"cause": cause} if cause else {}),
            **{f"result.{k}": v[:1000] for k, v in list(exited.result.items())[:32]},
        },
    )


async def record_exits(
    session: AsyncSession, node_id: str, exits: Sequence[agent_pb2.RankExited]
) -> int:
    """Record each exit not recorded yet; how many were. An agent sends an exit once
    when it happens and again with each Register of the next minutes (a report sent on
    a stream that broke before it was recorded would be lost): an exit of a (job,
    generation, rank) that has one already is the same exit. An exit of no job (a
    standby's) is recorded as it comes."""
    attrs = models.Event.attributes
    recorded = 0
    for exited in exits:
        if exited.job_id:
            known = await session.scalar(
                select(models.Event.id)
                .where(models.Event.job_id == exited.job_id)
                .where(models.Event.kind == "rank.exited")
                .where(attrs["generation"].astext == str(exited.generation))
                .where(attrs["rank"].astext == str(exited.rank))
                .limit(1)
            )
            if known is not None:
                continue
        record_exit(session, node_id, exited)
        recorded += 1
    return recorded
