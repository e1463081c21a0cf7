"""What the dashboard shows, as plain JSON-ready dicts: the fleet, one node, the jobs,
one job (with its recovery timeline), and a job's recent steps.

Read-only: every function reads PostgreSQL through the store's read sessions, or Redis,
and builds what the page draws. Nothing here decides or writes.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from sqlalchemy import select

from pitstop.scheduler.convert import (
    event_to_pb,
    job_in_full_to_pb,
    node_in_full_to_pb,
    node_to_pb,
)
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import TERMINAL_JOB_STATES, NodeRole, NodeState
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services import events as event_service
from pitstop.scheduler.services import jobs as job_service
from pitstop.scheduler.services import nodes as node_service
from pitstop.scheduler.services import records as record_service
from pitstop.scheduler.services.views import job_in_full, node_in_full
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2, common_pb2

RECENT_EVENTS = 300
JOBS_SHOWN = 50
HEATMAP_WINDOWS = 40
"""Straggler windows the per-rank step-time heatmap covers."""
LOSS_POINTS = 2000
"""Steps the loss curve keeps (the newest)."""
RATE_SECONDS = 60.0
"""The step and token rates are over the last this many seconds of summaries."""
FIRST_READ_SUMMARIES = 4000
"""Step summaries read when a page first asks for a job: a recent stretch on a large job
(one summary per node per flush), bounded for a huge one."""
FIRST_READ_WINDOWS = 20_000
"""Window entries read then: the heatmap's 40 windows of a 500-node job, 8 of a
2,500-node one (one entry per node per window, about 250 bytes for 8 ranks)."""

_VERDICTS: dict[int, str] = {
    common_pb2.HEALTH_VERDICT_UNSPECIFIED: "unknown",
    common_pb2.HEALTH_VERDICT_HEALTHY: "healthy",
    common_pb2.HEALTH_VERDICT_APPLICATION: "application",
    common_pb2.HEALTH_VERDICT_WARNING: "warning",
    common_pb2.HEALTH_VERDICT_FATAL: "fatal",
    common_pb2.HEALTH_VERDICT_DEGRADED: "degraded",
}


def _verdict(value: int) -> str:
    return _VERDICTS.get(int(value), "unknown")


def _word(name: str, prefix: str) -> str:
    """An enum value's proto name as the domain's word: NODE_STATE_READY -> ready."""
    return name.removeprefix(prefix).lower()


def node_status(state: NodeState, role: NodeRole) -> str:
    """The colour a node gets: its state, or `spare` for a ready spare."""
    if state is NodeState.READY and role is NodeRole.SPARE:
        return "spare"
    return state.value


def _node_row(node: models.Node, jobs: Sequence[str]) -> dict[str, Any]:
    message = node_to_pb(node)
    return {
        "id": node.id,
        "status": node_status(node.state, node.role),
        "state": node.state.value,
        "role": node.role.value,
        "reason": node.reason,
        "zone": node.zone,
        "block": node.block,
        "rack": node.rack,
        "connected": node.connected,
        "verdict": _verdict(message.health.verdict),
        "gpus": [[g.index, _verdict(g.verdict)] for g in message.health.gpus],
        "jobs": list(jobs),
    }


async def _jobs_by_node(store: Store) -> dict[str, list[str]]:
    """The unfinished jobs whose current generation places a rank on each node."""
    query = (
        select(models.RankAssignment.node_id, models.Job.id)
        .join(
            models.Job,
            (models.RankAssignment.job_id == models.Job.id) & models.RankAssignment.current(),
        )
        .where(models.Job.state.not_in(TERMINAL_JOB_STATES))
        .distinct()
    )
    found: dict[str, list[str]] = {}
    async with store.read() as session:
        for node_id, job_id in (await session.execute(query)).all():
            found.setdefault(node_id, []).append(job_id)
    return found


async def fleet(store: Store, node_ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Every node (or the ones named), with the jobs on it; ordered by zone, block, rack
    and id, the order the page groups them in."""
    jobs = await _jobs_by_node(store)
    async with store.read() as session:
        nodes = await node_service.list_nodes(session, states=(), roles=())
    wanted = None if node_ids is None else set(node_ids)
    rows = [_node_row(n, jobs.get(n.id, ())) for n in nodes if wanted is None or n.id in wanted]
    rows.sort(key=lambda r: (r["zone"], r["block"], r["rack"], r["id"]))
    return rows


async def node_detail(store: Store, hot: HotState, node_id: str) -> dict[str, Any]:
    """One node as `pitstop node show` has it: health per GPU, Xid history, jobs."""
    message = node_in_full_to_pb(await node_in_full(store, hot, node_id))
    detail = json_format.MessageToDict(message, preserving_proto_field_name=True)
    detail["status"] = node_status(
        NodeState(_word(common_pb2.NodeState.Name(message.state), "NODE_STATE_")),
        NodeRole(_word(common_pb2.NodeRole.Name(message.role), "NODE_ROLE_")),
    )
    return detail


