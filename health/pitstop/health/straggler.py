"""Straggler detection: per-rank step times against the job's robust statistics.

Two halves, both small stateful objects over plain data (nothing here reads a clock or
does I/O):

- A `WindowFold` runs where the steps are reported, in the node's agent: it folds each
  rank's step times into one summary per window (`RankWindowSummary`: steps reported,
  steps timed, median and maximum time), so that nothing per step per rank has to
  cross the wire.
- A `StragglerDetector` runs in the scheduler, one per job and generation: it takes the
  window summaries of every node and answers with findings (a rank became a straggler,
  or recovered) and per-rank step-time statistics. `observe` takes raw step samples
  too, folding them itself (tests, and callers that hold samples).

The method:

- Steps are grouped into windows of `window_steps` consecutive step numbers, counted
  from the end of the warm-up. The first `warmup_steps` steps of a generation
  (compilation, allocator and data-loader warm-up) and checkpoint steps (the snapshot
  stall) are ignored, as are step times that are negative or not finite.
- A rank's window is summarized once the rank has reported every step of it, or a step
  past it (a lost sample delays nothing).
- When a window completes, each rank's median step time in it is compared with the
  median M of those medians across ranks. Robust spread is the MAD (median absolute
  deviation of the rank medians from M) scaled by 1.4826, so it estimates a normal
  standard deviation. A rank is slow in the window when its median exceeds both
  M + threshold x max(MAD, 1% of M) and M x 1.10.
- A rank is flagged after `windows` consecutive slow windows (one normal window resets
  the count) and reported once; a flagged rank is unflagged, with a recovered finding,
  after `windows` consecutive normal windows. A rank with no usable time in a window
  (it sent only checkpoint steps, or nothing) keeps its counts unchanged.

When a window completes (summaries come from many nodes, late, twice or out of order,
and a rank may die): every summary of an `observe_windows` call is taken in first, then
a window closes as soon as any of these holds, lowest window first:

1. it is full: every rank expected in it has summarized it. Expected are the ranks of
   the previous window (for the first window, every rank of the job when the detector
   knows the world size, else those seen in the warm-up) and those seen in this one;
2. a later window is full (so one lost summary delays nothing more than one window);
3. some rank summarized a later window. This is the rule that keeps a dead rank from
   holding windows open for ever: the live ranks' windows close one window late, and
   from then on the dead rank is no longer expected. One window of slack lets node
   agents' summaries arrive at different times without closing a window before a
   lagging node's are in.

A summary for a window that has already closed is dropped; for a duplicate (same rank
and window) the first one wins.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from pitstop.v1 import agent_pb2, jobs_pb2

MAD_SCALE = 1.4826
"""Makes the MAD a consistent estimate of the standard deviation of normal data."""

MAD_FLOOR_FRACTION = 0.01
"""The spread is never taken below 1% of the job median. Synchronous ranks often report
near-identical times, and a MAD of (nearly) zero would make any jitter a deviation."""

MIN_SLOWDOWN = 1.10
"""A slow rank's median must also be at least 10% above the job median: a slowdown
smaller than that is not worth swapping a node for, and a uniform fleet with tiny noise
(tiny MAD) must never flag."""

HISTORY_WINDOWS = 25
"""Windows kept per rank for `stats()` (500 steps at the default 20 a window)."""


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


class RankWindowLike(Protocol):
    """What the detector reads from a window summary; `RankWindowSummary` and
    `pitstop.v1.agent_pb2.RankWindow` fit."""

    @property
    def rank(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def timed(self) -> int: ...
    @property
    def median_seconds(self) -> float: ...
    @property
    def max_seconds(self) -> float: ...


@dataclass(frozen=True)
class RankWindowSummary:
    """One rank's step times over one window."""

    rank: int
    window: int
    """Index, 0 for the first window after the warm-up."""
    steps: int
    """Step numbers of the window the rank reported, checkpoint steps included."""
    timed: int
    """Of those, the steps with a usable time."""
    median_seconds: float
    max_seconds: float
    """Median and maximum of the usable times (0 when `timed` is 0)."""
    first_step: int = 0
    """The window's first step number."""

    def to_proto(self) -> agent_pb2.RankWindow:
        """The wire form, as an agent sends it in its StepSummary."""
        return agent_pb2.RankWindow(
            rank=self.rank,
            window=self.window,
            steps=self.steps,
            timed=self.timed,
            median_seconds=self.median_seconds,
            max_seconds=self.max_seconds,
            first_step=self.first_step,
        )


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
    def from_step_windows(cls, windows: agent_pb2.StepWindows | None) -> StragglerPolicy:
        """How a node cuts a job's windows, as its StartRanks or Reconfigure says (unset
        fields, or no message: the defaults)."""
        defaults = cls()
        if windows is None:
            return defaults
        return cls(
            window_steps=windows.window_steps or defaults.window_steps,
            warmup_steps=(
                windows.warmup_steps if windows.HasField("warmup_steps") else defaults.warmup_steps
            ),
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
    """Step-time statistics of one rank over its recent windows: `p50_seconds` is the
    median of the windows' medians, `p99_seconds` the 99th percentile of their maxima
    (an upper bound of the steps' own p99)."""

    rank: int
    p50_seconds: float
    p99_seconds: float
    straggler: bool
    samples: int
    """Step times the windows held (at most `HISTORY_WINDOWS` windows)."""

    def to_proto(self, node_id: str = "") -> jobs_pb2.RankStepStats:
        """The wire form; the detector does not know nodes, so the caller names it."""
        return jobs_pb2.RankStepStats(
            rank=self.rank,
            node_id=node_id,
            p50_seconds=self.p50_seconds,
            p99_seconds=self.p99_seconds,
            straggler=self.straggler,
        )


class WindowFold:
    """Folds one generation's step samples into per-rank window summaries.

    One per job and generation on each node. Step numbers and warm-up are counted from
    `start_step` (the generation's first step: its restore step + 1) when the caller
    knows it, else from the lowest step of the first sample. Samples of a rank arrive in
    step order from its process; a duplicate, or one for a window already summarized,
    is dropped.
    """

    def __init__(self, policy: StragglerPolicy | None = None, *, start_step: int | None = None):
        self.policy = policy if policy is not None else StragglerPolicy()
        self.start_step = start_step
        self._open: dict[int, tuple[int, set[int], list[float]]] = {}
        """Per rank: its open window's index, the steps and the usable times in it."""
        self._done: dict[int, int] = {}
        """Per rank: the highest window summarized."""
        self.warmup_ranks: set[int] = set()
        """Ranks that reported a warm-up step."""

    def window_of(self, step: int) -> int | None:
        """The window index of `step`; None for a step before the generation or in its
        warm-up."""
        if self.start_step is None:
            self.start_step = step
        offset = step - self.start_step - self.policy.warmup_steps
        if step < self.start_step or offset < 0:
            return None
        return offset // self.policy.window_steps

    def add(self, sample: StepSampleLike) -> list[RankWindowSummary]:
        """Take one sample; return the rank's windows it completed (at most two: the
        one it moved past and, with one-step windows, its own)."""
        rank = sample.rank
        index = self.window_of(sample.step)
        if index is None:
            if sample.step >= (self.start_step or 0):
                self.warmup_ranks.add(rank)
            return []
        if index <= self._done.get(rank, -1):
            return []  # decided already
        done = []
        current = self._open.get(rank)
        if current is not None and current[0] != index:
            if index < current[0]:
                return []  # out of order: its window moved on
            done.append(self._close(rank))
            current = None
        if current is None:
            current = self._open[rank] = (index, set(), [])
        _, steps, times = current
        if sample.step in steps:
            return done
        steps.add(sample.step)
        seconds = sample.step_seconds
        if not sample.checkpoint_step and math.isfinite(seconds) and seconds >= 0:
            times.append(seconds)
        if len(steps) == self.policy.window_steps:
            done.append(self._close(rank))
        return done

    def _close(self, rank: int) -> RankWindowSummary:
        index, steps, times = self._open.pop(rank)
        self._done[rank] = index
        assert self.start_step is not None
        first = self.start_step + self.policy.warmup_steps + index * self.policy.window_steps
        return RankWindowSummary(
            rank=rank,
            window=index,
            steps=len(steps),
            timed=len(times),
            median_seconds=statistics.median(times) if times else 0.0,
            max_seconds=max(times, default=0.0),
            first_step=first,
        )


@dataclass
class _Window:
    """Summaries of one window, by rank."""

    done: dict[int, RankWindowLike] = field(default_factory=dict)
    """Each rank's summary of the window (the first one that came)."""


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

    One per job and generation. `world_size`, when known, is who the first window
    waits for; `start_step` is used by `observe` (see `WindowFold`).
    """

    def __init__(
        self,
        policy: StragglerPolicy | None = None,
        *,
        start_step: int | None = None,
        world_size: int | None = None,
        history_windows: int = HISTORY_WINDOWS,
    ) -> None:
        self.policy = policy if policy is not None else StragglerPolicy()
        self._fold = WindowFold(self.policy, start_step=start_step)
        self._history_windows = history_windows
        self._open: dict[int, _Window] = {}
        self._closed_through = -1
        """Windows up to this index are closed; their late summaries are dropped."""
        self._prev_ranks: set[int] = set(range(world_size)) if world_size else set()
        """Ranks of the last closed window (before the first: every rank, or those of the
        warm-up)."""
        self._horizon = -1
        """Highest window summarized."""
        self._ranks: dict[int, _RankState] = {}
        self._history: dict[int, deque[tuple[int, float, float]]] = {}
        """Per rank, its recent windows with usable times: (timed, median, max)."""

    @property
    def stragglers(self) -> frozenset[int]:
        """Ranks flagged now."""
        return frozenset(rank for rank, state in self._ranks.items() if state.flagged)

    def observe(self, samples: Iterable[StepSampleLike]) -> list[StragglerFinding]:
        """Take in raw step samples (folded here into windows); return the findings of
        every window they completed."""
        summaries: list[RankWindowSummary] = []
        for sample in sorted(samples, key=lambda s: s.step):  # a rank's, in step order
            summaries += self._fold.add(sample)
        if self._closed_through < 0:
            self._prev_ranks |= self._fold.warmup_ranks
        return self.observe_windows(summaries)

    def observe_windows(self, summaries: Iterable[RankWindowLike]) -> list[StragglerFinding]:
        """Take in window summaries; return the findings of every window they completed."""
        for summary in summaries:
            self._take(summary)
        return self._close_ready()

    def stats(self) -> list[RankStats]:
        """Every rank with usable steps, by rank: the median of its recent windows'
        medians, and the 99th percentile of their maxima."""
        result = []
        for rank in sorted(self._history):
            kept = self._history[rank]
            state = self._ranks.get(rank)
            result.append(
                RankStats(
                    rank=rank,
                    p50_seconds=percentile(sorted(m for _, m, _ in kept), 0.50),
                    p99_seconds=percentile(sorted(m for _, _, m in kept), 0.99),
                    straggler=state is not None and state.flagged,
                    samples=sum(n for n, _, _ in kept),
                )
            )
        return result

    def _take(self, summary: RankWindowLike) -> None:
        index, rank = int(summary.window), int(summary.rank)
        if index <= self._closed_through:
            return  # its window is already decided
        self._horizon = max(self._horizon, index)
        window = self._open.get(index)
        if window is None:
            window = self._open[index] = _Window()
        if rank in window.done:
            return  # duplicate: the first one counted
        window.done[rank] = summary
        if summary.timed <= 0:
            return
        history = self._history.get(rank)
        if history is None:
            history = self._history[rank] = deque(maxlen=self._history_windows)
        history.append((int(summary.timed), summary.median_seconds, summary.max_seconds))

    def _close_ready(self) -> list[StragglerFinding]:
        """Close, in order, every open window up to the highest one that is ready."""
        ready = -1
        prev: AbstractSet[int] = self._prev_ranks
        for index in sorted(self._open):
            window = self._open[index]
            if self._horizon > index or prev <= window.done.keys():
                ready = index
            prev = window.done.keys()
        findings: list[StragglerFinding] = []
        for index in sorted(i for i in self._open if i <= ready):
            window = self._open.pop(index)
            self._closed_through = index
            self._prev_ranks = set(window.done)
            findings.extend(self._judge(window, self._last_step(index)))
        return findings

    def _last_step(self, index: int) -> int:
        start = self._fold.start_step or 0
        first = start + self.policy.warmup_steps + index * self.policy.window_steps
        return first + self.policy.window_steps - 1

    def _judge(self, window: _Window, last_step: int) -> list[StragglerFinding]:
        """Update every rank's run with one closed window; return the findings."""
        medians = {rank: w.median_seconds for rank, w in window.done.items() if w.timed > 0}
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
