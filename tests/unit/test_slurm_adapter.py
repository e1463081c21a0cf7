"""The Slurm adapter's pure parts: reading sinfo, squeue and sbatch output, and deciding a
pass (drain, confirm, clear, replacement) from pitstop's failed nodes, the adapter's
records and what Slurm shows."""

from __future__ import annotations

from typing import Any

import pytest

from pitstop.scheduler.config import SchedulerSettings
from pitstop.scheduler.slurm.commands import (
    Allocation,
    SlurmNode,
    parse_allocations,
    parse_sbatch,
    parse_sinfo,
    parse_squeue,
)
from pitstop.scheduler.slurm.decide import (
    ENDING_COMMENT,
    MAX_REASON,
    Confirmation,
    DrainPlan,
    DrainRecord,
    FailedNode,
    Release,
    drain_reason,
    plan_drains,
    plan_submissions,
)

LOST = drain_reason("lost", "agent stream closed")
XID = drain_reason("unhealthy", "fatal Xid 79 on GPU 0")


def test_sinfo_lines_become_nodes_with_their_reason() -> None:
    text = "n1|idle|none\nn2|drained|pitstop: lost: a|b\nn2|drained|pitstop: lost: a|b\n\n"
    assert parse_sinfo(text) == {
        "n1": SlurmNode("n1", "idle", ""),
        "n2": SlurmNode("n2", "drained", "pitstop: lost: a|b"),
    }


@pytest.mark.parametrize(
    ("state", "drained"),
    [
        ("drained", True),
        ("draining", True),
        ("drained*", True),
        ("DRAINING@", True),
        ("idle", False),
        ("idle*", False),
        ("allocated", False),
        ("down*", False),
        ("mixed", False),
    ],
)
def test_drained_means_drained_or_draining_whatever_the_flags(state: str, drained: bool) -> None:
    assert SlurmNode("n", state, "").drained is drained


def test_squeue_gives_the_newest_job_of_each_name() -> None:
    assert parse_squeue("a|12\nb|13\na|15\nbad line\n|4\n") == {"a": "15", "b": "13"}


@pytest.mark.parametrize(
    ("out", "job"),
    [("42\n", "42"), ("42;cluster\n", "42"), ("Submitted batch job 7\n", "7"), ("nope", None)],
)
def test_sbatch_job_id(out: str, job: str | None) -> None:
    assert parse_sbatch(out) == job


def test_drain_reason_is_one_line_with_pitstops_prefix_and_bounded() -> None:
    assert LOST == "pitstop: lost: agent stream closed"
    long = drain_reason("unhealthy", "x\n" * 500)
    assert long == "pitstop: unhealthy: " + " ".join(["x"] * 500)[: MAX_REASON - 23] + "..."
    assert len(long) == MAX_REASON
    assert drain_reason("lost", "") == "pitstop: lost: no reason given"


def failed(node_id: str, reason: str = LOST, slurm_node: str = "") -> FailedNode:
    return FailedNode(node_id, slurm_node or node_id, reason)


def record(node_id: str, reason: str = LOST, **kw: object) -> DrainRecord:
    return DrainRecord(node_id, node_id, reason, **kw)  # type: ignore[arg-type]


def slurm(name: str, state: str = "allocated", reason: str = "") -> SlurmNode:
    return SlurmNode(name, state, reason)


RUNNING = {name: [Allocation("7", "")] for name in ("n2", "n9", "gpu-002")}
"""Every failed node in a running allocation (job 7), unless a test says otherwise."""


def decide_pass(
    failed: dict[str, FailedNode],
    records: dict[str, DrainRecord],
    observed: dict[str, SlurmNode],
    allocations: dict[str, list[Allocation]] | None = None,
    **kw: Any,
) -> DrainPlan:
    return plan_drains(
        failed, records, observed, RUNNING if allocations is None else allocations, **kw
    )


def decided(plan: DrainPlan) -> dict[str, object]:
    """The plan's non-empty decisions, to compare whole."""
    return {name: value for name, value in vars(plan).items() if value}