async def job_list(store: Store) -> list[dict[str, Any]]:
    """The newest jobs, newest first; a pending one with its place in the queue and why
    it waits."""
    async with store.read() as session:
        jobs, _ = await job_service.list_jobs(
            session, states=(), page_size=JOBS_SHOWN, page_token=""
        )
        queue = await job_service.queue_positions(session)
    return [
        {
            "id": j.id,
            "name": j.name,
            "state": j.state.value,
            "step": j.current_step,
            "project": j.project,
            "priority": j.priority,
            "queue_position": queue.get(j.id, 0),
            "reason": j.reason if j.id in queue else "",
        }
        for j in jobs
    ]


async def job_record(store: Store, job_id: str) -> dict[str, Any]:
    """The job's experiment record (`pitstop job record --json`)."""
    async with store.read() as session:
        record = await record_service.job_record(session, job_id)
    return json_format.MessageToDict(record, preserving_proto_field_name=True)


def incident_rows(goodput: dict[str, Any]) -> list[dict[str, Any]]:
    """The recovery timeline: one bar per incident, split into its phases (seconds)."""
    rows = []
    for incident in goodput.get("incidents", []):
        rows.append(
            {
                "cause": incident.get("cause", ""),
                "kind": incident.get("kind", "INCIDENT_KIND_UNSPECIFIED")
                .removeprefix("INCIDENT_KIND_")
                .lower(),
                "outcome": incident.get("outcome", "INCIDENT_OUTCOME_UNSPECIFIED")
                .removeprefix("INCIDENT_OUTCOME_")
                .lower(),
                "failed_at": incident.get("failed_at", 0.0),
                "detect": incident.get("detect_seconds", 0.0),
                "decide": incident.get("decide_seconds", 0.0),
                "resume": incident.get("resume_seconds", 0.0),
                "restore": incident.get("restore_seconds", 0.0),
                "reform": incident.get("reform_seconds", 0.0),
                "lost_steps": int(incident.get("lost_steps", 0)),
            }
        )
    return rows


