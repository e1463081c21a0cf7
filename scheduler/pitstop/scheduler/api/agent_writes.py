"""What agent streams write to PostgreSQL, kept off the stream's own path.

A stream reads its messages one at a time, so anything its reader awaits holds up the
node's next heartbeat. Command acknowledgements came back from every node of a job at
once after each decision (12,500 of them for the 99,968-rank job), one transaction each
through a pool of ten connections, and heartbeats queued behind them until healthy nodes
passed their liveness deadline (bench/scale.py: 250 nodes). Here they are written
together, one transaction per write, one write in flight; the reader does not wait.
A write that fails loses nothing a decision needs: the leader re-sends every command
not acknowledged and the agent acknowledges a repeat again.

Likewise the check for processes of ended or superseded jobs (`stale_processes`) asks
PostgreSQL only when a node reports a job or a generation this process has not seen
current within the last second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from sqlalchemy import select

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services import node_commands as node_command_service
from pitstop.scheduler.services.jobs import LEFT_BEHIND_IN
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2

log = logging.getLogger(__name__)

GENERATIONS_FRESH_SECONDS = 1.0
"""How long a job's state and generation, as read, answer the stale-process check."""


class AckWriter:
    """Acknowledgements of every stream of this process, written in batches."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pending: dict[node_command_service.AckKey, set[str]] = {}
        self._writer: asyncio.Task[None] | None = None

    def add(
        self,
        job_id: str,
        node_id: str,
        generation: int,
        actions: tuple[node_command_service.NodeAction, ...],
    ) -> None:
        """Record that the node's agent carried out the job's command; returns at once."""
        self._pending.setdefault((job_id, generation, actions), set()).add(node_id)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="ack-writer")

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, {}
            try:
                async with self.store.write() as session:
                    await node_command_service.acknowledge_batch(session, batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                # The leader re-sends what is not acknowledged; the agents ack again.
                log.warning("could not record %d acknowledgements", len(batch), exc_info=True)

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer


class StepWriter:
    """Step summaries of every stream of this process, written to Redis per job: one
    write in flight, and what arrives meanwhile goes in the next, one entry per job
    (hotstate.record_step_summaries). Idle, a summary is written at once; under load,
    the nodes' summaries of a job merge into one entry a write, so what the leader reads
    grows with the writes of the processes holding streams, not with the nodes."""

    def __init__(self, hot: HotState) -> None:
        self.hot = hot
        self._pending: dict[str, list[agent_pb2.StepSummary]] = {}
        self._writer: asyncio.Task[None] | None = None
        self._queued = 0  # summaries queued so far
        self._written = 0  # of which those whose write has ended
        self._progress = asyncio.Event()

    def add(self, summary: agent_pb2.StepSummary) -> None:
        """Queue the summary (its node_id set); returns at once."""
        if not summary.job_id:
            return
        self._pending.setdefault(summary.job_id, []).append(summary)
        self._queued += 1
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write(), name="step-writer")

    async def settle(self) -> None:
        """Wait until the summaries queued so far are written (or failed to be): a
        rank's exit or finding is handled after the last steps its agent sent before it,
        as the agent sent them."""
        target = self._queued
        while self._written < target and self._writer is not None and not self._writer.done():
            progress = self._progress
            await progress.wait()

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, {}
            taken = self._queued
            try:
                await self.hot.record_step_summaries(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Telemetry: the next summaries of each node say as much again.
                count = sum(len(s) for s in batch.values())
                log.warning("could not record %d step summaries", count, exc_info=True)
            finally:
                self._written = taken
                self._progress.set()
                self._progress = asyncio.Event()

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer


class JobGenerations:
    """Each job's state and generation as last read, for the stale-process check."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._known: dict[str, tuple[JobState, int, float]] = {}
        self._reading: asyncio.Lock = asyncio.Lock()

    async def nothing_to_stop(self, running: Sequence[tuple[str, int, int, bool]]) -> bool:
        """True when none of the processes reported can be one to stop, without asking
        PostgreSQL again within a second: each runs a live job's current generation, is
        a standby, or belongs to a job still starting or recovering (its ranks are about
        to reconfigure or leave; `stale_processes` keeps them too). Only what is left,
        a job that ended or a running one with ranks of an older generation, needs the
        full check: every node of a recovering job reports the old generation until its
        command arrives, and 2,500 of those checks at once starved the ingest processes."""
        ids = {job_id for job_id, *_ in running}
        now = time.monotonic()
        if any(
            job_id not in self._known or self._known[job_id][2] < now - GENERATIONS_FRESH_SECONDS
            for job_id in ids
        ):
            async with self._reading:  # one read for every stream asking at once
                stale = [
                    j
                    for j in ids
                    if j not in self._known
                    or self._known[j][2] < time.monotonic() - GENERATIONS_FRESH_SECONDS
                ]
                if stale:
                    await self._read(stale)
        for job_id, generation, _rank, standby in running:
            known = self._known.get(job_id)
            if known is None:
                continue  # unknown to the database: the full check ignores it too
            state, current, _ = known
            if (
                state.terminal
                or state is JobState.PENDING
                or (state in LEFT_BEHIND_IN and not standby and generation < current)
            ):
                return False
        return True

    async def _read(self, job_ids: list[str]) -> None:
        async with self.store.read() as session:
            rows = await session.execute(
                select(models.Job.id, models.Job.state, models.Job.generation).where(
                    models.Job.id.in_(sorted(job_ids))
                )
            )
            at = time.monotonic()
            for job_id, state, generation in rows.all():
                self._known[job_id] = (state, int(generation), at)
