"""Straggler detection: step samples folded into windows, windows judged
(pitstop.health.straggler)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.health.straggler import (
    RankStats,
    RankWindowSummary,
    StragglerDetector,
    StragglerFinding,
    StragglerPolicy,
    WindowFold,
    percentile,
)
from pitstop.v1 import agent_pb2, jobs_pb2

POLICY = StragglerPolicy()  # threshold 5, 3 windows of 20 steps, 10 warm-up steps


@dataclass(frozen=True)
class Sample:
    """The fields of agent_pb2.StepSample the detector reads."""

    rank: int
    step: int
    step_seconds: float
    checkpoint_step: bool = False


StepTime = Callable[[int, int], float]  # (rank, step) -> seconds


def noisy(seed: int, noise: float = 0.10, slow: dict[int, float] | None = None) -> StepTime:
    """1.0 s steps with ±`noise` uniform noise; ranks in `slow` multiplied by their factor."""
    rng = random.Random(seed)
    factors = slow or {}

    def step_time(rank: int, step: int) -> float:
        return rng.uniform(1 - noise, 1 + noise) * factors.get(rank, 1.0)

    return step_time


def feed(
    detector: StragglerDetector,
    step_time: StepTime,
    *,
    ranks: int,
    steps: int,
    first: int = 0,
    checkpoint: Callable[[int, int], bool] = lambda rank, step: False,
) -> list[tuple[int, StragglerFinding]]:
    """Every rank's sample of each step in one observe call; (step observed, finding)."""
    found: list[tuple[int, StragglerFinding]] = []
    for step in range(first, first + steps):
        batch = [
            Sample(rank, step, step_time(rank, step), checkpoint(rank, step))
            for rank in range(ranks)
        ]
        found.extend((step, finding) for finding in detector.observe(batch))
    return found


def window_end(window: int, policy: StragglerPolicy = POLICY) -> int:
    """Last step of window `window` for a generation starting at step 0."""
    return policy.warmup_steps + (window + 1) * policy.window_steps - 1


# --- a slow GPU -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_slow_gpu_is_flagged_once_after_three_windows(seed: int) -> None:
    found = feed(StragglerDetector(), noisy(seed, slow={3: 1.3}), ranks=8, steps=300)

    assert len(found) == 1
    step, finding = found[0]
    # Never before three windows after warm-up (step 69). With 8 ranks the MAD is a noisy
    # estimate, so one of the first windows may miss: allow one window more (step 89).
    assert window_end(POLICY.windows - 1) == 69 <= step
    assert step < POLICY.warmup_steps + POLICY.windows * POLICY.window_steps + POLICY.window_steps
    assert (finding.rank, finding.straggler, finding.windows) == (3, True, 3)
    assert finding.last_step == step
    assert finding.slowdown == pytest.approx(1.3, abs=0.08)
    assert finding.reason.startswith("rank 3 is 1.")
    assert finding.reason.endswith("x slower than the job median over 3 windows of 20 steps")


def test_proto_step_samples_are_accepted() -> None:
    detector = StragglerDetector()
    step_time = noisy(0, slow={1: 2.0})
    found = []
    for step in range(80):
        batch = [
            agent_pb2.StepSample(rank=rank, step=step, step_seconds=step_time(rank, step))
            for rank in range(4)
        ]
        found.extend(detector.observe(batch))
    assert [(f.rank, f.straggler) for f in found] == [(1, True)]
    assert detector.stragglers == {1}


# --- a healthy fleet --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_healthy_run_with_noise_never_flags(seed: int) -> None:
    detector = StragglerDetector()
    assert feed(detector, noisy(seed), ranks=16, steps=1000) == []
    assert detector.stragglers == frozenset()


def test_heavy_tailed_noise_never_flags() -> None:
    # Occasional 3x hiccups (GC, page faults) on every rank move no rank's median.
    rng = random.Random(7)

    def step_time(rank: int, step: int) -> float:
        return 3.0 if rng.random() < 0.05 else rng.uniform(0.9, 1.1)

    assert feed(StragglerDetector(), step_time, ranks=16, steps=1000) == []


# --- what is ignored --------------------------------------------------------------------


def five_x_checkpoints(rank: int, step: int) -> bool:
    # Rank 5's node is slow to snapshot, and snapshots often enough that, counted,
    # its checkpoint stalls would be most of its steps.
    return rank == 5 and step % 3 != 0


def with_checkpoint_stalls(step_time: StepTime) -> StepTime:
    return lambda rank, step: step_time(rank, step) * (5 if five_x_checkpoints(rank, step) else 1)