async def job_detail(store: Store, hot: HotState, job_id: str) -> dict[str, Any]:
    """A job: state, generation, steps, goodput and its incidents, and where each rank
    runs (node, zone, block, rack, its dp/pp/tp coordinates, straggler or not)."""
    message = job_in_full_to_pb(await job_in_full(store, hot, job_id))
    ranks = sorted(message.rank_map.ranks, key=lambda r: r.rank)
    async with store.read() as session:
        query = select(models.Node).where(models.Node.id.in_({r.node_id for r in ranks}))
        nodes = {n.id: n for n in (await session.scalars(query)).all()}
    goodput = json_format.MessageToDict(
        message.goodput, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    stats = {s.rank: s for s in message.rank_stats}
    rank_rows = []
    for r in ranks:
        node = nodes.get(r.node_id)
        stat = stats.get(r.rank)
        rank_rows.append(
            [
                r.rank,
                r.node_id,
                node.zone if node else "",
                node.block if node else "",
                node.rack if node else "",
                r.dp,
                r.pp,
                r.tp,
                bool(stat and stat.straggler),
                round(stat.p50_seconds, 4) if stat else 0.0,
            ]
        )
    spec = message.spec
    return {
        "id": message.id,
        "name": spec.name,
        "state": _word(common_pb2.JobState.Name(message.state), "JOB_STATE_"),
        "reason": message.reason,
        "generation": message.generation,
        "restarts": message.restarts,
        "current_step": message.current_step,
        "committed_step": message.committed_step,
        "durable_step": message.durable_step,
        "total_steps": int(getattr(spec, "total_steps", 0) or 0),
        "goodput": {
            "ratio": goodput.get("ratio", 0.0),
            "productive_seconds": goodput.get("productive_seconds", 0.0),
            "detect_seconds": goodput.get("detect_seconds", 0.0),
            "recovery_seconds": goodput.get("recovery_seconds", 0.0),
            "recompute_seconds": goodput.get("recompute_seconds", 0.0),
            "recoveries": goodput.get("recoveries", 0),
            "incident_count": goodput.get("incident_count", 0),
        },
        "incidents": incident_rows(goodput),
        # [rank, node, zone, block, rack, dp, pp, tp, straggler, p50 seconds]
        "ranks": rank_rows,
        "result": dict(message.result),
        "project": spec.project or "default",
        "priority": spec.priority,
        "preemptible": spec.preemptible,
        "preemptions": message.preemptions,
        "queue_position": message.queue_position,
    }


def event_row(event: models.Event) -> dict[str, Any]:
    message = event_to_pb(event)
    return {
        "id": message.id,
        "time": message.time.ToMilliseconds() / 1000.0,
        "kind": message.kind,
        "job": message.job_id,
        "node": message.node_id,
        "from": message.from_state,
        "to": message.to_state,
        "reason": message.reason,
        "actor": message.actor,
    }


async def recent_events(store: Store, limit: int = RECENT_EVENTS) -> list[dict[str, Any]]:
    async with store.read() as session:
        rows = await event_service.list_events(session, after_id=-1, limit=limit)
    return [event_row(r) for r in rows]


async def events_after(store: Store, after_id: int) -> list[dict[str, Any]]:
    async with store.read() as session:
        rows = await event_service.list_events(session, after_id=after_id, limit=500)
    return [event_row(r) for r in rows]


@dataclass
class StepFeed:
    """A job's recent steps for one page: what is new since it last asked. Keeps the
    heatmap's windows (each rank's median step time in each straggler window) and the
    loss curve, reads only the node summaries it has not seen."""

    job_id: str
    cursor: str = ""
    windows_cursor: str = ""
    windows: dict[int, dict[int, float]] = field(default_factory=dict)
    """First step of a window -> rank -> its median step time."""
    span: int = 0
    """Steps a window covers."""
    losses: dict[int, list[float]] = field(default_factory=dict)
    """Step -> the nodes' mean losses at it."""
    progress: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(ended, newest step, tokens) of the summaries of the last RATE_SECONDS."""
    started: bool = False

    async def read(self, hot: HotState) -> list[agent_pb2.StepSummary]:
        """The summaries not read yet: of the steps stream (progress, loss, tokens) and
        of the window stream (the windows: one summary in about a window's steps has
        any, so the first read reaches much further back there)."""
        summaries, self.cursor = await hot.step_summaries_after(
            self.job_id, self.cursor, FIRST_READ_SUMMARIES
        )
        for summary in summaries:
            del summary.windows[:]
        windows, self.windows_cursor = await hot.step_summaries_after(
            self.job_id, self.windows_cursor, FIRST_READ_WINDOWS, windows=True
        )
        return summaries + windows

    def add(self, summaries: Iterable[agent_pb2.StepSummary]) -> tuple[set[int], set[int]]:
        """Fold summaries in; returns the windows (first steps) and the loss steps they
        touched that are still kept."""
        windows: set[int] = set()
        losses: set[int] = set()
        for summary in summaries:
            for window in summary.windows:
                self.windows.setdefault(window.first_step, {})[window.rank] = window.median_seconds
                self.span = max(self.span, window.steps)
                windows.add(window.first_step)
            if summary.loss_step and summary.loss == summary.loss:  # not NaN
                self.losses.setdefault(summary.loss_step, []).append(summary.loss)
                losses.add(summary.loss_step)
            if summary.HasField("time"):
                ended = summary.time.ToMilliseconds() / 1000.0
                self.progress.append((ended, summary.newest_step, summary.tokens))
        for first in sorted(self.windows)[:-HEATMAP_WINDOWS]:
            del self.windows[first]
            windows.discard(first)
        for number in sorted(self.losses)[:-LOSS_POINTS]:
            del self.losses[number]
            losses.discard(number)
        if self.progress:
            newest = max(ended for ended, _, _ in self.progress)
            while self.progress and self.progress[0][0] < newest - RATE_SECONDS:
                self.progress.popleft()
        return windows, losses

    async def update(self, hot: HotState, world_size: int) -> dict[str, Any] | None:
        """What changed since the last update: heatmap columns of the windows that got
        summaries, the loss of the steps that did, the rates. The first update has every
        window and the loss curve; None when nothing is new."""
        first, self.started = not self.started, True
        summaries = await self.read(hot)
        windows, losses = self.add(summaries)
        if not summaries and not first:
            return None
        shown = sorted(self.windows) if first else sorted(windows)
        columns = [
            {
                "step": number,
                "times": [
                    None if (t := self.windows[number].get(rank)) is None else round(t, 4)
                    for rank in range(world_size)
                ],
            }
            for number in shown
        ]
        loss_steps = sorted(self.losses) if first else sorted(losses)
        return {
            "job": self.job_id,
            "reset": first,
            "window": HEATMAP_WINDOWS,
            "span": self.span,
            "columns": columns,
            "loss": [[n, round(statistics.fmean(self.losses[n]), 6)] for n in loss_steps],
            **_rates(self.progress),
        }


def _rates(progress: deque[tuple[float, int, int]]) -> dict[str, float]:
    """Step rate and tokens per second over the summaries kept."""
    if len(progress) < 2:
        return {"steps_per_second": 0.0, "tokens_per_second": 0.0}
    ordered = sorted(progress)
    (start, first_step, _), (end, last_step, _) = ordered[0], ordered[-1]
    span = end - start
    if span <= 0:
        return {"steps_per_second": 0.0, "tokens_per_second": 0.0}
    tokens = sum(tokens for _, _, tokens in ordered[1:])
    return {
        "steps_per_second": round(max(0, last_step - first_step) / span, 3),
        "tokens_per_second": round(tokens / span, 1),
    }