def test_a_newly_failed_node_gets_a_record_and_a_drain() -> None:
    plan = decide_pass(
        {"n2": failed("n2")}, {}, {"n2": slurm("n2")}, idle_spares=1, replacements=True
    )
    assert decided(plan) == {"create": [failed("n2")], "drain": [failed("n2")]}


def test_the_drain_is_asked_for_again_every_pass_until_slurm_shows_it() -> None:
    for _ in range(3):  # Slurm's controller did not act on it (down, lost the request)
        plan = decide_pass(
            {"n2": failed("n2")},
            {"n2": record("n2")},
            {"n2": slurm("n2", "allocated")},
            idle_spares=1,
            replacements=False,
        )
        assert decided(plan) == {"drain": [failed("n2")]}


def test_slurm_showing_the_drain_is_confirmed_once() -> None:
    seen = slurm("n2", "draining", LOST)
    plan = decide_pass(
        {"n2": failed("n2")}, {"n2": record("n2")}, {"n2": seen}, idle_spares=1, replacements=False
    )
    assert decided(plan) == {"confirm": [Confirmation("n2", seen, foreign=False)]}
    again = decide_pass(
        {"n2": failed("n2")},
        {"n2": record("n2", drained=True)},
        {"n2": seen},
        idle_spares=1,
        replacements=False,
    )
    assert decided(again) == {}


def test_a_node_an_admin_resumed_after_the_drain_is_left_to_the_admin() -> None:
    plan = decide_pass(
        {"n2": failed("n2")},
        {"n2": record("n2", drained=True)},
        {"n2": slurm("n2", "idle")},
        idle_spares=1,
        replacements=False,
    )
    assert decided(plan) == {}


def test_a_drain_with_someone_elses_reason_is_kept_and_counts() -> None:
    seen = slurm("n2", "drained", "bad DIMM, ticket 1234")
    plan = decide_pass({"n2": failed("n2")}, {}, {"n2": seen}, idle_spares=1, replacements=False)
    assert decided(plan) == {
        "create": [failed("n2")],
        "confirm": [Confirmation("n2", seen, foreign=True)],
    }


def test_a_new_reason_drains_again_over_pitstops_old_one() -> None:
    plan = decide_pass(
        {"n2": failed("n2", XID)},
        {"n2": record("n2", LOST, drained=True)},
        {"n2": slurm("n2", "drained", LOST)},
        idle_spares=1,
        replacements=False,
    )
    assert decided(plan) == {"retarget": [failed("n2", XID)], "drain": [failed("n2", XID)]}


def test_records_of_nodes_no_longer_failed_are_cleared() -> None:
    plan = decide_pass(
        {},
        {"n2": record("n2", drained=True)},
        {"n2": slurm("n2", "drained", LOST)},
        idle_spares=0,
        replacements=True,
    )
    assert decided(plan) == {"clear": ["n2"]}


def test_a_node_slurm_does_not_list_is_reported_not_drained() -> None:
    want = failed("n9", slurm_node="gpu-009")
    plan = decide_pass({"n9": want}, {}, {}, idle_spares=0, replacements=True)
    assert decided(plan) == {"unknown": [want]}


def test_slurm_names_map_the_node_ids() -> None:
    want = failed("n2", slurm_node="gpu-002")
    plan = decide_pass(
        {"n2": want}, {}, {"gpu-002": slurm("gpu-002")}, idle_spares=1, replacements=False
    )
    assert decided(plan) == {"create": [want], "drain": [want]}


