"""Step telemetry folded on the node: ranks report every step, the agent sends summaries.

Each rank reports each step to its agent. The agent folds them, per job and generation,
into one `StepSummary` per flush: the node's slowest and newest step, the tokens and
FLOPs since the last summary, the loss, and the straggler windows its ranks completed
(`RankWindow`: per rank and window, the steps reported, their median and maximum time).
What crosses the wire and lands in Redis grows with the nodes and the windows, not with
ranks x steps: at 100,000 ranks and 20-step windows, one record per rank per 20 steps.

The windows are the job's straggler policy's (the StartRanks or Reconfigure that began
the generation names them; the defaults otherwise), counted from the generation's first
step, so every node cuts the same windows and the scheduler judges them side by side.
Window summaries wait for the next flush in a bounded buffer: when the scheduler link is
down for long, the oldest go first and are counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from pitstop.health.straggler import RankWindowSummary, StragglerPolicy, WindowFold
from pitstop.v1 import agent_pb2

DEFAULT_MAX_WINDOWS = 65536
IDLE_JOB_SECONDS = 300.0
"""A job with no rank on the node and nothing left to send this long is forgotten: an
agent runs for months, through thousands of jobs."""
LOSSES_KEPT = 8
"""Recent (step, loss, gradient norm) triples kept per rank: enough to find every rank's loss at the
node's slowest step while ranks are a step or two apart."""


@dataclass
class _Generation:
    """One job's generation on this node."""

    generation: int
    fold: WindowFold
    newest: dict[int, int] = field(default_factory=dict)
    """Each rank's newest step."""
    losses: dict[int, deque[tuple[int, float, float]]] = field(default_factory=dict)
    peaks: dict[int, float] = field(default_factory=dict)
    # Since the last summary:
    samples: int = 0
    tokens: int = 0
    model_flops: float = 0.0
    ended: agent_pb2.StepSample | None = None
    restored: list[agent_pb2.RankRestored] = field(default_factory=list)
    told: bool = False
    """A summary of this generation went out (its ranks count stays news until then)."""
    told_ranks: int = 0
    """How many of its ranks had reported when the last summary went out: a rank
    reporting its first step of the generation is news (the scheduler counts them)."""


