"""The job's goodput account, kept on its row (``jobs.goodput``), recomputed from its
events (see pitstop.health.goodput: every recovery, restart and fallback an incident of
its own, with its outcome), and the failure data a recovery's decision event carries.

The stored account is as fresh as its last :func:`refresh`: call it in the transaction
of every decision and of every end of the job, so that an incident under way, and one
the job's failure or cancellation ended, is on the row when someone looks."""

from __future__ import annotations

import time

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.health.goodput import Goodput, JobEvent, account, epoch, incident_attributes
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import NodeState
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services.health import LAST_SEEN_AT

NODE_FAILURE_KINDS = ("node.lost", "node.unhealthy")
SWAP_KINDS = ("node.draining", "job.straggler")
"""Events that say why a live node's ranks were moved off it."""


async def refresh(session: AsyncSession, job: models.Job, *, step_seconds: float) -> Goodput:
    """Recompute the job's account from its events and store it on the row; returns it."""
    rows = (
        await session.execute(
            select(
                models.Event.time,
                models.Event.kind,
                models.Event.from_state,
                models.Event.to_state,
                models.Event.attributes,
                models.Event.reason,
            )
            .where(models.Event.job_id == job.id)
            .where(models.Event.kind.like("job.%"))
            .order_by(models.Event.id)
        )
    ).all()
    events = [
        JobEvent(
            epoch(t),
            kind,
            src,
            dst,
            {k: str(v) for k, v in (attrs or {}).items()},
            reason,
        )
        for t, kind, src, dst, attrs, reason in rows
    ]
    result = account(events, now=time.time(), step_seconds=step_seconds)
    job.goodput = result.to_json()
    return result


async def node_incident(
    session: AsyncSession,
    hot: HotState,
    job: models.Job,
    failed: dict[str, NodeState | None],
    restore_step: int,
) -> dict[str, str]:
    """The incident for a recovery that moves ranks off ``failed`` nodes: when the first
    of them failed (a lost node's last sign of life: what its stream last carried, as
    its node.lost event keeps it, else its last heartbeat; an unhealthy node's fatal
    report) and when the scheduler noticed (its state change)."""
    now = time.time()
    failed_at, detected_at, causes = now, now, []
    for node_id, state in failed.items():
        if state not in (NodeState.LOST, NodeState.UNHEALTHY):
            # Drained (an early warning: its reason names the signal) or swapped out (a
            # straggler: its event names the slowdown, and its host's cause if known).
            why = await session.scalar(
                select(models.Event.reason)
                .where(models.Event.node_id == node_id)
                .where(models.Event.kind.in_(SWAP_KINDS))
                .where(or_(models.Event.job_id.is_(None), models.Event.job_id == job.id))
                .order_by(models.Event.id.desc())
                .limit(1)
            )
            causes.append(f"{node_id} swapped out" + (f" ({why[:300]})" if why else ""))
            continue
        noticed = (
            await session.execute(
                select(models.Event.time, models.Event.attributes, models.Event.reason)
                .where(models.Event.node_id == node_id)
                .where(models.Event.kind.in_(NODE_FAILURE_KINDS))
                .order_by(models.Event.id.desc())
                .limit(1)
            )
        ).first()
        seen = epoch(noticed.time) if noticed is not None else now
        began = seen
        heard = (noticed.attributes or {}).get(LAST_SEEN_AT) if noticed is not None else None
        if state is NodeState.LOST and heard is not None:
            began = min(seen, float(heard))
        elif state is NodeState.LOST:  # judged by the liveness scan: its holder is gone
            live = await hot.node_health(node_id)
            if live is not None:
                began = min(seen, float(live.get("received_at", seen)))
        failed_at, detected_at = min(failed_at, began), min(detected_at, seen)
        why = noticed.reason if noticed is not None else ""
        causes.append(f"{node_id} {state.value}" + (f" ({why[:300]})" if why else ""))
    return incident_attributes(
        cause=", ".join(causes),
        failed_at=failed_at,
        detected_at=detected_at,
        lost_steps=job.current_step - restore_step,
    )


def rank_incident(job: models.Job, exited: models.Event) -> dict[str, str]:
    """The incident a failed rank opens: its exit is noticed as it happens."""
    at = epoch(exited.time)
    return incident_attributes(
        cause=exited.reason or "rank exited",
        failed_at=at,
        detected_at=at,
        lost_steps=job.current_step - job.committed_step,
    )
