"""Following the jobs' steps: the nodes' step summaries in Redis feed each job's
straggler detector, move a starting or recovering job to RUNNING once its generation
steps, advance its step to where its slowest rank is, and keep the goodput account
fresh. The agents fold their ranks' steps (pitstop.agent.steps), so what is read here
grows with the nodes and the straggler windows, not with ranks x steps."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
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
from pitstop.scheduler.hotstate import host_signals
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
WINDOW_HOLD_SECONDS = 5.0
"""Longest a straggler window waits for the job's other ranks before the detector sees
it, at least (a window arrives with its node's step report: see Leader.window_hold_seconds)."""
RANK_STATS_SECONDS = 2.0
"""Per-rank statistics are published (and the typical step time worked out) at most this
often, and at once when a straggler is flagged or cleared: every rank's windows are
sorted for them, 100,000 ranks at full scale."""


class WindowOrder:
    """The detector closes a window once any rank has summarized a later one (so that a
    dead rank holds nothing for ever), but ranks drift apart: a slow rank of a job whose
    ranks do not wait for each other, or a node whose summaries lag. So the windows go
    to it in order: window k once every rank has summarized it, or `hold` seconds after
    its first summary came; a summary of a window already let through goes at once."""

    def __init__(self) -> None:
        self._held: dict[int, list[agent_pb2.RankWindow]] = {}
        self._ranks: dict[int, set[int]] = {}  # window -> the ranks that summarized it
        self._since: dict[int, float] = {}  # window -> when its first summary came
        self._through = -1  # windows up to this one have gone to the detector

    def release(
        self, fresh: Iterable[agent_pb2.RankWindow], world_size: int, now: float, hold: float
    ) -> list[agent_pb2.RankWindow]:
        ready = []
        for window in fresh:
            if window.window <= self._through:
                ready.append(window)
            else:
                self._held.setdefault(window.window, []).append(window)
                self._ranks.setdefault(window.window, set()).add(window.rank)
                self._since.setdefault(window.window, now)
        for index in sorted(self._held):
            if len(self._ranks[index]) < world_size and now - self._since[index] < hold:
                break
            ready += self._held.pop(index)
            del self._ranks[index], self._since[index]
            self._through = index
        return ready


@dataclass
class NodeSteps:
    """Where one node's ranks of a job stand in the current generation."""

    ranks: int = 0
    slowest: int = 0
    newest: int = 0


@dataclass
class StepRate:
    """The job's step time from its progress, before any straggler window closed."""

    first: tuple[float, int] | None = None  # (epoch seconds, step)
    last: tuple[float, int] | None = None

    def add(self, at: float, step: int) -> None:
        if at <= 0:
            return
        if self.first is None:
            self.first = (at, step)
        if self.last is None or step > self.last[1]:
            self.last = (at, step)

    def seconds(self) -> float:
        if self.first is None or self.last is None or self.last[1] <= self.first[1]:
            return 0.0
        return (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])


@dataclass
class JobWatch:
    """What the leader remembers about one live job between ticks: telemetry only,
    rebuilt from the streams when lost. Decisions live in PostgreSQL."""

    stream_id: str = "0-0"
    detector: StragglerDetector | None = None
    detector_generation: int = 0
    # Each node's ranks of this generation, by node id.
    nodes: dict[str, NodeSteps] = field(default_factory=dict)
    rate: StepRate = field(default_factory=StepRate)
    order: WindowOrder = field(default_factory=WindowOrder)
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
    # The newest step of this generation seen, and when (the leader's clock): what the
    # hang watch measures silence from (None before the generation's first step).
    newest_seen: int = 0
    progressed_at: float | None = None

    def step_seconds(self) -> float:
        """The job's typical step time: the median of its ranks' medians as of the last
        statistics published; before a window closed, from its progress (0 if unknown)."""
        if self.detector is None:
            return 0.0
        if not self.typical_step_seconds:
            self.typical_step_seconds = typical(self.detector.stats())
        return self.typical_step_seconds or self.rate.seconds()

    def reported(self) -> int:
        """Ranks of the generation that have reported a step."""
        return sum(node.ranks for node in self.nodes.values())


