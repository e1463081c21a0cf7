"""A rank restart's backoff grows with the job's recent restarts only."""

from __future__ import annotations

import pytest

from pitstop.scheduler.reconcile.recovery import restart_backoff


@pytest.mark.parametrize(
    ("recent", "seconds"),
    [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (50, 30.0)],
)
def test_the_first_restart_goes_at_once_and_a_crash_loop_backs_off_to_30_s(
    recent: int, seconds: float
) -> None:
    assert restart_backoff(recent) == seconds
