"""Goodput from a job's events: productive time, and per failure detect, decide, resume
and the cost of redone steps."""

from __future__ import annotations

import pytest

from pitstop.health.goodput import JobEvent, account, incident_attributes


def transition(t: float, src: str, dst: str, **attrs: str) -> JobEvent:
    return JobEvent(t, f"job.{dst}", src, dst, attrs)


def failure(t: float, *, failed: float, detected: float, lost: int) -> dict[str, str]:
    return incident_attributes(
        cause="node lost", failed_at=failed, detected_at=detected, lost_steps=lost
    )


def test_a_fault_free_run_is_all_productive() -> None:
    events = [
        transition(0.0, "placed", "starting"),
        transition(2.0, "starting", "running"),
        transition(12.0, "running", "succeeded"),
    ]
    goodput = account(events, now=50.0, step_seconds=0.1)
    assert goodput.productive_seconds == pytest.approx(10.0)
    assert goodput.ratio == pytest.approx(1.0)
    assert goodput.recoveries == 0


def test_one_recovery_splits_into_detect_decide_resume_and_recompute() -> None:
    events = [
        transition(0.0, "starting", "running"),
        # failed at 10.0, noticed at 11.2, decision committed at 11.5
        transition(
            11.5, "running", "recovering", **failure(11.5, failed=10.0, detected=11.2, lost=2)
        ),
        transition(14.0, "recovering", "running"),
        transition(20.0, "running", "succeeded"),
    ]
    goodput = account(events, now=30.0, step_seconds=0.5)
    (incident,) = goodput.incidents
    assert incident.detect_seconds == pytest.approx(1.2)
    assert incident.decide_seconds == pytest.approx(0.3)
    assert incident.resume_seconds == pytest.approx(2.5)
    assert goodput.detect_seconds == pytest.approx(1.2)
    assert goodput.recovery_seconds == pytest.approx(2.8)
    assert goodput.recompute_seconds == pytest.approx(1.0)
    # running 0..10 and 14..20, less the two steps redone
    assert goodput.productive_seconds == pytest.approx(16.0 - 1.0)
    assert goodput.recoveries == 1
    assert goodput.ratio == pytest.approx(15.0 / (15.0 + 1.2 + 2.8 + 1.0))


def test_a_failure_during_a_recovery_is_not_counted_twice() -> None:
    events = [
        transition(0.0, "starting", "running"),
        transition(
            10.5, "running", "recovering", **failure(10.5, failed=10.0, detected=10.4, lost=1)
        ),
        JobEvent(
            11.5, "job.reconfigured", "", "", failure(11.5, failed=11.0, detected=11.3, lost=1)
        ),
        transition(13.0, "recovering", "running"),
    ]
    goodput = account(events, now=13.0, step_seconds=0.0)
    assert goodput.detect_seconds == pytest.approx(0.4)
    assert goodput.recovery_seconds == pytest.approx(13.0 - 10.4)
    assert goodput.recoveries == 2
    assert len(goodput.incidents) == 2


def test_an_open_recovery_counts_up_to_now_and_is_not_yet_a_recovery() -> None:
    events = [
        transition(0.0, "starting", "running"),
        transition(5.5, "running", "recovering", **failure(5.5, failed=5.0, detected=5.4, lost=0)),
    ]
    goodput = account(events, now=8.0, step_seconds=0.1)
    assert goodput.productive_seconds == pytest.approx(5.0)
    assert goodput.recovery_seconds == pytest.approx(8.0 - 5.4)
    assert goodput.recoveries == 0
    assert goodput.to_json()["incidents"][0]["resumed"] is False


def test_paused_time_is_neither_productive_nor_lost() -> None:
    events = [
        transition(0.0, "starting", "running"),
        transition(4.0, "running", "paused"),
        transition(9.0, "paused", "running"),
        transition(10.0, "running", "succeeded"),
    ]
    goodput = account(events, now=10.0, step_seconds=0.1)
    assert goodput.productive_seconds == pytest.approx(5.0)
    assert goodput.lost_seconds == 0.0
