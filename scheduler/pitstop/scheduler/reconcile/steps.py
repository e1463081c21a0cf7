"""Following the jobs' steps: the step-time streams in Redis feed each job's straggler
detector, move a starting or recovering job to RUNNING once its generation steps, and
keep the goodput account fresh."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.health.straggler import (
    RankStats,
    StragglerDetector,
    StragglerFinding,
    StragglerPolicy,
)
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.reconcile.context import (
    RUNNABLE,
    Leader,
    failed_nodes,
    locked_job,
    set_deadline,
)
from pitstop.scheduler.services import catalog, goodput, lifecycle
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.topology import Placement
from pitstop.v1 import agent_pb2

GOODPUT_REFRESH_SECONDS = 1.0
STEP_HOLD_SECONDS = 5.0
"""Longest a step sample waits for the job's other ranks before the detector sees it."""
RANK_STATS_SECONDS = 2.0
"""Per-rank statistics are published (and the typical step time worked out) at most this
often, and at once when a straggler is flagged or cleared: every rank's window is sorted
for them, 100,000 ranks at full scale, which every follow pass (5 a second) did."""


class StepOrder:
    """Node batches arrive at different times, so one node's ranks can be reported far
    ahead of another's. The straggler detector judges a window once it sees later steps,
    so it gets the samples in step order: those at or below the step every one of the
    job's ranks has reached, and any held for `hold` seconds (a dead or silent rank must
    not hold the rest back for longer than it takes to notice it).

    Each sample is handled a bounded number of times (a heap by step, a queue by
    arrival, a lazy heap of the ranks' newest steps): the leader did a pass over every
    held sample and every rank per batch read, most of its CPU at 2,500 nodes."""

    def __init__(self) -> None:
        self.rank_max: dict[int, int] = {}
        """Each rank's newest step seen."""
        self._by_step: list[tuple[int, int, agent_pb2.StepSample]] = []
        self._by_arrival: deque[tuple[float, int, int]] = deque()  # (arrived, step, seq)
        self._held: set[int] = set()  # seqs not released yet
        self._lowest: list[tuple[int, int]] = []  # (step, rank), stale entries skipped
        self._seq = itertools.count()

    def release(
        self, fresh: list[agent_pb2.StepSample], world_size: int, now: float, hold: float
    ) -> list[agent_pb2.StepSample]:
        """The samples now due, in step order (arrival order within a step)."""
        for sample in fresh:
            if sample.step > self.rank_max.get(sample.rank, -1):
                self.rank_max[sample.rank] = sample.step
                heapq.heappush(self._lowest, (sample.step, sample.rank))
            seq = next(self._seq)
            heapq.heappush(self._by_step, (sample.step, seq, sample))
            self._by_arrival.append((now, sample.step, seq))
            self._held.add(seq)
        lowest = self._everyone()  # called always: it also drops the stale entries
        everyone = lowest if len(self.rank_max) >= world_size else 0
        overdue = 0
        arrivals = self._by_arrival
        # Oldest first: those released by step already leave; the overdue leave and
        # are released below (the frontier reaches their step).
        while arrivals and (arrivals[0][2] not in self._held or arrivals[0][0] + hold <= now):
            _, step, seq = arrivals.popleft()
            if seq in self._held:
                overdue = max(overdue, step)
        frontier = max(everyone, overdue)
        ready = []
        while self._by_step and self._by_step[0][0] <= frontier:
            _, seq, sample = heapq.heappop(self._by_step)
            ready.append(sample)
            self._held.discard(seq)
        return ready

    def _everyone(self) -> int:
        """The step every rank has reached."""
        lowest = self._lowest
        while lowest and self.rank_max.get(lowest[0][1]) != lowest[0][0]:
            heapq.heappop(lowest)  # that rank has stepped on since
        return lowest[0][0] if lowest else 0