@pytest.mark.parametrize(
    ("records", "seen", "idle", "on", "named"),
    [
        # drained, no idle spare, none asked for yet: ask
        ({"n2": record("n2", drained=True)}, "drained", 0, True, True),
        # drained in this very pass
        ({"n2": record("n2")}, "drained", 0, True, True),
        # a spare is still idle
        ({"n2": record("n2", drained=True)}, "drained", 1, True, False),
        # replacements not configured
        ({"n2": record("n2", drained=True)}, "drained", 0, False, False),
        # not drained in Slurm yet: the replacement could land on the failed node itself
        ({"n2": record("n2")}, "allocated", 0, True, False),
        # asked for already (name committed): never twice
        ({"n2": record("n2", drained=True, replacement_name="r-1")}, "drained", 0, True, False),
    ],
)
def test_a_replacement_is_named_once_the_drain_shows_and_no_spare_is_idle(
    records: dict[str, DrainRecord], seen: str, idle: int, on: bool, named: bool
) -> None:
    plan = decide_pass(
        {"n2": failed("n2")},
        records,
        {"n2": slurm("n2", seen, LOST if seen == "drained" else "")},
        idle_spares=idle,
        replacements=on,
    )
    assert plan.name_replacement == (["n2"] if named else [])


def test_named_replacements_are_found_by_name_or_submitted() -> None:
    records = [
        record("n1", replacement_name="r-n1"),
        record("n2", replacement_name="r-n2"),
        record("n3", replacement_name="r-n3", replacement_job_id="77"),
        record("n4"),
    ]
    plan = plan_submissions(records, {"r-n1": "41", "other": "9"})
    assert plan.adopt == {"n1": "41"}
    assert [r.node_id for r in plan.submit] == ["n2"]


@pytest.mark.parametrize(
    ("command", "field_error"),
    [
        ("sbatch --nodes=1 'unclosed", "cannot be split"),
        ("sbatch --job-name=x pitstop.sbatch --spares", "leave --job-name out"),
        ("sbatch -J x pitstop.sbatch", "leave --job-name out"),
    ],
)
def test_a_bad_replacement_command_is_refused_naming_the_setting(
    command: str, field_error: str
) -> None:
    with pytest.raises(ValueError, match="slurm_replacement_command") as caught:
        SchedulerSettings(slurm_replacement_command=command)
    assert field_error in str(caught.value)


def test_squeue_allocations_with_their_comment() -> None:
    text = "7|(null)\n8|pitstop: ending\n"
    assert parse_allocations(text) == [Allocation("7", ""), Allocation("8", ENDING_COMMENT)]


@pytest.mark.parametrize(
    ("jobs", "job_id"),
    [
        ([], ""),  # no running job holds it: its allocation is over
        ([Allocation("7", ENDING_COMMENT)], "7"),  # the recipe is stopping its daemons
    ],
)
def test_a_node_lost_as_its_allocation_ends_is_recorded_never_drained(
    jobs: list[Allocation], job_id: str
) -> None:
    plan = decide_pass(
        {"n2": failed("n2")},
        {},
        {"n2": slurm("n2")},
        {"n2": jobs},
        idle_spares=0,
        replacements=True,
    )
    assert decided(plan) == {"release": [Release(failed("n2"), job_id)]}
    later = decide_pass(  # a new allocation holds it before its agent is back
        {"n2": failed("n2")},
        {"n2": record("n2", allocation_ended=True)},
        {"n2": slurm("n2", "allocated")},
        {},
        idle_spares=0,
        replacements=True,
    )
    assert decided(later) == {}


def test_a_newly_failed_node_waits_for_its_allocation_to_be_known() -> None:
    plan = decide_pass(
        {"n2": failed("n2")}, {}, {"n2": slurm("n2")}, {}, idle_spares=0, replacements=True
    )
    assert decided(plan) == {}


def test_a_settled_drain_needs_nothing_from_slurm() -> None:
    """Slurm showed the drain once: later passes decide from the record alone (no sinfo),
    and can still ask for the replacement."""
    done = {"n2": record("n2", drained=True)}
    assert (
        decided(decide_pass({"n2": failed("n2")}, done, {}, {}, idle_spares=1, replacements=True))
        == {}
    )
    plan = decide_pass({"n2": failed("n2")}, done, {}, {}, idle_spares=0, replacements=True)
    assert decided(plan) == {"name_replacement": ["n2"]}