def typical(stats: list[RankStats]) -> float:
    """The median of the ranks' median step times (0 with none)."""
    medians = sorted(s.p50_seconds for s in stats)
    return medians[len(medians) // 2] if medians else 0.0


class StepFollower:
    def __init__(self, leader: Leader) -> None:
        self.leader = leader
        self.watches: dict[str, JobWatch] = {}
        self.jobs: dict[str, models.Job] = {}
        """The live jobs (runnable or paused) as the last pass read them."""
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
            jobs = self.jobs = {
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
        summaries: dict[str, list[agent_pb2.StepSummary]] = {}
        for job_id, entry_id, summary in await self.leader.hot.read_step_summaries(cursors):
            self.watches[job_id].stream_id = entry_id
            if summary.generation == jobs[job_id].generation:
                summaries.setdefault(job_id, []).append(summary)
        for job_id, fresh in summaries.items():
            await self._observe(jobs[job_id], self.watches[job_id], fresh)

    async def _observe(
        self, job: models.Job, watch: JobWatch, summaries: list[agent_pb2.StepSummary]
    ) -> None:
        leader = self.leader
        spec = spec_from_json(job.spec)
        if watch.detector_generation != job.generation:
            watch.detector, watch.detector_generation = None, job.generation
            watch.nodes, watch.rate, watch.findings = {}, StepRate(), []
            watch.order = WindowOrder()
            watch.restored, watch.restored_told = {}, False
            watch.newest_seen, watch.progressed_at = 0, None
        newest = max(s.newest_step for s in summaries)
        if watch.progressed_at is None or newest > watch.newest_seen:
            watch.newest_seen, watch.progressed_at = newest, leader.clock()
        async with leader.store.write() as session:
            row = await locked_job(leader, session, job.id)
            if row is None or row.generation != job.generation:
                return
            # A generation's rank map never changes: read once, not every pass.
            if watch.placement is None or watch.placement_generation != row.generation:
                watch.placement = await self.leader.rank_maps.of(session, row)
                watch.placement_generation = row.generation
            placement = watch.placement
            if watch.detector is None:
                watch.detector = StragglerDetector(
                    StragglerPolicy.from_proto(spec.straggler),
                    start_step=row.restore_step + 1,
                    world_size=placement.world_size,
                )
            detector = watch.detector
            for summary in summaries:
                node = watch.nodes.setdefault(summary.node_id, NodeSteps())
                node.ranks = max(node.ranks, summary.ranks)
                node.slowest = max(node.slowest, summary.slowest_step)
                node.newest = max(node.newest, summary.newest_step)
                if summary.HasField("time"):
                    watch.rate.add(summary.time.ToNanoseconds() / 1e9, summary.newest_step)
            windows = watch.order.release(
                (w for s in summaries for w in s.windows),
                placement.world_size,
                leader.clock(),
                leader.window_hold_seconds,
            )
            watch.findings += detector.observe_windows(windows)
            findings = list(watch.findings)
            # The job is where its slowest rank is, once every rank has reported.
            if watch.reported() >= placement.world_size:
                slowest = min(node.slowest for node in watch.nodes.values())
                row.current_step = max(row.current_step, slowest)
            changed = False
            # A job waiting for capacity keeps its generation: the survivors' last steps
            # of it are no sign that it recovered.
            waiting = row.state is JobState.RECOVERING and bool(
                await failed_nodes(session, placement)
            )
            if row.state in (JobState.STARTING, JobState.RECOVERING) and not waiting:
                # A job that failed before it ever ran (or since it was placed again)
                # runs now for the first time: job.running, which its users wait for.
                first = row.state is JobState.STARTING or row.running_since is None
                kind = "job.running" if first else "job.recovered"
                lifecycle.transition(
                    session,
                    row,
                    JobState.RUNNING,
                    kind=kind,
                    reason=f"ranks are stepping (step {newest})",
                )
                set_deadline(row, None)
                changed = True
            if _record_restored(session, row, watch, summaries, placement.world_size):
                changed = True
            account = None
            if changed or leader.clock() >= watch.goodput_at:
                await session.flush()  # the transition's event counts
                account = await goodput.refresh(session, row, step_seconds=watch.step_seconds())
                watch.goodput_at = leader.clock() + GOODPUT_REFRESH_SECONDS
            for finding in findings:
                slots = placement.ranks
                node_id = slots[finding.rank].node_id if finding.rank < len(slots) else ""
                # A straggler's cause, where its host knows it (a slower link, errors).
                why = await host_signals(leader.hot, [node_id]) if finding.straggler else ""
                record_event(
                    session,
                    "job.straggler" if finding.straggler else "job.straggler_cleared",
                    actor="scheduler",
                    job_id=job.id,
                    node_id=node_id or None,
                    reason=f"{finding.reason}; {why}" if why else finding.reason,
                    attributes={"rank": str(finding.rank), "slowdown": f"{finding.slowdown:.3f}"},
                )
        watch.findings = []  # committed
        metrics = leader.metrics.job
        metrics.observe_summaries(job.id, job.generation, summaries, job.restore_step)
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
    summaries: list[agent_pb2.StepSummary],
    world_size: int,
) -> bool:
    """Once every rank of the generation has reported a step, record when the last of
    those that loaded the restore step had it (job.restored): the goodput account splits
    the recovery's resume there into restore and re-form. True when recorded."""
    if watch.restored_told:
        return False
    for summary in summaries:
        for told in summary.restored:
            at = told.restored_at.ToNanoseconds() / 1e9
            watch.restored[told.rank] = (at, told.restored_from or "unknown")
    if not watch.restored or watch.reported() < world_size:
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
