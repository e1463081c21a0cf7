"""bench/soak.py's slopes: per hour, from each process's own warm-up on, none for a
series too short to say anything about an hour, and descriptors that come and go with
the work are not growth."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench.* as soak.py imports it
from bench._soak_samples import Series, fitted, growth, process_name, slope_per_hour


def test_a_steady_leak_is_its_rate_per_hour() -> None:
    points = [(60.0 * i, 100 + 0.1 * i) for i in range(30)]  # 0.1 MB a minute
    assert slope_per_hour(points) == pytest.approx(6.0)


def test_noise_around_a_flat_line_is_a_small_slope() -> None:
    points = [(60.0 * i, 100 + (0.5 if i % 2 else -0.5)) for i in range(50)]
    slope = slope_per_hour(points)
    assert slope is not None
    assert abs(slope) < 0.5


def test_one_sample_or_one_instant_has_no_slope() -> None:
    assert slope_per_hour([(0.0, 1.0)]) is None
    assert slope_per_hour([(5.0, 1.0), (5.0, 2.0)]) is None


def test_a_process_started_late_is_measured_from_its_own_warm_up() -> None:
    late = Series("agent-node-1[2]", started=1200.0)
    late.points = [(1200.0 + 60 * i, 50.0 + (40 if i < 10 else 0.01 * i)) for i in range(40)]
    slopes = fitted([late], warmup=600.0, min_span=300.0, measure=slope_per_hour)
    assert slopes["agent-node-1[2]"] == pytest.approx(0.6)  # its start-up bulge left out


def test_a_series_too_short_after_its_warm_up_gets_no_slope() -> None:
    rank = Series("rank@node-1[9]", started=0.0)
    rank.points = [(60.0 * i, 300.0 + 10 * i) for i in range(14)]  # 3 minutes after warm-up
    assert fitted([rank], warmup=600.0, min_span=300.0, measure=slope_per_hour) == {}


def test_descriptors_that_come_and_go_are_not_growth_but_a_new_level_is() -> None:
    churn = [(60.0 * i, 40.0 + (12 if i % 3 == 0 else 0)) for i in range(30)]
    assert growth(churn) == 0
    leak = [(60.0 * i, 40.0 + i) for i in range(30)]
    assert growth(leak) == 29 - 9
    assert growth(leak[:2]) is None


def test_processes_are_named_for_what_they_are() -> None:
    agent = ("/venv/bin/python", "/venv/bin/pitstop-agent", "--config", "a.yaml")
    assert process_name("agent-node-1", agent, rank=False, daemon_itself=True) == "agent-node-1"
    zygote = ("/venv/bin/python", "-m", "pitstop.agent.forkserver", "--socket", "/s")
    assert process_name("agent-node-1", zygote, False, False) == "zygote-node-1"
    assert process_name("agent-node-1", ("python", "train.py"), True, False) == "rank@node-1"
