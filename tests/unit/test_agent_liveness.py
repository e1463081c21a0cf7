"""A node daemon's liveness from its probes, the restart backoff, and node conditions
folded into the heartbeat's health (pitstop.agent.liveness, pitstop.agent.conditions)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.agent.conditions import NodeCondition, with_conditions
from pitstop.agent.liveness import DaemonLiveness, Liveness, RestartBackoff
from pitstop.v1 import common_pb2

UP, DOWN, UNKNOWN = Liveness.UP, Liveness.DOWN, Liveness.UNKNOWN
HEALTHY = common_pb2.HEALTH_VERDICT_HEALTHY
APPLICATION = common_pb2.HEALTH_VERDICT_APPLICATION
WARNING = common_pb2.HEALTH_VERDICT_WARNING
FATAL = common_pb2.HEALTH_VERDICT_FATAL


def run(events: list[tuple[float, str]], misses: int = 3, grace: float = 10.0) -> DaemonLiveness:
    """Feed (time, what) events: "ok" an answer, "miss" a missed probe, "start" and
    "exit" the owned process."""
    live = DaemonLiveness(misses, grace, watching_since=0.0)
    for now, what in events:
        if what == "ok":
            live.answered(now)
        elif what == "miss":
            live.missed(now, "UNAVAILABLE: Connection refused")
        elif what == "start":
            live.started(now)
        else:
            live.exited(now, "its process was killed by signal 9 (SIGKILL)")
    return live


@pytest.mark.parametrize(
    ("events", "state", "cause"),
    [
        ([], UNKNOWN, ""),
        ([(0.1, "ok")], UP, ""),
        # Starting beside the agent: misses within the grace leave it unknown ...
        ([(1, "miss"), (2, "miss"), (3, "miss"), (4, "miss")], UNKNOWN, ""),
        # ... and once the grace is over it is down, saying so.
        (
            [(t, "miss") for t in (1, 2, 3, 11)],
            DOWN,
            "never answered in 11 s of probes: UNAVAILABLE: Connection refused",
        ),
        # Once up, a miss or two is no outage; three in a row are.
        ([(1, "ok"), (2, "miss"), (3, "miss")], UP, ""),
        ([(1, "ok"), (2, "miss"), (3, "miss"), (4, "ok"), (5, "miss"), (6, "miss")], UP, ""),
        (
            [(1, "ok"), (2, "miss"), (3, "miss"), (4, "miss")],
            DOWN,
            "3 probes in a row unanswered: UNAVAILABLE: Connection refused",
        ),
        # The cause is the one from when the outage began, however long it lasts.
        (
            [(1, "ok"), (2, "miss"), (3, "miss"), (4, "miss"), (5, "miss")],
            DOWN,
            "3 probes in a row unanswered: UNAVAILABLE: Connection refused",
        ),
        ([(1, "ok"), (2, "miss"), (3, "miss"), (4, "miss"), (5, "ok")], UP, ""),
        # An owned process that exits is down at once, even before it ever answered.
        ([(1, "start"), (2, "exit")], DOWN, "its process was killed by signal 9 (SIGKILL)"),
        (
            [(1, "start"), (2, "ok"), (3, "exit")],
            DOWN,
            "its process was killed by signal 9 (SIGKILL)",
        ),
        # A restarted process keeps the node down until it answers.
        ([(1, "start"), (2, "ok"), (3, "exit"), (4, "start"), (5, "miss")], DOWN, "its"),
        ([(1, "start"), (2, "ok"), (3, "exit"), (4, "start"), (5, "ok")], UP, ""),
        # The grace counts from the owned process's start.
        ([(1, "miss"), (8, "start"), (9, "miss"), (10, "miss"), (12, "miss")], UNKNOWN, ""),
        (
            [(8, "start"), *[(t, "miss") for t in (9, 10, 18)]],
            DOWN,
            "never answered in 10 s since the agent started it",
        ),
    ],
)
def test_liveness_follows_the_probes_and_the_process(
    events: list[tuple[float, str]], state: Liveness, cause: str
) -> None:
    live = run(events)
    assert live.state is state
    assert live.cause.startswith(cause) if cause else live.cause == ""
    assert (live.down_since is not None) == (state is DOWN)


def test_changes_are_reported_once() -> None:
    live = DaemonLiveness(2, 0.0, watching_since=0.0)
    assert live.answered(1) is True
    assert live.answered(2) is False
    assert live.missed(3, "x") is False
    assert live.missed(4, "x") is True
    assert live.missed(5, "x") is False
    assert live.exited(6, "gone") is False  # already down: the first cause stays
    assert live.cause == "2 probes in a row unanswered: x"
    assert live.answered(7) is True


def test_every_outage_is_reported_at_least_once() -> None:
    live = DaemonLiveness(1, 0.0, watching_since=0.0)
    live.answered(1)
    assert live.report() == ""
    live.missed(2, "gone")
    assert live.report() == live.report() == "1 probes in a row unanswered: gone"  # while down
    live.answered(3)
    assert live.report() == ""
    # Down and back between two reports: the next report still tells, once.
    live.exited(4, "its process exited with code 1")
    live.answered(5)
    assert live.report() == "its process exited with code 1"
    assert live.report() == ""


def test_silence_counts_from_the_last_answer_or_start() -> None:
    live = DaemonLiveness(3, 10.0, watching_since=0.0)
    assert live.silent_for(5.0) == 0.0
    live.started(2.0)
    assert live.silent_for(5.0) == 3.0
    live.answered(4.0)
    assert live.silent_for(34.0) == 30.0
    live.started(40.0)
    assert live.silent_for(41.0) == 1.0


@pytest.mark.parametrize(
    ("events", "now", "hung"),
    [
        ([], 100.0, False),  # the agent runs no process: never its to kill
        ([(0, "ok")], 100.0, False),
        # Answered since its start, then silent: hung after hang_seconds (30).
        ([(0, "start"), (1, "ok")], 30.9, False),
        ([(0, "start"), (1, "ok")], 31.0, True),
        ([(0, "start"), (1, "ok"), (20, "miss")], 31.0, True),
        # Never answered since its start: a slow start gets start_seconds (60).
        ([(0, "start")], 59.0, False),
        ([(0, "start")], 60.0, True),
        # An answer before the latest start does not count for it.
        ([(0, "start"), (1, "ok"), (2, "exit"), (3, "start")], 40.0, False),
        ([(0, "start"), (1, "ok"), (2, "exit"), (3, "start")], 63.0, True),
    ],
)
def test_a_started_process_is_hung_after_its_silence_or_a_start_too_slow(
    events: list[tuple[float, str]], now: float, hung: bool
) -> None:
    assert run(events).hung(now, hang_seconds=30.0, start_seconds=60.0) is hung


def test_a_threshold_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="misses_to_down is 0"):
        DaemonLiveness(0, 1.0, watching_since=0.0)


@given(st.lists(st.booleans(), max_size=60), st.integers(min_value=1, max_value=5))
def test_down_exactly_when_the_last_misses_are_enough(answers: list[bool], misses: int) -> None:
    # Past the grace: the daemon is down iff the last `misses` probes all went
    # unanswered, or it went down earlier and has not answered since.
    live = DaemonLiveness(misses, 0.0, watching_since=0.0)
    run_of_misses = 0
    was_down = False
    for now, answered in enumerate(answers, start=1):
        if answered:
            live.answered(now)
            run_of_misses, was_down = 0, False
        else:
            live.missed(now, "x")
            run_of_misses += 1
            was_down = was_down or run_of_misses >= misses
        assert (live.state is DOWN) == was_down


@pytest.mark.parametrize(
    ("runs", "delays"),
    [
        ([0, 0, 0, 0, 0, 0, 0, 0], [0.5, 1, 2, 4, 8, 16, 30, 30]),
        # A run that lasted `stable` seconds starts the delays over.
        ([0, 0, 0, 60, 0], [0.5, 1, 2, 0.5, 1]),
        ([59.9, 59.9], [0.5, 1]),
    ],
)
def test_restarts_back_off_and_start_over_after_a_stable_run(
    runs: list[float], delays: list[float]
) -> None:
    backoff = RestartBackoff(first=0.5, longest=30.0, stable=60.0)
    assert [backoff.after_exit(ran) for ran in runs] == delays


def test_a_backoff_without_a_positive_first_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="0 < first <= longest"):
        RestartBackoff(first=0.0)


def _health(verdict: common_pb2.HealthVerdict, *reasons: str) -> common_pb2.NodeHealth:
    gpu = common_pb2.GpuHealth(index=0, verdict=verdict, reasons=reasons)
    return common_pb2.NodeHealth(verdict=verdict, reasons=reasons, gpus=[gpu])


DEGRADED = common_pb2.HEALTH_VERDICT_DEGRADED
DAEMON_DOWN = NodeCondition(DEGRADED, "checkpoint daemon at 127.0.0.1:7000 is down: gone")


@pytest.mark.parametrize(
    ("gpus", "conditions", "verdict", "reasons"),
    [
        (_health(HEALTHY), [], HEALTHY, []),
        (_health(HEALTHY), [DAEMON_DOWN], DEGRADED, [DAEMON_DOWN.reason]),
        # A down daemon is less severe than a failed rank: APPLICATION stays.
        (
            _health(APPLICATION, "GPU 0: Xid 13"),
            [DAEMON_DOWN],
            APPLICATION,
            ["GPU 0: Xid 13", DAEMON_DOWN.reason],
        ),
        # A worse GPU verdict stays; the reason is added all the same.
        (_health(FATAL, "GPU 0: lost"), [DAEMON_DOWN], FATAL, ["GPU 0: lost", DAEMON_DOWN.reason]),
        (
            _health(HEALTHY),
            [DAEMON_DOWN, NodeCondition(WARNING, "other")],
            WARNING,
            [DAEMON_DOWN.reason, "other"],
        ),
    ],
)
def test_conditions_add_their_reasons_and_raise_the_verdict(
    gpus: common_pb2.NodeHealth,
    conditions: list[NodeCondition],
    verdict: common_pb2.HealthVerdict,
    reasons: list[str],
) -> None:
    before = common_pb2.NodeHealth()
    before.CopyFrom(gpus)
    merged = with_conditions(gpus, conditions)
    assert merged.verdict == verdict
    assert list(merged.reasons) == reasons
    assert list(merged.gpus) == list(gpus.gpus)
    assert gpus == before  # the input is left alone