def test_checkpoint_steps_are_ignored() -> None:
    detector = StragglerDetector()
    step_time = with_checkpoint_stalls(noisy(1))
    assert feed(detector, step_time, ranks=8, steps=300, checkpoint=five_x_checkpoints) == []
    assert all(stats.p99_seconds < 1.1 for stats in detector.stats())


def test_checkpoint_stalls_counted_as_steps_would_flag() -> None:
    # The control for the test above: the same times, not marked as checkpoints.
    found = feed(StragglerDetector(), with_checkpoint_stalls(noisy(1)), ranks=8, steps=300)
    assert [(f.rank, f.straggler) for _, f in found] == [(5, True)]


@pytest.mark.parametrize(("warmup", "flagged"), [(60, []), (0, [4])])
def test_warmup_steps_are_ignored(warmup: int, flagged: list[int]) -> None:
    # Rank 4 is 3x slow for the first 60 steps only (three windows' worth).
    base = noisy(2)

    def step_time(rank: int, step: int) -> float:
        return base(rank, step) * (3 if rank == 4 and step < 60 else 1)

    detector = StragglerDetector(StragglerPolicy(warmup_steps=warmup))
    found = feed(detector, step_time, ranks=8, steps=400)
    assert [f.rank for _, f in found if f.straggler] == flagged


def test_warmup_counts_from_the_given_start_step() -> None:
    detector = StragglerDetector(start_step=1000)
    # A sample from before the generation (an old rank's straggling report) is ignored.
    assert detector.observe([Sample(0, 999, 50.0)]) == []
    found = []
    step_time = noisy(3, slow={2: 1.5})
    for step in range(1000, 1100):
        found += detector.observe(Sample(r, step, step_time(r, step)) for r in range(6))
    assert [(f.rank, f.last_step) for f in found] == [(2, 1000 + window_end(2))]


# --- persistence ------------------------------------------------------------------------


def slow_in_windows(windows: set[int], seed: int = 4, rank: int = 6) -> StepTime:
    """Rank `rank` is 1.5x slow in the given windows (counted from the end of warm-up)."""
    base = noisy(seed)

    def step_time(r: int, step: int) -> float:
        window = (step - POLICY.warmup_steps) // POLICY.window_steps
        return base(r, step) * (1.5 if r == rank and step >= 10 and window in windows else 1)

    return step_time


def test_two_slow_windows_then_a_fast_one_do_not_flag() -> None:
    step_time = slow_in_windows({0, 1, 3, 4, 6, 7})
    assert feed(StragglerDetector(), step_time, ranks=8, steps=400) == []


def test_flagged_rank_recovers_after_three_normal_windows() -> None:
    # Slow in windows 0-4, and once more in 6 (which resets the recovery count).
    detector = StragglerDetector()
    found = feed(detector, slow_in_windows({0, 1, 2, 3, 4, 6}), ranks=8, steps=400)

    assert [(step, f.rank, f.straggler) for step, f in found] == [
        (window_end(2), 6, True),
        (window_end(9), 6, False),
    ]
    recovered = found[1][1]
    assert recovered.slowdown == pytest.approx(1.0, abs=0.05)
    assert recovered.reason.startswith("rank 6 recovered: ")
    assert detector.stragglers == frozenset()


def test_a_single_window_policy_flags_and_recovers_at_once() -> None:
    detector = StragglerDetector(StragglerPolicy(windows=1, window_steps=10, warmup_steps=0))
    step_time = noisy(5, slow={0: 2.0})
    found = feed(detector, step_time, ranks=4, steps=10)
    assert [(f.rank, f.straggler) for _, f in found] == [(0, True)]
    found = feed(detector, noisy(5), ranks=4, steps=10, first=10)
    assert [(step, f.rank, f.straggler) for step, f in found] == [(19, 0, False)]
    # Window 0 again, slow: it is decided already, so its samples are dropped.
    assert feed(detector, step_time, ranks=4, steps=10) == []
    assert detector.stragglers == frozenset()


# --- delivery: late, duplicated, out of order, a dead rank ------------------------------


def test_lagging_node_shuffled_and_duplicated_gives_the_same_findings() -> None:
    # Two nodes of four ranks; node B's batches arrive 7 steps late, shuffled, twice.
    step_time = noisy(6, slow={5: 1.25})
    table = {(r, s): step_time(r, s) for s in range(300) for r in range(8)}
    in_order = StragglerDetector()
    expected = [f for s in range(300) for f in in_order.observe(sample(table, s, range(8)))]

    rng = random.Random(6)
    detector = StragglerDetector()
    found = []
    for step in range(300 + 7):
        batch = sample(table, step, range(4)) if step < 300 else []
        if step >= 7:
            late = sample(table, step - 7, range(4, 8))
            batch += late + rng.sample(late, 2)
        rng.shuffle(batch)
        found += detector.observe(batch)

    assert [f.rank for f in expected] == [5]
    assert found == expected
    assert detector.stats() == in_order.stats()


