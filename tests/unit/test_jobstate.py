"""The job state machine as data."""

from __future__ import annotations

import itertools

import pytest

from pitstop.scheduler.domain import TERMINAL_JOB_STATES, JobState
from pitstop.scheduler.errors import FailedPrecondition
from pitstop.scheduler.jobstate import LEGAL_TRANSITIONS, check_user_action, is_legal

S = JobState


def test_every_state_has_a_row_and_terminal_states_lead_nowhere() -> None:
    assert set(LEGAL_TRANSITIONS) == set(JobState)
    for state in TERMINAL_JOB_STATES:
        assert LEGAL_TRANSITIONS[state] == frozenset()


def test_every_live_state_can_be_cancelled_or_fail() -> None:
    for state in set(JobState) - TERMINAL_JOB_STATES:
        assert is_legal(state, S.CANCELLED)
        assert is_legal(state, S.FAILED)


def test_the_designed_path_is_legal() -> None:
    path = [S.PENDING, S.PLACED, S.STARTING, S.RUNNING, S.RECOVERING, S.RUNNING, S.PAUSED]
    path += [S.RUNNING, S.SUCCEEDED]
    for current, target in itertools.pairwise(path):
        assert is_legal(current, target), (current, target)


def test_no_shortcuts() -> None:
    assert not is_legal(S.PENDING, S.RUNNING)
    assert not is_legal(S.RECOVERING, S.PAUSED)
    assert not is_legal(S.PAUSED, S.SUCCEEDED)


@pytest.mark.parametrize(
    ("state", "action", "target"),
    [
        (S.PENDING, "cancel", S.CANCELLED),
        (S.RUNNING, "cancel", S.CANCELLED),
        (S.RUNNING, "pause", S.PAUSED),
        (S.PAUSED, "resume", S.RUNNING),
        (S.RECOVERING, "cancel", S.CANCELLED),
    ],
)
def test_user_actions(state: JobState, action: str, target: JobState) -> None:
    assert check_user_action("j-1", state, action) is target


@pytest.mark.parametrize(
    ("state", "action", "says"),
    [
        (S.CANCELLED, "cancel", "already ended"),
        (S.SUCCEEDED, "cancel", "already ended"),
        (S.PENDING, "pause", "only a running job can be paused"),
        (S.RECOVERING, "pause", "only a running job can be paused"),
        (S.RUNNING, "resume", "only a paused job can be resumed"),
    ],
)
def test_illegal_user_actions_say_why(state: JobState, action: str, says: str) -> None:
    with pytest.raises(FailedPrecondition, match=says):
        check_user_action("j-1", state, action)
