"""Goodput from a job's events: productive time, and per incident (every recovery,
restart and fallback) its kind, detect, decide and resume times, steps redone and
outcome."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st

from pitstop.health.goodput import (
    MAX_STORED_INCIDENTS,
    Goodput,
    IncidentKind,
    JobEvent,
    Outcome,
    account,
    incident_attributes,
)
from pitstop.v1 import jobs_pb2

NODE, RANK, FALLBACK = IncidentKind.NODE, IncidentKind.RANK_EXIT, IncidentKind.FALLBACK
RESUMED, SUPERSEDED, IN_PROGRESS = Outcome.RESUMED, Outcome.SUPERSEDED, Outcome.IN_PROGRESS


def transition(t: float, src: str, dst: str, **attrs: str) -> JobEvent:
    return JobEvent(t, f"job.{dst}", src, dst, attrs)


def failure(t: float, *, failed: float, detected: float, lost: int) -> dict[str, str]:
    return incident_attributes(
        cause="node lost", failed_at=failed, detected_at=detected, lost_steps=lost
    )


# The events the scheduler writes, by what they record. `t` is the decision's time; the
# failure is noticed 0.2 s before it and happened 0.5 s before that.
def running(t: float, src: str = "recovering") -> JobEvent:
    return JobEvent(t, "job.recovered" if src == "recovering" else "job.running", src, "running")


def node_lost(t: float, src: str = "running", node: str = "n2", lost: int = 1) -> JobEvent:
    attrs = incident_attributes(
        cause=f"{node} lost", failed_at=t - 0.7, detected_at=t - 0.2, lost_steps=lost
    )
    if src == "recovering":
        return JobEvent(t, "job.reconfigured", "", "", {"generation": "3", **attrs})
    return JobEvent(t, "job.recovering", src, "recovering", attrs, "n2 (lost): moved to n9")


def waiting(t: float, src: str = "running") -> JobEvent:
    reason = "waiting for capacity: no spare and no shrink left"
    return JobEvent(t, "job.recovering", src, "recovering", {"generation": "2"}, reason)


def rank_exit(t: float, src: str = "running", lost: int = 2) -> JobEvent:
    attrs = incident_attributes(
        cause="rank 3 exited with code 1", failed_at=t, detected_at=t, lost_steps=lost
    )
    to = "recovering" if src != "recovering" else ""
    return JobEvent(t, "job.restarting", src if to else "", to, attrs, "rank 3 exited; restart")


def fallback(t: float, src: str = "recovering", lost: int = 3) -> JobEvent:
    attrs = {
        "fallback": "true",
        **incident_attributes(
            cause="the recovery did not resume before its deadline",
            failed_at=t,
            detected_at=t,
            lost_steps=lost,
        ),
    }
    to = "recovering" if src != "recovering" else ""
    return JobEvent(t, "job.restarting", src if to else "", to, attrs)


def legacy_fallback(t: float) -> JobEvent:
    # What a scheduler before `fallback="true"` wrote: no incident data at all.
    reason = "the in-place recovery did not resume within 30s: restarting every rank"
    return JobEvent(t, "job.restarting", "", "", {"generation": "4"}, reason)


def ends(t: float, src: str, dst: str) -> JobEvent:
    return JobEvent(t, f"job.{dst}", src, dst)


START = [transition(0.0, "placed", "starting"), running(1.0, "starting")]


def summary(goodput: Goodput) -> list[tuple[IncidentKind, Outcome, bool]]:
    return [(i.kind, i.outcome, i.resumed) for i in goodput.incidents]


SCENARIOS: list[tuple[str, list[JobEvent], list[tuple[IncidentKind, Outcome, bool]], int]] = [
    ("fault free", [ends(9.0, "running", "succeeded")], [], 0),
    (
        "four restarts, each resumed",
        [e for t in (10.0, 20.0, 30.0, 40.0) for e in (rank_exit(t), running(t + 2))],
        [(RANK, RESUMED, True)] * 4,
        4,
    ),
    (
        "a crash loop: four restarts, none resumed, the job fails",
        [
            rank_exit(10.0),
            rank_exit(11.0, "recovering"),
            rank_exit(13.0, "recovering"),
            rank_exit(17.0, "recovering"),
            ends(25.0, "recovering", "failed"),
        ],
        [(RANK, SUPERSEDED, False)] * 3 + [(RANK, Outcome.JOB_FAILED, False)],
        0,
    ),
    (
        "a node recovery misses its deadline and falls back",
        [node_lost(10.0), fallback(40.0), running(45.0)],
        [(NODE, SUPERSEDED, False), (FALLBACK, RESUMED, True)],
        1,
    ),
    (
        "a fallback of an earlier scheduler, without incident data",
        [node_lost(10.0), legacy_fallback(40.0), running(45.0)],
        [(NODE, SUPERSEDED, False), (FALLBACK, RESUMED, True)],
        1,
    ),
    (
        "two fallbacks, then the job fails",
        [node_lost(10.0), fallback(40.0), fallback(70.0), ends(100.0, "recovering", "failed")],
        [
            (NODE, SUPERSEDED, False),
            (FALLBACK, SUPERSEDED, False),
            (FALLBACK, Outcome.JOB_FAILED, False),
        ],
        0,
    ),
    (
        "a start that never steps falls back",
        [transition(0.0, "placed", "starting"), fallback(30.0, "starting"), running(33.0)],
        [(FALLBACK, RESUMED, True)],
        0,
    ),
    (
        "a node fails during a node recovery",
        [node_lost(10.0), node_lost(11.5, "recovering", "n3"), running(13.0)],
        [(NODE, SUPERSEDED, False), (NODE, RESUMED, True)],
        2,
    ),
    (
        "a rank exits during a node recovery",
        [node_lost(10.0), rank_exit(11.0, "recovering"), running(14.0)],
        [(NODE, SUPERSEDED, False), (RANK, RESUMED, True)],
        2,
    ),
    (
        "a wait for capacity ends in a decision: one incident",
        [waiting(10.0), node_lost(50.0, "recovering"), running(53.0)],
        [(NODE, RESUMED, True)],
        1,
    ),
    (
        "a wait for capacity is cancelled",
        [waiting(10.0), ends(50.0, "recovering", "cancelled")],
        [(NODE, Outcome.JOB_CANCELLED, False)],
        0,
    ),
    (
        "a rank exits while waiting for capacity",
        [waiting(10.0), rank_exit(20.0, "recovering"), running(22.0)],
        [(NODE, SUPERSEDED, False), (RANK, RESUMED, True)],
        2,
    ),
    (
        "the ranks finish before reporting a step",
        [node_lost(10.0), ends(12.0, "recovering", "succeeded")],
        [(NODE, Outcome.JOB_SUCCEEDED, True)],
        1,
    ),
    (
        "a recovery under way",
        [rank_exit(10.0), running(12.0), node_lost(20.0)],
        [(RANK, RESUMED, True), (NODE, IN_PROGRESS, False)],
        1,
    ),
    (
        "a node fails while paused",
        [ends(5.0, "running", "paused"), node_lost(8.0, "paused"), running(10.0)],
        [(NODE, RESUMED, True)],
        1,
    ),
]


@pytest.mark.parametrize(
    ("events", "incidents", "recoveries"),
    [s[1:] for s in SCENARIOS],
    ids=[s[0] for s in SCENARIOS],
)
def test_every_decision_is_an_incident_with_its_outcome(
    events: list[JobEvent],
    incidents: list[tuple[IncidentKind, Outcome, bool]],
    recoveries: int,
) -> None:
    history = events if events[0].kind == "job.starting" else START + events
    goodput = account(history, now=200.0, step_seconds=0.1)
    assert summary(goodput) == incidents
    assert goodput.recoveries == recoveries


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
    assert (incident.decided_at, incident.resumed_at, incident.ended_at) == (11.5, 14.0, 14.0)
    assert goodput.detect_seconds == pytest.approx(1.2)
    assert goodput.recovery_seconds == pytest.approx(2.8)
    assert goodput.recompute_seconds == pytest.approx(1.0)
    # running 0..10 and 14..20, less the two steps redone
    assert goodput.productive_seconds == pytest.approx(16.0 - 1.0)
    assert goodput.recoveries == 1
    assert goodput.ratio == pytest.approx(15.0 / (15.0 + 1.2 + 2.8 + 1.0))


def restored(t: float, at: float) -> JobEvent:
    return JobEvent(t, "job.restored", "", "", {"generation": "2", "restored_at": f"{at:.6f}"})


def test_the_ranks_restore_splits_the_resume_into_restore_and_re_form() -> None:
    events = [
        transition(0.0, "starting", "running"),
        transition(
            11.5, "running", "recovering", **failure(11.5, failed=10.0, detected=11.2, lost=2)
        ),
        transition(14.0, "recovering", "running"),
        restored(14.3, at=12.9),  # every rank reported: the last restored at 12.9
        transition(20.0, "running", "succeeded"),
    ]
    goodput = account(events, now=30.0, step_seconds=0.5)
    (incident,) = goodput.incidents
    assert incident.restore_seconds == pytest.approx(1.4)
    assert incident.reform_seconds == pytest.approx(1.1)
    assert incident.restore_seconds + incident.reform_seconds == pytest.approx(2.5)
    stored = incident.to_json()
    assert (stored["restore_seconds"], stored["reform_seconds"]) == (1.4, 1.1)
    # The event changes no total: the resume was already counted.
    assert goodput.recovery_seconds == pytest.approx(2.8)


def test_a_restore_time_from_a_skewed_clock_stays_inside_the_resume() -> None:
    base = [
        transition(0.0, "starting", "running"),
        transition(
            11.5, "running", "recovering", **failure(11.5, failed=10.0, detected=11.2, lost=2)
        ),
        transition(14.0, "recovering", "running"),
    ]
    (early,) = account([*base, restored(14.3, at=9.0)], now=30.0, step_seconds=0.5).incidents
    assert (early.restore_seconds, early.reform_seconds) == (0.0, 2.5)
    (late,) = account([*base, restored(14.3, at=99.0)], now=30.0, step_seconds=0.5).incidents
    assert (late.restore_seconds, late.reform_seconds) == (2.5, 0.0)


def test_a_restore_after_a_newer_decision_belongs_to_no_incident() -> None:
    events = [
        transition(0.0, "starting", "running"),
        transition(
            11.5, "running", "recovering", **failure(11.5, failed=10.0, detected=11.2, lost=2)
        ),
        transition(14.0, "recovering", "running"),
        rank_exit(15.0),
        restored(15.5, at=13.0),
    ]
    first, second = account(events, now=30.0, step_seconds=0.5).incidents
    assert (first.restored_at, second.restored_at) == (None, None)
    assert first.restore_seconds is None


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
    first, second = goodput.incidents
    assert (first.outcome, first.ended_at, first.resume_seconds) == (SUPERSEDED, 11.5, None)
    assert (second.outcome, second.resume_seconds) == (RESUMED, pytest.approx(1.5))


def test_an_open_recovery_counts_up_to_now_and_is_not_yet_a_recovery() -> None:
    events = [
        transition(0.0, "starting", "running"),
        transition(5.5, "running", "recovering", **failure(5.5, failed=5.0, detected=5.4, lost=0)),
    ]
    goodput = account(events, now=8.0, step_seconds=0.1)
    assert goodput.productive_seconds == pytest.approx(5.0)
    assert goodput.recovery_seconds == pytest.approx(8.0 - 5.4)
    assert goodput.recoveries == 0
    stored = goodput.to_json()["incidents"][0]
    assert stored["resumed"] is False
    assert stored["outcome"] == "INCIDENT_OUTCOME_IN_PROGRESS"
    assert (stored["decided_at"], stored["resumed_at"], stored["ended_at"]) == (5.5, 0.0, 0.0)


def test_a_job_that_failed_recovering_stops_losing_time_when_it_failed() -> None:
    events = [*START, rank_exit(10.0), rank_exit(12.0, "recovering")]
    failed = account([*events, ends(15.0, "recovering", "failed")], now=500.0, step_seconds=0)
    assert failed.recovery_seconds == pytest.approx(5.0)
    assert failed.incidents[-1].ended_at == 15.0
    assert account(events, now=500.0, step_seconds=0).recovery_seconds == pytest.approx(490.0)


def test_a_wait_for_capacity_is_decided_by_the_node_decision_that_ends_it() -> None:
    events = [*START, waiting(10.0), node_lost(50.0, "recovering"), running(53.0)]
    (incident,) = account(events, now=60.0, step_seconds=0.1).incidents
    assert incident.cause == "n2 lost"
    assert (incident.failed_at, incident.detected_at) == (pytest.approx(49.3), 49.8)
    assert (incident.decided_at, incident.resumed_at) == (50.0, 53.0)
    undecided = account([*START, waiting(10.0)], now=60.0, step_seconds=0.1).incidents[0]
    assert undecided.cause == "waiting for capacity: no spare and no shrink left"
    assert (undecided.decided_at, undecided.detect_seconds, undecided.outcome) == (
        None,
        None,
        IN_PROGRESS,
    )


def test_a_fallback_without_incident_data_names_its_reason() -> None:
    events = [*START, node_lost(10.0), legacy_fallback(40.0)]
    fallen = account(events, now=41.0, step_seconds=0.1).incidents[-1]
    assert fallen.cause.startswith("the in-place recovery did not resume")
    assert (fallen.failed_at, fallen.decided_at, fallen.detect_seconds) == (None, 40.0, None)


def test_malformed_incident_numbers_are_unknown_not_fatal() -> None:
    attrs = {"incident.failed_at": "soon", "incident.lost_steps": "nan", "incident.cause": "x"}
    events = [*START, JobEvent(10.0, "job.restarting", "running", "recovering", attrs)]
    (incident,) = account(events, now=11.0, step_seconds=0.1).incidents
    assert (incident.kind, incident.failed_at, incident.lost_steps) == (RANK, None, 0)


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


def test_the_stored_account_is_the_proto_and_keeps_the_newest_incidents() -> None:
    loop = [e for t in range(60) for e in (rank_exit(10.0 + 3 * t), running(11.0 + 3 * t))]
    goodput = account([*START, *loop, node_lost(500.0)], now=501.0, step_seconds=0.1)
    stored = goodput.to_json()
    parsed = json_format.ParseDict(stored, jobs_pb2.Goodput())  # no unknown keys
    assert parsed.incident_count == 61
    assert len(parsed.incidents) == MAX_STORED_INCIDENTS
    newest = parsed.incidents[-1]
    assert newest.kind == jobs_pb2.INCIDENT_KIND_NODE
    assert newest.outcome == jobs_pb2.INCIDENT_OUTCOME_IN_PROGRESS
    assert parsed.incidents[0].kind == jobs_pb2.INCIDENT_KIND_RANK_EXIT
    assert parsed.incidents[0].outcome == jobs_pb2.INCIDENT_OUTCOME_RESUMED


DECISIONS = {"node": node_lost, "rank": rank_exit, "fallback": fallback}
ENDS = ("running", "failed", "cancelled", "succeeded")


@given(st.lists(st.sampled_from([*DECISIONS, *ENDS]), max_size=30))
def test_any_history_lists_each_decision_once_and_settles_all_but_the_last(
    script: list[str],
) -> None:
    events: list[JobEvent] = list(START)
    state, t, decisions = "running", 1.0, 0
    for step in script:
        t += 1.0
        if step in DECISIONS:
            events.append(DECISIONS[step](t, state))
            state, decisions = "recovering", decisions + 1
        elif step != state:
            events.append(running(t, state) if step == "running" else ends(t, state, step))
            state = step
        if state in ("failed", "cancelled", "succeeded"):
            break
    goodput = account(events, now=t + 1.0, step_seconds=0.1)
    assert len(goodput.incidents) == decisions
    outcomes = [i.outcome for i in goodput.incidents]
    assert IN_PROGRESS not in outcomes[:-1]
    assert (outcomes[-1:] == [IN_PROGRESS]) == (bool(outcomes) and state == "recovering")
    assert all(i.ended_at is not None for i in goodput.incidents if i.outcome != IN_PROGRESS)
    assert 0.0 <= goodput.ratio <= 1.0
    stored: dict[str, Any] = goodput.to_json()
    json_format.ParseDict(stored, jobs_pb2.Goodput())
