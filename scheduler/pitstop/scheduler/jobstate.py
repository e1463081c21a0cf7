"""The job state machine of docs/architecture.md, as data: which transitions are legal.

PENDING -> PLACED -> STARTING -> RUNNING <-> RECOVERING, RUNNING <-> PAUSED,
then SUCCEEDED | FAILED | CANCELLED; a preempted job goes from RUNNING back to
PENDING. Any live state may be cancelled or fail; a job starting or recovering
succeeds when its ranks all finish before reporting a step.
"""

from __future__ import annotations

from pitstop.scheduler.domain import JobState
from pitstop.scheduler.errors import FailedPrecondition

S = JobState

LEGAL_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.PLACED, S.CANCELLED, S.FAILED}),
    # A placement can be taken back (its node died before the ranks started).
    S.PLACED: frozenset({S.STARTING, S.PENDING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.RECOVERING, S.SUCCEEDED, S.CANCELLED, S.FAILED}),
    # Back to PENDING: preempted for a higher-priority job, to resume when placed again.
    S.RUNNING: frozenset({S.RECOVERING, S.PAUSED, S.SUCCEEDED, S.FAILED, S.CANCELLED, S.PENDING}),
    S.RECOVERING: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.PAUSED: frozenset({S.RUNNING, S.RECOVERING, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}

# What a user asks for, and the state the request leads to.
_ACTION_TARGET = {"cancel": S.CANCELLED, "pause": S.PAUSED, "resume": S.RUNNING}


def is_legal(current: JobState, target: JobState) -> bool:
    """Whether a job in ``current`` may move to ``target``."""
    return target in LEGAL_TRANSITIONS[current]


def check_user_action(job_id: str, current: JobState, action: str) -> JobState:
    """The state a user action (cancel, pause, resume) leads to, or FailedPrecondition."""
    target = _ACTION_TARGET[action]
    if action == "resume" and current is not S.PAUSED:
        raise FailedPrecondition(
            f"job {job_id} is {current.value}; only a paused job can be resumed"
        )
    if action == "pause" and current is not S.RUNNING:
        raise FailedPrecondition(
            f"job {job_id} is {current.value}; only a running job can be paused"
        )
    if not is_legal(current, target):
        raise FailedPrecondition(
            f"job {job_id} already ended ({current.value}); it cannot be {action}ed"
            if current.terminal
            else f"job {job_id} cannot go from {current.value} to {target.value}"
        )
    return target
