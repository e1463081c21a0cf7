"""Straggler detection: per-rank step times against the job's robust statistics.

A `StragglerDetector` is a small stateful object over plain data. The scheduler keeps
one per job and generation and feeds it step samples as they arrive; it answers with
findings (a rank became a straggler, or recovered) and per-rank step-time statistics.
Nothing here reads a clock or does I/O. DESIGN.md ("Health", stragglers).

The method:

- Steps are grouped into windows of `window_steps` consecutive step numbers, counted
  from the end of the warm-up. The first `warmup_steps` steps of a generation
  (compilation, allocator and data-loader warm-up) and checkpoint steps (the snapshot
  stall) are ignored, as are step times that are negative or not finite.
- When a window completes, each rank's median step time in it is compared with the
  median M of those medians across ranks. Robust spread is the MAD (median absolute
  deviation of the rank medians from M) scaled by 1.4826, so it estimates a normal
  standard deviation. A rank is slow in the window when its median exceeds both
  M + threshold x max(MAD, 1% of M) and M x 1.10.
- A rank is flagged after `windows` consecutive slow windows (one normal window resets
  the count) and reported once; a flagged rank is unflagged, with a recovered finding,
  after `windows` consecutive normal windows. A rank with no usable time in a window
  (it sent only checkpoint steps, or nothing) keeps its counts unchanged.

When a window completes (samples may arrive late, twice or out of order, and a rank may
die): every sample of an `observe` call is taken in first, then a window closes as soon
as any of these holds, lowest window first:

1. it is full: every rank that reported in the previous window (for the first window,
   in the warm-up) or in this one has reported every step of it, checkpoint steps
   included;
2. a later window is full (so one lost sample delays nothing more than one window);
3. a sample arrived for a step at least one whole window past its end. This is the
   rule that keeps a dead rank from holding windows open for ever: the live ranks'
   windows close one window late, and from then on the dead rank is no longer expected.
   One window of slack lets node agents' batches arrive at different times without
   closing a window before a lagging node's samples are in.

A sample for a window that has already closed is dropped; for a duplicate (same rank and
step) the first one wins.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from pitstop.v1 import jobs_pb2

MAD_SCALE = 1.4826
"""Makes the MAD a consistent estimate of the standard deviation of normal data."""

MAD_FLOOR_FRACTION = 0.01
"""The spread is never taken below 1% of the job median. Synchronous ranks often report
near-identical times, and a MAD of (nearly) zero would make any jitter a deviation."""

MIN_SLOWDOWN = 1.10
"""A slow rank's median must also be at least 10% above the job median: a slowdown
smaller than that is not worth swapping a node for, and a uniform fleet with tiny noise
(tiny MAD) must never flag."""

HISTORY_STEPS = 512
"""Step times kept per rank for `stats()`."""


class StepSampleLike(Protocol):
    """What the detector reads from a sample; `pitstop.v1.agent_pb2.StepSample` fits."""

    @property
    def rank(self) -> int:
        """Global rank."""
        ...

    @property
    def step(self) -> int:
        """Step number."""
        ...

    @property
    def step_seconds(self) -> float:
        """Wall time of the step, seconds."""
        ...

    @property
    def checkpoint_step(self) -> bool:
        """The step included a snapshot."""
        ...


@dataclass(frozen=True)
class StragglerPolicy:
    """The detection half of `pitstop.v1.StragglerPolicy`, with the proto's defaults.

    The action (report or swap) is the scheduler's business, so it is not here.
    """

    threshold: float = 5.0
    """Robust deviations above the job median that make a rank slow in a window."""
    windows: int = 3
    """Consecutive slow windows to flag a rank; consecutive normal windows to unflag it."""
    window_steps: int = 20
    """Steps per window."""
    warmup_steps: int = 10
    """Steps at the start of a generation to ignore."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(
                f"straggler threshold must be a positive number of deviations, "
                f"got {self.threshold}; leave it unset for the default 5"
            )
        if self.windows < 1:
            raise ValueError(f"straggler windows must be at least 1, got {self.windows}")
        if self.window_steps < 1:
            raise ValueError(f"straggler window_steps must be at least 1, got {self.window_steps}")
        if self.warmup_steps < 0:
            raise ValueError(
                f"straggler warmup_steps must not be negative, got {self.warmup_steps}"
            )

    @classmethod
    def from_proto(cls, message: jobs_pb2.StragglerPolicy) -> StragglerPolicy:
        """The policy a job asked for; fields left unset (zero) take the defaults."""
        defaults = cls()
        return cls(
            threshold=message.threshold or defaults.threshold,
            windows=message.windows or defaults.windows,
            window_steps=message.window_steps or defaults.window_steps,
            warmup_steps=(
                message.warmup_steps if message.HasField("warmup_steps") else defaults.warmup_steps
            ),
        )


