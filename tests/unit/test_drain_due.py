"""When a draining node's ranks move: at a moment their job's newest step is committed
(no step given up), or past the drain's wait from the committed step; never before
anything is committed."""

from __future__ import annotations

from pitstop.scheduler.db import models
from pitstop.scheduler.reconcile.recovery import DRAIN_WAIT_SECONDS, drain_due


def job(committed: int, current: int) -> models.Job:
    return models.Job(committed_step=committed, current_step=current)


def test_a_drain_moves_when_the_newest_step_is_committed() -> None:
    assert drain_due(job(committed=40, current=40), draining_seconds=0.5)
    assert not drain_due(job(committed=40, current=41), draining_seconds=0.5)


def test_a_drain_whose_commits_lag_moves_from_the_committed_step_after_the_wait() -> None:
    assert not drain_due(job(committed=40, current=43), DRAIN_WAIT_SECONDS - 0.1)
    assert drain_due(job(committed=40, current=43), DRAIN_WAIT_SECONDS)


def test_nothing_committed_keeps_the_ranks_where_they_are() -> None:
    assert not drain_due(job(committed=0, current=0), draining_seconds=0.0)
    assert not drain_due(job(committed=0, current=7), DRAIN_WAIT_SECONDS * 10)


def test_a_decision_asks_again_with_the_step_it_would_restore() -> None:
    # The pass read the job at its committed newest step; by the decision's lock it has
    # stepped on: moving from an older step would give those steps up.
    stepped_on = job(committed=40, current=42)
    assert drain_due(stepped_on, draining_seconds=0.5, restore_step=42)
    assert not drain_due(stepped_on, draining_seconds=0.5, restore_step=41)
    assert drain_due(stepped_on, DRAIN_WAIT_SECONDS, restore_step=41)