@dataclass
class JobWatch:
    """What the leader remembers about one live job between ticks: telemetry only,
    rebuilt from the streams when lost. Decisions live in PostgreSQL."""

    stream_id: str = "0-0"
    detector: StragglerDetector | None = None
    detector_generation: int = 0
    # Samples held back until every rank has reached their step.
    order: StepOrder = field(default_factory=StepOrder)
    goodput_at: float = 0.0
    stats_at: float = 0.0
    placement: Placement | None = None
    placement_generation: int = 0
    typical_step_seconds: float = 0.0
    # Straggler findings whose events are not committed yet (the detector reports each
    # once: a transaction that fails must not lose one).
    findings: list[StragglerFinding] = field(default_factory=list)
    # This generation's ranks that said when they loaded the restore step (rank -> epoch
    # seconds, source), and whether job.restored has been recorded for it.
    restored: dict[int, tuple[float, str]] = field(default_factory=dict)
    restored_told: bool = False

    def step_seconds(self) -> float:
        """The job's typical step time: the median of its ranks' medians (0 if unknown),
        as of the last statistics published."""
        if self.detector is None:
            return 0.0
        if not self.typical_step_seconds:
            self.typical_step_seconds = typical(self.detector.stats())
        return self.typical_step_seconds


def typical(stats: list[RankStats]) -> float:
    """The median of the ranks' median step times (0 with none)."""
    medians = sorted(s.p50_seconds for s in stats)
    return medians[len(medians) // 2] if medians else 0.0


class StepFollower:
    def __init__(self, leader: Leader) -> None:
        self.leader = leader
        self.watches: dict[str, JobWatch] = {}
        # Nodes that straggler findings ask to swap out, by job, until the next repair.
        self.swaps: dict[str, set[str]] = {}
        # One reader of the streams at a time (the exits read them too, before a finish).
        self._reading = asyncio.Lock()

    def watch(self, job_id: str) -> JobWatch:
        return self.watches.setdefault(job_id, JobWatch())

    def forget(self, job_id: str) -> None:
        self.watches.pop(job_id, None)

    def step_seconds(self, job_id: str) -> float:
        """The job's typical step time as far as seen (0 if unknown)."""
        watch = self.watches.get(job_id)
        return watch.step_seconds() if watch is not None else 0.0

    def swap_requests(self) -> dict[str, set[str]]:
        """The nodes to swap out found since the last call."""
        swaps, self.swaps = self.swaps, {}
        return swaps

    async def follow(self) -> None:
        async with self._reading:
            await self._follow()

    async def _follow(self) -> None:
        async with self.leader.store.read() as session:
            jobs = {
                j.id: j for j in await lifecycle.live_jobs(session, (*RUNNABLE, JobState.PAUSED))
            }
            lagging = await catalog.lagging_commits(
                session, [j.id for j in jobs.values() if j.state is not JobState.RECOVERING]
            )
        if lagging:
            async with self.leader.store.write() as session:
                await catalog.catch_up_committed(session, lagging)
        for gone in [j for j in self.watches if j not in jobs]:
            del self.watches[gone]
        metrics = self.leader.metrics.job
        metrics.keep_only(jobs)
        for job in jobs.values():
            metrics.observe_job(
                job.id,
                name=job.name,
                state=job.state,
                generation=job.generation,
                step=job.current_step,
                goodput=job.goodput or {},
            )
        if not jobs:
            return
        cursors = {j: self.watch(j).stream_id for j in jobs}
        samples: dict[str, list[agent_pb2.StepSample]] = {}
        for job_id, entry_id, batch in await self.leader.hot.read_step_batches(cursors):
            self.watches[job_id].stream_id = entry_id
            if batch.generation == jobs[job_id].generation:
                samples.setdefault(job_id, []).extend(batch.samples)
        for job_id, fresh in samples.items():
            newest = max(s.step for s in fresh)
            await self._observe(jobs[job_id], self.watches[job_id], fresh, newest)

    async def _observe(
        self, job: models.Job, watch: JobWatch, samples: list[agent_pb2.StepSample], newest: int
    ) -> None:
        leader = self.leader
        spec = spec_from_json(job.spec)
        if watch.detector is None or watch.detector_generation != job.generation:
            watch.detector = StragglerDetector(StragglerPolicy.from_proto(spec.straggler))
            watch.detector_generation = job.generation
            watch.order, watch.findings = StepOrder(), []
            watch.restored, watch.restored_told = {}, False
        detector = watch.detector
        async with leader.store.write() as session:
            row = await locked_job(leader, session, job.id)
            if row is None or row.generation != job.generation:
                return
            # A generation's rank map never changes: read once, not every pass.
            if watch.placement is None or watch.placement_generation != row.generation:
                watch.placement = await self.leader.rank_maps.of(session, row)
                watch.placement_generation = row.generation
            placement = watch.placement
            released = watch.order.release(
                samples, placement.world_size, leader.clock(), STEP_HOLD_SECONDS
            )
            watch.findings += detector.observe(released)
            findings = list(watch.findings)
            row.current_step = max(row.current_step, newest)
            changed = False
            # A job waiting for capacity keeps its generation: the survivors' last steps
            # of it are no sign that it recovered.
            waiting = row.state is JobState.RECOVERING and bool(
                await failed_nodes(session, placement)
            )
            if row.state in (JobState.STARTING, JobState.RECOVERING) and not waiting:
                kind = "job.running" if row.state is JobState.STARTING else "job.recovered"
                lifecycle.transition(
                    session,
                    row,
                    JobState.RUNNING,
                    kind=kind,
                    reason=f"ranks are stepping (step {newest})",
                )
                set_deadline(row, None)
                changed = True
            if _record_restored(session, row, watch, samples, placement.world_size):
                changed = True
            account = None
            if changed or leader.clock() >= watch.goodput_at:
                await session.flush()  # the transition's event counts
                account = await goodput.refresh(session, row, step_seconds=watch.step_seconds())
                watch.goodput_at = leader.clock() + GOODPUT_REFRESH_SECONDS
            for finding in findings:
                record_event(
                    session,
                    "job.straggler" if finding.straggler else "job.straggler_cleared",
                    actor="scheduler",
                    job_id=job.id,
                    reason=finding.reason,
                    attributes={"rank": str(finding.rank), "slowdown": f"{finding.slowdown:.3f}"},
                )
        watch.findings = []  # committed
        metrics = leader.metrics.job
        metrics.observe_steps(job.id, job.generation, samples, released)
        if account is not None:
            metrics.observe_account(job.id, account)
        if leader.clock() < watch.stats_at and not findings:
            return
        watch.stats_at = leader.clock() + RANK_STATS_SECONDS
        computed = detector.stats()
        watch.typical_step_seconds = typical(computed)
        stats = [
            s.to_proto(placement.ranks[s.rank].node_id if s.rank < placement.world_size else "")
            for s in computed
        ]
        metrics.observe_ranks(
            job.id,
            step_seconds=watch.step_seconds(),
            stragglers=sum(1 for s in stats if s.straggler),
        )
        await leader.hot.set_rank_stats(
            job.id,
            [
                {
                    "rank": s.rank,
                    "node_id": s.node_id,
                    "p50_seconds": s.p50_seconds,
                    "p99_seconds": s.p99_seconds,
                    "straggler": s.straggler,
                }
                for s in stats
            ],
        )
        self._swap_out(job.id, spec.straggler.action, findings, placement)

    def _swap_out(
        self, job_id: str, action: int, findings: list[StragglerFinding], placement: Placement
    ) -> None:
        if action == 2:  # STRAGGLER_ACTION_SWAP
            for finding in findings:
                if finding.straggler and finding.rank < placement.world_size:
                    node_id = placement.ranks[finding.rank].node_id
                    self.swaps.setdefault(job_id, set()).add(node_id)


def _record_restored(
    session: AsyncSession,
    job: models.Job,
    watch: JobWatch,
    samples: list[agent_pb2.StepSample],
    world_size: int,
) -> bool:
    """Once every rank of the generation has reported a step, record when the last of
    those that loaded the restore step had it (job.restored): the goodput account splits
    the recovery's resume there into restore and re-form. True when recorded."""
    if watch.restored_told:
        return False
    for sample in samples:
        if sample.HasField("restored_at"):
            at = sample.restored_at.ToNanoseconds() / 1e9
            watch.restored[sample.rank] = (at, sample.restored_from or "unknown")
    if not watch.restored or len(watch.order.rank_max) < world_size:
        return False
    if job.state is not JobState.RUNNING:
        return False
    watch.restored_told = True
    last = max(at for at, _ in watch.restored.values())
    sources = Counter(source for _, source in watch.restored.values())
    record_event(
        session,
        "job.restored",
        actor="scheduler",
        job_id=job.id,
        reason=(
            f"every rank holds step {job.restore_step}: {len(watch.restored)} of {world_size} "
            f"loaded it ({', '.join(f'{n} from {src}' for src, n in sorted(sources.items()))})"
        ),
        attributes={
            "generation": str(job.generation),
            "restored_at": f"{last:.6f}",
            "restore_step": str(job.restore_step),
        },
    )
    return True