@dataclass(frozen=True)
class StragglerFinding:
    """A rank became a straggler (`straggler` true) or recovered (`straggler` false)."""

    rank: int
    straggler: bool
    slowdown: float
    """The rank's median step time over the job median, median over the deciding windows."""
    windows: int
    """Windows in a row that decided it."""
    last_step: int
    """Last step of the window that decided it."""
    reason: str
    """One line for a person, e.g. "rank 5 is 1.31x slower than the job median ..."."""


@dataclass(frozen=True)
class RankStats:
    """Step-time statistics of one rank over its recent history."""

    rank: int
    p50_seconds: float
    p99_seconds: float
    straggler: bool
    samples: int
    """Step times the percentiles are over (at most `HISTORY_STEPS`)."""

    def to_proto(self, node_id: str = "") -> jobs_pb2.RankStepStats:
        """The wire form; the detector does not know nodes, so the caller names it."""
        return jobs_pb2.RankStepStats(
            rank=self.rank,
            node_id=node_id,
            p50_seconds=self.p50_seconds,
            p99_seconds=self.p99_seconds,
            straggler=self.straggler,
        )


@dataclass
class _Window:
    """Samples of one window, by rank."""

    steps: dict[int, set[int]] = field(default_factory=dict)
    """Steps each rank reported, checkpoint steps included: that is what "full" counts."""
    times: dict[int, list[float]] = field(default_factory=dict)
    """Usable step times of each rank."""
    full_ranks: int = 0
    """Ranks that reported every step of the window."""


@dataclass
class _RankState:
    """Where one rank stands in the flag/unflag state machine."""

    flagged: bool = False
    run: int = 0
    """Consecutive slow windows (unflagged) or normal windows (flagged)."""
    ratios: list[float] = field(default_factory=list)
    """Slowdown ratios of the windows in the current run."""


