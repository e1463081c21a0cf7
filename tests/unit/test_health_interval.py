"""The Young/Daly checkpoint interval (pitstop.health.interval)."""

from __future__ import annotations

import math

import pytest

from pitstop.health.interval import durable_every_steps, young_daly_interval

# (C seconds, M seconds, expected T). Expected values worked by hand from Daly's eq. 37:
# e.g. C=10, M=3600: sqrt(72000)=268.328; r=C/2M=0.0013889; 1+sqrt(r)/3+r/9=1.012577;
# 268.328*1.012577-10=261.703.
INTERVALS = [
    (10.0, 3600.0, 261.703),
    (1.0, 3600.0, 84.187),
    (60.0, 86400.0, 3180.062),
    (30.0, 7200.0, 637.419),
    (100.0, 100.0, 82.611),  # C close to M: the correction matters
    (200.0, 100.0, 100.0),  # C >= 2M: checkpoint once per MTBF
    (500.0, 100.0, 100.0),
    (0.0, 3600.0, 0.0),  # free checkpoints: take them all the time
]


@pytest.mark.parametrize(("cost", "mtbf", "expected"), INTERVALS)
def test_young_daly_interval(cost: float, mtbf: float, expected: float) -> None:
    assert young_daly_interval(cost, mtbf) == pytest.approx(expected, abs=1e-3)


def test_daly_is_below_young_for_expensive_checkpoints() -> None:
    young = math.sqrt(2 * 60.0 * 3600.0)
    assert young_daly_interval(60.0, 3600.0) < young


def test_no_failures_means_no_interval() -> None:
    assert young_daly_interval(5.0, math.inf) == math.inf


@pytest.mark.parametrize(
    ("cost", "mtbf", "message"),
    [
        (-1.0, 3600.0, "checkpoint_cost_s -1.0"),
        (math.nan, 3600.0, "checkpoint_cost_s nan"),
        (1.0, 0.0, "mtbf_s 0.0"),
        (1.0, -5.0, "mtbf_s -5.0"),
    ],
)
def test_young_daly_rejects_bad_input(cost: float, mtbf: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        young_daly_interval(cost, mtbf)


# (step seconds, flush cost, failures per hour, min, max, expected steps)
STEPS = [
    (1.0, 10.0, 1.0, 1, 10_000, 262),  # T=261.7 s of 1 s steps
    (2.0, 10.0, 1.0, 1, 10_000, 131),
    (0.5, 1.0, 1.0, 1, 10_000, 168),  # T=84.19 s
    (1.0, 10.0, 1.0, 1, 100, 100),  # clamped above
    (100.0, 1.0, 1.0, 5, 10_000, 5),  # clamped below
    (1.0, 10.0, 0.0, 1, 500, 500),  # no failures observed: as rarely as allowed
    (1.0, 0.0, 10.0, 3, 100, 3),  # free flushes: as often as allowed
    (1.0, 60.0, 24.0, 1, 10_000, 97),  # M=150 s, C=60: Daly gives 97.1 s, Young 134.2 s
]


@pytest.mark.parametrize(("step_s", "cost", "rate", "lo", "hi", "expected"), STEPS)
def test_durable_every_steps(
    step_s: float, cost: float, rate: float, lo: int, hi: int, expected: int
) -> None:
    assert durable_every_steps(step_s, cost, rate, lo, hi) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.0, 1.0, 1.0, 1, 10), "step_seconds 0.0"),
        ((1.0, 1.0, -1.0, 1, 10), "failures_per_hour -1.0"),
        ((1.0, 1.0, 1.0, 0, 10), "min_steps 0"),
        ((1.0, 1.0, 1.0, 20, 10), "max_steps 10"),
    ],
)
def test_durable_every_steps_rejects_bad_input(
    args: tuple[float, float, float, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        durable_every_steps(*args)