def sample(table: dict[tuple[int, int], float], step: int, ranks: range) -> list[Sample]:
    return [Sample(r, step, table[r, step]) for r in ranks]


def test_a_dead_rank_delays_windows_by_one_but_never_holds_them() -> None:
    # Rank 7 dies at step 35 (in window 1); the others carry on.
    step_time = noisy(8, slow={3: 1.4})
    detector = StragglerDetector()
    found = []
    for step in range(200):
        ranks = range(8) if step < 35 else range(7)
        found += [(step, f) for f in detector.observe(sample_of(step_time, step, ranks))]
    # Window 1 waits for rank 7 until another rank completes a later window (step 69);
    # rank 7 never completed window 1, so window 2 does not expect it: full at step 69,
    # it closes with window 1.
    assert [(step, f.rank, f.last_step) for step, f in found] == [(69, 3, window_end(2))]


def sample_of(step_time: StepTime, step: int, ranks: range) -> list[Sample]:
    return [Sample(r, step, step_time(r, step)) for r in ranks]


def test_bad_step_times_are_counted_as_reported_but_not_timed() -> None:
    detector = StragglerDetector(StragglerPolicy(warmup_steps=0, window_steps=2))
    detector.observe([Sample(0, 0, 1.0), Sample(0, 1, float("nan")), Sample(0, 2, -1.0)])
    assert detector.stats() == [RankStats(0, 1.0, 1.0, False, 1)]


# --- stats ------------------------------------------------------------------------------


def test_stats_are_per_rank_percentiles_of_recent_windows() -> None:
    policy = StragglerPolicy(warmup_steps=2, window_steps=2)
    detector = StragglerDetector(policy, history_windows=2)
    nan = float("nan")
    table = {  # the first two steps are warm-up; windows of two; history keeps the last 2
        0: [9.0, 9.0, 5.0, 1.0, 4.0, 2.0, 3.0, 7.0],
        1: [9.0, 9.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
        2: [9.0, 9.0, 1.0, 3.0, 2.0, nan, 6.0, 6.0],  # window 1 has one usable time
    }
    detector.observe(
        Sample(rank, step, seconds)
        for rank, times in table.items()
        for step, seconds in enumerate(times)
    )
    detector.observe([Sample(1, 8, 100.0, checkpoint_step=True)])  # window 3, not complete

    # p50: the median of the windows' medians; p99: of their maxima (interpolated).
    assert [
        (s.rank, s.p50_seconds, s.p99_seconds, s.straggler, s.samples) for s in detector.stats()
    ] == [
        (0, 4.0, pytest.approx(4.0 + 3 * 0.99), False, 4),
        (1, 2.0, 2.0, False, 4),
        (2, 4.0, pytest.approx(2.0 + 4 * 0.99), False, 3),
    ]
    assert detector.stats()[1].to_proto("n-1") == jobs_pb2.RankStepStats(
        rank=1, node_id="n-1", p50_seconds=2.0, p99_seconds=2.0
    )


# --- folding on the node ----------------------------------------------------------------


def test_a_rank_window_is_summarized_when_complete_or_passed() -> None:
    fold = WindowFold(StragglerPolicy(warmup_steps=1, window_steps=3), start_step=11)
    assert fold.add(Sample(0, 10, 1.0)) == []  # before the generation
    assert fold.add(Sample(0, 11, 9.0)) == []  # warm-up
    assert fold.warmup_ranks == {0}
    assert fold.add(Sample(0, 12, 1.0)) == []
    assert fold.add(Sample(0, 13, 3.0, checkpoint_step=True)) == []
    assert fold.add(Sample(0, 13, 5.0)) == []  # a duplicate: the first one counted
    assert fold.add(Sample(0, 14, 2.0)) == [RankWindowSummary(0, 0, 3, 2, 1.5, 2.0, first_step=12)]
    assert fold.add(Sample(0, 14, 2.0)) == []  # its window is summarized already
    # Step 17 is lost: step 18, in the next window, summarizes window 1 with two steps.
    assert fold.add(Sample(0, 15, 4.0)) == []
    assert fold.add(Sample(0, 16, 6.0)) == []
    assert fold.add(Sample(0, 18, 1.0)) == [RankWindowSummary(0, 1, 2, 2, 5.0, 6.0, first_step=15)]
    assert fold.add(Sample(0, 17, 1.0)) == []  # too late


def test_folding_on_each_node_finds_what_folding_in_one_place_finds() -> None:
    # Two nodes of four ranks each fold their own; the scheduler's detector gets the
    # summaries, node B's three batches late and twice, and knows the world size.
    step_time = noisy(10, slow={6: 1.3})
    table = {(r, s): step_time(r, s) for s in range(300) for r in range(8)}
    in_one_place = StragglerDetector()
    expected = [f for s in range(300) for f in in_one_place.observe(sample(table, s, range(8)))]

    nodes = [WindowFold(POLICY, start_step=0) for _ in range(2)]
    detector = StragglerDetector(POLICY, start_step=0, world_size=8)
    late: list[list[RankWindowSummary]] = []
    found = []
    for step in range(303):
        a = [
            w for r in range(4) if step < 300 for w in nodes[0].add(Sample(r, step, table[r, step]))
        ]
        b = [
            w
            for r in range(4, 8)
            if step < 300
            for w in nodes[1].add(Sample(r, step, table[r, step]))
        ]
        late.append(b)
        batch = a + (late[step - 3] * 2 if step >= 3 else [])
        found += detector.observe_windows(batch)

    assert [f.rank for f in expected] == [6]
    assert found == expected
    assert detector.stats() == in_one_place.stats()


def test_a_summary_from_the_wire_is_accepted() -> None:
    detector = StragglerDetector(StragglerPolicy(windows=1), start_step=1, world_size=4)
    windows = [
        agent_pb2.RankWindow(rank=r, window=0, steps=20, timed=20, median_seconds=1.0 + (r == 3))
        for r in range(4)
    ]
    assert detector.observe_windows(windows[:3]) == []  # rank 3's is not in yet
    found = detector.observe_windows(windows[3:])
    assert [(f.rank, f.last_step) for f in found] == [(3, 1 + 10 + 19)]


def test_stats_mark_flagged_ranks() -> None:
    detector = StragglerDetector()
    feed(detector, noisy(9, slow={2: 1.5}), ranks=4, steps=100)
    assert [s.rank for s in detector.stats() if s.straggler] == [2]


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 0.5, 0.0),
        ([4.0], 0.99, 4.0),
        ([1.0, 2.0], 0.5, 1.5),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.5, 3.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.99, 4.96),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 1.0, 5.0),
        ([float(v) for v in range(101)], 0.99, 99.0),
    ],
)
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