class StragglerDetector:
    """Flags ranks whose step times stay above the job's robust statistics.

    One per job and generation: step numbers and warm-up are counted from the
    generation's first step, `start_step` when the caller knows it (the restore step),
    else the lowest step of the first samples observed.
    """

    def __init__(
        self,
        policy: StragglerPolicy | None = None,
        *,
        start_step: int | None = None,
        history_steps: int = HISTORY_STEPS,
    ) -> None:
        self.policy = policy if policy is not None else StragglerPolicy()
        self._start_step = start_step
        self._history_steps = history_steps
        self._open: dict[int, _Window] = {}
        self._closed_through = -1
        """Windows up to this index are closed; their late samples are dropped."""
        self._prev_ranks: set[int] = set()
        """Ranks of the last closed window (before the first: of the warm-up)."""
        self._horizon = -1
        """Highest step seen."""
        self._ranks: dict[int, _RankState] = {}
        self._history: dict[int, deque[float]] = {}

    @property
    def stragglers(self) -> frozenset[int]:
        """Ranks flagged now."""
        return frozenset(rank for rank, state in self._ranks.items() if state.flagged)

    def observe(self, samples: Iterable[StepSampleLike]) -> list[StragglerFinding]:
        """Take in step samples; return the findings of every window they completed."""
        batch = list(samples)
        if not batch:
            return []
        if self._start_step is None:
            self._start_step = min(sample.step for sample in batch)
        for sample in batch:
            self._take(sample)
        return self._close_ready()

    def stats(self) -> list[RankStats]:
        """p50 and p99 step time of every rank with usable steps, by rank."""
        result = []
        for rank in sorted(self._history):
            times = sorted(self._history[rank])
            state = self._ranks.get(rank)
            result.append(
                RankStats(
                    rank=rank,
                    p50_seconds=percentile(times, 0.50),
                    p99_seconds=percentile(times, 0.99),
                    straggler=state is not None and state.flagged,
                    samples=len(times),
                )
            )
        return result

    def _take(self, sample: StepSampleLike) -> None:
        assert self._start_step is not None
        rank, step = sample.rank, sample.step
        if step < self._start_step:
            return  # before this generation
        offset = step - self._start_step - self.policy.warmup_steps
        self._horizon = max(self._horizon, step)
        if offset < 0:
            if self._closed_through < 0:
                self._prev_ranks.add(rank)
            return
        index = offset // self.policy.window_steps
        if index <= self._closed_through:
            return  # its window is already decided
        window = self._open.get(index)
        if window is None:
            window = self._open[index] = _Window()
        steps = window.steps.setdefault(rank, set())
        if step in steps:
            return  # duplicate: the first one counted
        steps.add(step)
        if len(steps) == self.policy.window_steps:
            window.full_ranks += 1
        seconds = sample.step_seconds
        if sample.checkpoint_step or not math.isfinite(seconds) or seconds < 0:
            return
        window.times.setdefault(rank, []).append(seconds)
        history = self._history.get(rank)
        if history is None:
            history = self._history[rank] = deque(maxlen=self._history_steps)
        history.append(seconds)

    def _close_ready(self) -> list[StragglerFinding]:
        """Close, in order, every open window up to the highest one that is ready."""
        ready = -1
        prev: AbstractSet[int] = self._prev_ranks
        for index in sorted(self._open):
            window = self._open[index]
            overrun = self._horizon - self._last_step(index) >= self.policy.window_steps
            if overrun or self._is_full(window, prev):
                ready = index
            prev = window.steps.keys()
        findings: list[StragglerFinding] = []
        for index in sorted(i for i in self._open if i <= ready):
            window = self._open.pop(index)
            self._closed_through = index
            self._prev_ranks = set(window.steps)
            findings.extend(self._judge(window, self._last_step(index)))
        return findings

    @staticmethod
    def _is_full(window: _Window, prev: AbstractSet[int]) -> bool:
        # Cheap count test first: this runs after every observe call.
        return window.full_ranks == len(window.steps) and prev <= window.steps.keys()

    def _last_step(self, index: int) -> int:
        assert self._start_step is not None
        first = self._start_step + self.policy.warmup_steps + index * self.policy.window_steps
        return first + self.policy.window_steps - 1

    def _judge(self, window: _Window, last_step: int) -> list[StragglerFinding]:
        """Update every rank's run with one closed window; return the findings."""
        medians = {rank: statistics.median(times) for rank, times in window.times.items()}
        if not medians:
            return []
        job_median = statistics.median(medians.values())
        mad = MAD_SCALE * statistics.median(abs(m - job_median) for m in medians.values())
        spread = max(mad, MAD_FLOOR_FRACTION * job_median)
        limit = max(job_median + self.policy.threshold * spread, MIN_SLOWDOWN * job_median)
        findings = []
        for rank in sorted(medians):
            ratio = medians[rank] / job_median if job_median > 0 else math.inf
            finding = self._advance(rank, medians[rank] > limit, ratio, last_step)
            if finding is not None:
                findings.append(finding)
        return findings

    def _advance(
        self, rank: int, slow: bool, ratio: float, last_step: int
    ) -> StragglerFinding | None:
        state = self._ranks.setdefault(rank, _RankState())
        # A run counts windows that argue for changing the rank's state; any window that
        # argues for keeping it resets the run.
        if slow != state.flagged:
            state.run += 1
            state.ratios.append(ratio)
        else:
            state.run = 0
            state.ratios.clear()
            return None
        if state.run < self.policy.windows:
            return None
        slowdown = statistics.median(state.ratios)
        state.flagged = slow
        state.run = 0
        state.ratios.clear()
        span = f"{self.policy.windows} windows of {self.policy.window_steps} steps"
        if slow:
            reason = f"rank {rank} is {slowdown:.2f}x slower than the job median over {span}"
        else:
            reason = f"rank {rank} recovered: {slowdown:.2f}x the job median over {span}"
        return StragglerFinding(
            rank=rank,
            straggler=slow,
            slowdown=slowdown,
            windows=self.policy.windows,
            last_step=last_step,
            reason=reason,
        )


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, interpolating linearly between neighbours
    (numpy's default method); 0.0 for no values."""
    if not sorted_values:
        return 0.0
    position = q * (len(sorted_values) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    fraction = position - lower
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * fraction
