"""pitstop.health.massloss: when silent losses hold a job instead of replacing its nodes,
and which of a held job's nodes are replaced when they stay away."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.health.massloss import (
    MassLossPolicy,
    batch_left,
    due_replacements,
    settling,
    touches_job,
)

POLICY = MassLossPolicy(nodes=16, job_share=0.5, window_seconds=10, replace_after_seconds=60)


@pytest.mark.parametrize(
    ("fleet", "job", "job_nodes", "held", "why"),
    [
        (1, 1, 4, False, "one silent node is a dead host"),
        (1, 1, 1, False, "a one-node job's node dying alone is replaced"),
        (2, 2, 4, False, "half a small job is not more than half"),
        (3, 3, 4, True, "three of four nodes of a job"),
        (2, 2, 3, True, "two of three"),
        (15, 1, 1000, False, "a fleet losing 15 nodes stays below the count"),
        (16, 1, 1000, True, "16 silent in the fleet: every job touched is held"),
        (250, 20, 2496, True, "a tenth of a 2,500-node job cut off"),
        (40, 0, 100, False, "a job none of whose nodes went silent goes on"),
    ],
)
def test_when_a_job_is_held(fleet: int, job: int, job_nodes: int, held: bool, why: str) -> None:
    assert touches_job(POLICY, fleet, job, job_nodes) is held, why


@given(
    fleet=st.integers(0, 20_000),
    job_nodes=st.integers(1, 12_500),
    job=st.integers(0, 12_500),
)
def test_a_single_silent_node_alone_never_holds_its_job(
    fleet: int, job_nodes: int, job: int
) -> None:
    job = min(job, job_nodes, fleet)
    if job <= 1 and fleet < POLICY.nodes:
        assert not touches_job(POLICY, fleet, job, job_nodes)


@given(fleet=st.integers(0, 100), job=st.integers(0, 100), job_nodes=st.integers(1, 100))
def test_more_silence_never_releases_a_hold(fleet: int, job: int, job_nodes: int) -> None:
    job = min(job, job_nodes)
    if touches_job(POLICY, fleet, job, job_nodes):
        assert touches_job(POLICY, fleet + 1, min(job + 1, job_nodes), job_nodes)


def test_only_nodes_past_the_deadline_are_replaced_the_longest_away_first() -> None:
    away = {"n3": 61.0, "n1": 200.0, "n2": 59.9, "n4": 61.0, "n5": 60.0}
    assert due_replacements(POLICY, away, budget=10) == ["n1", "n3", "n4", "n5"]
    assert due_replacements(POLICY, away, budget=2) == ["n1", "n3"]
    assert due_replacements(POLICY, away, budget=0) == []
    assert due_replacements(POLICY, {"n2": 59.9}, budget=10) == []


def test_a_partition_confirmed_lost_over_a_moment_is_replaced_in_one_decision() -> None:
    """Nodes of one partition are confirmed lost a few hundred ms apart: once the first
    is due, those lost within settle_seconds after it go with it, the rest wait."""
    policy = MassLossPolicy(replace_after_seconds=1.0, settle_seconds=2.0)
    away = {"n1": 1.02, "n2": 0.98, "n3": 0.70}
    assert due_replacements(policy, away, budget=2) == ["n1", "n2"]
    assert due_replacements(policy, away, budget=10) == ["n1", "n2", "n3"]
    assert due_replacements(policy, {"n2": 0.98, "n3": 0.70}, budget=10) == []
    late = {"n1": 5.0, "n2": 1.5, "n3": 0.9}  # n3 lost long after the first: waits
    assert due_replacements(policy, late, budget=10) == ["n1", "n2"]


@given(
    away=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 200), max_size=8),
    budget=st.integers(0, 10),
)
def test_no_node_is_replaced_before_the_deadline_less_the_settle(
    away: dict[str, float], budget: int
) -> None:
    due = due_replacements(POLICY, away, budget)
    assert len(due) <= budget
    reach = POLICY.replace_after_seconds - POLICY.settle_seconds
    assert all(away[n] >= reach for n in due)
    if due:
        assert max(away.values()) >= POLICY.replace_after_seconds


def test_a_silent_loss_waits_to_settle_before_it_is_replaced() -> None:
    """The first node of a partition seen must not be replaced before the rest of it
    count: a silent loss younger than settle_seconds waits."""
    policy = MassLossPolicy(settle_seconds=2.0)
    assert settling(policy, {"n1": 0.1, "n2": 1.99, "n3": 2.0, "n4": 9.0}) == {"n1", "n2"}
    assert settling(MassLossPolicy(settle_seconds=0), {"n1": 0.0}) == set()


def test_the_batch_is_what_the_window_has_left() -> None:
    policy = MassLossPolicy(replace_batch=16)
    assert batch_left(policy, 0) == 16
    assert batch_left(policy, 10) == 6
    assert batch_left(policy, 40) == 0


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"nodes": 1}, "mass_loss_nodes=1"),
        ({"job_share": 0.0}, "mass_loss_job_share=0.0"),
        ({"job_share": 1.5}, "mass_loss_job_share=1.5"),
        ({"window_seconds": 0}, "mass_loss_window_seconds"),
        ({"replace_batch": 0}, "mass_loss_replace_batch=0"),
        ({"settle_seconds": -1}, "mass_loss_settle_seconds=-1"),
        ({"settle_seconds": 10, "window_seconds": 10}, "mass_loss_settle_seconds=10"),
    ],
)
def test_a_policy_that_cannot_work_is_refused_by_name(fields: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        MassLossPolicy(**fields)  # type: ignore[arg-type]