# --- policy -----------------------------------------------------------------------------


def test_policy_from_proto_fills_defaults() -> None:
    assert StragglerPolicy.from_proto(jobs_pb2.StragglerPolicy()) == StragglerPolicy()
    assert StragglerPolicy.from_proto(
        jobs_pb2.StragglerPolicy(threshold=3.5, windows=2, window_steps=50, warmup_steps=0)
    ) == StragglerPolicy(threshold=3.5, windows=2, window_steps=50, warmup_steps=0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"threshold": -1.0}, "straggler threshold must be a positive number"),
        ({"threshold": float("nan")}, "straggler threshold"),
        ({"windows": 0}, "straggler windows must be at least 1, got 0"),
        ({"window_steps": 0}, "straggler window_steps must be at least 1, got 0"),
        ({"warmup_steps": -1}, "straggler warmup_steps must not be negative, got -1"),
    ],
)
def test_policy_rejects_nonsense(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerPolicy(**fields)  # type: ignore[arg-type]


# --- properties -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.tuples(st.floats(0.001, 1000.0), st.booleans()), min_size=1, max_size=120),
    ranks=st.integers(1, 12),
    policy=st.builds(
        StragglerPolicy,
        threshold=st.floats(0.1, 10.0),
        windows=st.integers(1, 3),
        window_steps=st.integers(1, 8),
        warmup_steps=st.integers(0, 5),
    ),
    cuts=st.lists(st.integers(0, 2000), max_size=20),
    seed=st.integers(0, 2**32 - 1),
)
def test_identical_ranks_are_never_flagged(
    times: list[tuple[float, bool]],
    ranks: int,
    policy: StragglerPolicy,
    cuts: list[int],
    seed: int,
) -> None:
    # Every rank has the same time (and checkpoint flag) at each step; the samples come
    # in step order, cut into arbitrary batches, each shuffled and with duplicates.
    rng = random.Random(seed)
    stream = [
        Sample(rank, step, seconds, checkpoint)
        for step, (seconds, checkpoint) in enumerate(times)
        for rank in range(ranks)
    ]
    detector = StragglerDetector(policy)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    for start, end in itertools.pairwise(bounds):
        batch = stream[start:end]
        batch += rng.sample(batch, min(len(batch), 3))
        rng.shuffle(batch)
        assert detector.observe(batch) == []
    assert detector.stragglers == frozenset()
