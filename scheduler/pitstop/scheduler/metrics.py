"""Scheduler metrics on /metrics (prometheus-client, a registry of its own).

Gauges of jobs and nodes by state are refreshed by every process from PostgreSQL on the
health tick; the leader adds its decisions (recoveries, decision latency), and whichever
process holds a node's stream observes its heartbeat lag.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState, NodeState


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
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

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
