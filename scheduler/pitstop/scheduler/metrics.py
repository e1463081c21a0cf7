"""Scheduler metrics on /metrics (prometheus-client, a registry of its own).

Gauges of jobs and nodes by state are refreshed by every process from PostgreSQL on the
health tick; the leader adds its decisions (recoveries, decision latency) and the per-job
series (`job`: see jobmetrics.py), and whichever process holds a node's stream observes
its heartbeat lag.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import TERMINAL_JOB_STATES, JobState, NodeState
from pitstop.scheduler.jobmetrics import JobMetrics

LOOP_LAG_INTERVAL = 0.05
LOOP_LAG_WINDOW = 60.0


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge(
            "pitstop_scheduler_jobs", "Jobs by state.", ["state"], registry=self.registry
        )
        self.nodes = Gauge(
            "pitstop_scheduler_nodes",
            "Nodes by state and role.",
            ["state", "role"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "pitstop_scheduler_leader",
            "1 while this process holds the leader lease.",
            registry=self.registry,
        )
        self.recoveries = Counter(
            "pitstop_scheduler_recoveries_total",
            "Recoveries decided, by cause (node, rank_exit).",
            ["cause"],
            registry=self.registry,
        )
        self.jobs_held = Gauge(
            "pitstop_scheduler_jobs_held",
            "Jobs held through a mass loss (many nodes silent at once: a partition or the "
            "scheduler's own overload): nothing of them is replaced until their nodes are "
            "back or the replace deadline passes.",
            registry=self.registry,
        )
        self.mass_losses = Counter(
            "pitstop_scheduler_mass_losses_total",
            "Holds begun: a job touched by a mass loss.",
            registry=self.registry,
        )
        self.held_replacements = Counter(
            "pitstop_scheduler_held_replacements_total",
            "Nodes of held jobs replaced because they stayed away past the replace deadline.",
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "pitstop_scheduler_decision_seconds",
            "Time to decide and commit one placement or recovery.",
            ["decision"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.heartbeat_lag_seconds = Histogram(
            "pitstop_scheduler_heartbeat_lag_seconds",
            "Delay from an agent sending a heartbeat to the scheduler recording it.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
            registry=self.registry,
        )
        self.tick_seconds = Histogram(
            "pitstop_scheduler_reconcile_tick_seconds",
            "Time the leader takes for one pass of a reconcile loop (decide, follow).",
            ["loop"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=self.registry,
        )
        self.command_resends = Counter(
            "pitstop_scheduler_command_resends_total",
            "Node commands sent again because no acknowledgement came, by action.",
            ["action"],
            registry=self.registry,
        )
        self.loop_lag_seconds = Histogram(
            "pitstop_scheduler_event_loop_lag_seconds",
            "How late the event loop runs a callback due now (sampled every 50 ms).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.loop_lag_quantile = Gauge(
            "pitstop_scheduler_event_loop_lag_quantile_seconds",
            "Event-loop lag over the last minute, by quantile q (0.5, 0.99).",
            ["q"],  # not `quantile`: that label belongs to summaries (promtool check metrics)
            registry=self.registry,
        )
        self.telemetry_shed = Counter(
            "pitstop_scheduler_telemetry_shed_total",
            "Agent telemetry a process holding streams dropped while its event loop lagged "
            "(step summaries, unchanged heartbeats, stale-process checks), by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.job = JobMetrics(self.registry)
        self.lag_listeners: list[Callable[[float, float], None]] = []
        """Called with (now, lag) on every loop-lag sample (the load shedder)."""
        self._lags: collections.deque[tuple[float, float]] = collections.deque()
        for quantile in (0.5, 0.99):
            self.loop_lag_quantile.labels(str(quantile)).set_function(
                functools.partial(self._lag_quantile, quantile)
            )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    async def watch_loop_lag(self, interval: float = LOOP_LAG_INTERVAL) -> None:
        """Sample the event loop's lag for as long as it runs: sleep `interval` and see
        how much later than that the loop woke up."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            self.observe_loop_lag(now, max(now - before - interval, 0.0))

    def observe_loop_lag(self, now: float, lag: float) -> None:
        self.loop_lag_seconds.observe(lag)
        for listener in self.lag_listeners:
            listener(now, lag)
        self._lags.append((now, lag))
        while self._lags and self._lags[0][0] < now - LOOP_LAG_WINDOW:
            self._lags.popleft()

    def _lag_quantile(self, quantile: float) -> float:
        """The window's lag at `quantile`: sorted when scraped, not on every sample (the
        sampler runs 20 times a second on the loop it measures)."""
        ordered = sorted(lag for _, lag in list(self._lags))
        if not ordered:
            return 0.0
        return ordered[min(int(quantile * len(ordered)), len(ordered) - 1)]

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics; returns the bound port (port 0 picks a free one)."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    async def refresh(self, session: AsyncSession) -> None:
        """Recount jobs and nodes by state (two grouped queries)."""
        jobs = dict(
            (
                await session.execute(
                    select(models.Job.state, func.count()).group_by(models.Job.state)
                )
            ).all()
        )
        for job_state in JobState:
            self.jobs.labels(job_state.value).set(jobs.get(job_state, 0))
        held = await session.scalar(
            select(func.count())
            .select_from(models.Job)
            .where(models.Job.held_since.is_not(None))
            .where(models.Job.state.not_in(TERMINAL_JOB_STATES))
        )
        self.jobs_held.set(held or 0)
        counted: dict[tuple[str, str], int] = {
            (state.value, role.value): int(count)
            for state, role, count in (
                await session.execute(
                    select(models.Node.state, models.Node.role, func.count()).group_by(
                        models.Node.state, models.Node.role
                    )
                )
            ).all()
        }
        for node_state in NodeState:
            for role in ("worker", "spare"):
                self.nodes.labels(node_state.value, role).set(
                    counted.get((node_state.value, role), 0)
                )