class StepSummarizer:
    """Folds the step samples of every rank on the node until the next `drain`.

    Not thread-safe: used from the agent's event loop only.
    """

    def __init__(self, max_windows: int = DEFAULT_MAX_WINDOWS) -> None:
        if max_windows < 1:
            raise ValueError(f"max_windows {max_windows}: use at least 1")
        self._max_windows = max_windows
        self._jobs: dict[str, _Generation] = {}
        self._expected: dict[str, tuple[int, int, StragglerPolicy]] = {}
        """Per job: the generation its last command began, its first step, its windows."""
        self._windows: deque[tuple[str, int, RankWindowSummary]] = deque()
        self._pending = 0
        self._dropped = 0
        self._idle_since: dict[str, float] = {}

    def expect(
        self,
        job_id: str,
        generation: int,
        restore_step: int,
        windows: agent_pb2.StepWindows | None = None,
    ) -> None:
        """Generation `generation` of `job_id` starts after `restore_step`, its windows as
        `windows` says (unset fields: the policy's defaults)."""
        policy = StragglerPolicy.from_step_windows(windows)
        self._expected[job_id] = (generation, restore_step + 1, policy)
        self._idle_since.pop(job_id, None)

    def add(self, job_id: str, generation: int, sample: agent_pb2.StepSample) -> bool:
        """Fold in one sample of `job_id` at `generation`; a sample of an older generation
        than the job's newest here is dropped. True for the job's first sample in a newer
        generation (it got going: worth reporting at once)."""
        current = self._jobs.get(job_id)
        news = False
        if current is None or generation > current.generation:
            expected = self._expected.get(job_id)
            if expected is not None and expected[0] == generation:
                fold = WindowFold(expected[2], start_step=expected[1])
            else:  # not told (an agent restarted mid-generation): the defaults
                fold = WindowFold(StragglerPolicy())
            current = self._jobs[job_id] = _Generation(generation, fold)
            news = True
        elif generation < current.generation:
            return False
        self._pending += 1
        current.samples += 1
        current.tokens += sample.tokens
        if sample.model_flops > 0:
            current.model_flops += sample.model_flops
        if sample.peak_flops > 0:
            current.peaks[sample.rank] = sample.peak_flops
        rank = sample.rank
        if sample.step >= current.newest.get(rank, -1):
            current.newest[rank] = sample.step
            losses = current.losses.get(rank)
            if losses is None:
                losses = current.losses[rank] = deque(maxlen=LOSSES_KEPT)
            losses.append((sample.step, sample.loss, sample.grad_norm))
            if current.ended is None or sample.time.ToNanoseconds() >= (
                current.ended.time.ToNanoseconds()
            ):
                current.ended = sample
        if sample.HasField("restored_at"):
            current.restored.append(
                agent_pb2.RankRestored(
                    rank=rank,
                    restored_at=sample.restored_at,
                    restored_from=sample.restored_from,
                )
            )
        for window in current.fold.add(sample):
            self._windows.append((job_id, generation, window))
            if len(self._windows) > self._max_windows:
                self._windows.popleft()
                self._dropped += 1
        return news

    def drain(self, due: bool = True) -> list[agent_pb2.StepSummary]:
        """A summary of each job with news since the last drain; the news is cleared.
        `due`: the periodic report, where steps and straggler windows are news; between
        two, only what the scheduler acts on at once is: a generation's first steps,
        until every rank of it here has reported (it got going: a recovery resumed)."""
        urgent = {
            job_id
            for job_id, current in self._jobs.items()
            if not current.told or len(current.newest) != current.told_ranks
        }
        windows: dict[str, list[RankWindowSummary]] = {}
        kept: deque[tuple[str, int, RankWindowSummary]] = deque()
        for job_id, generation, window in self._windows:
            current = self._jobs.get(job_id)
            if current is None or current.generation != generation:
                continue
            if due or job_id in urgent:
                windows.setdefault(job_id, []).append(window)
            else:
                kept.append((job_id, generation, window))
        self._windows = kept
        if due:
            self._pending = 0
        summaries = []
        for job_id, current in self._jobs.items():
            done = windows.get(job_id, [])
            if not due and job_id not in urgent:
                continue
            if not current.samples and not done and job_id not in urgent:
                continue
            summaries.append(_summary(job_id, current, done))
            current.samples, current.tokens, current.model_flops = 0, 0, 0.0
            current.restored = []
            current.told, current.told_ranks = True, len(current.newest)
        return summaries

    def forget_idle(
        self, active: Collection[str], now: float, after: float = IDLE_JOB_SECONDS
    ) -> list[str]:
        """Forget the jobs not in `active` (no rank of theirs runs here) that have had
        nothing left to send for `after` seconds by the clock `now`; call after a due
        `drain`. A job told to start again (`expect`) or stepping is kept. The jobs
        forgotten."""
        unsent = {job_id for job_id, _, _ in self._windows}
        unsent.update(
            job_id
            for job_id, current in self._jobs.items()
            if current.samples or current.restored or not current.told
        )
        forgotten = []
        for job_id in {*self._jobs, *self._expected}:
            if job_id in active or job_id in unsent:
                self._idle_since.pop(job_id, None)
                continue
            if now - self._idle_since.setdefault(job_id, now) < after:
                continue
            self._jobs.pop(job_id, None)
            self._expected.pop(job_id, None)
            del self._idle_since[job_id]
            forgotten.append(job_id)
        return sorted(forgotten)

    @property
    def jobs(self) -> int:
        """Jobs the summarizer holds anything of."""
        return len({*self._jobs, *self._expected})

    @property
    def pending(self) -> int:
        """Samples folded since the last drain."""
        return self._pending

    @property
    def dropped(self) -> int:
        """Window summaries dropped since start because the buffer was full."""
        return self._dropped


def _summary(
    job_id: str, current: _Generation, windows: list[RankWindowSummary]
) -> agent_pb2.StepSummary:
    slowest = min(current.newest.values(), default=0)
    losses = [
        loss
        for kept in current.losses.values()
        for step, loss, _ in kept
        if step == slowest and loss == loss  # not NaN
    ]
    norms = [
        norm
        for kept in current.losses.values()
        for step, _, norm in kept
        if step == slowest and norm > 0  # stated (NaN is not > 0)
    ]
    summary = agent_pb2.StepSummary(
        job_id=job_id,
        generation=current.generation,
        ranks=len(current.newest),
        slowest_step=slowest,
        newest_step=max(current.newest.values(), default=0),
        samples=current.samples,
        tokens=current.tokens,
        model_flops=current.model_flops,
        peak_flops=sum(current.peaks.values()),
        loss_step=slowest if losses else 0,
        loss=sum(losses) / len(losses) if losses else 0.0,
        grad_norm=sum(norms) / len(norms) if norms else 0.0,
        windows=[w.to_proto() for w in windows],
        restored=current.restored,
    )
    if current.ended is not None and current.ended.HasField("time"):
        summary.time.CopyFrom(current.ended.time)
    return summary
