"""bench/recovery.py matches each injected failure to the incident that ended it, by
outcome, and never drops one without a word."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pitstop.client.scenario import Fault, Injected
from pitstop.v1 import jobs_pb2

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def recovery() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # as a script's own directory is: it imports peers
    try:
        spec = importlib.util.spec_from_file_location("bench_recovery", BENCH / "recovery.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def incident(detected: float, outcome: int, decided: float, resumed: float = 0.0) -> object:
    return jobs_pb2.GoodputIncident(
        detected_at=detected,
        decided_at=decided,
        resumed_at=resumed,
        outcome=outcome,
        lost_steps=1,
    )


def test_a_superseded_decision_is_part_of_the_failure_it_answered(recovery: ModuleType) -> None:
    faults = [
        Injected(Fault(20, "node_kill"), "n1", at=100.0, step=20),
        Injected(Fault(40, "rank_kill"), "n2", at=200.0, step=40),
    ]
    goodput = jobs_pb2.Goodput(
        incidents=[
            incident(100.5, jobs_pb2.INCIDENT_OUTCOME_SUPERSEDED, decided=100.6),
            incident(101.0, jobs_pb2.INCIDENT_OUTCOME_RESUMED, decided=101.1, resumed=102.0),
            incident(200.1, jobs_pb2.INCIDENT_OUTCOME_RESUMED, decided=200.2, resumed=200.9),
        ]
    )
    rows, missed = recovery.split(goodput, faults, restores=[], left=[])
    assert missed == []
    first, second = rows
    assert first["detect"] == pytest.approx(0.5)  # to the first incident it opened
    assert first["decide"] == pytest.approx(0.6)  # to the decision that resumed the job
    assert first["total"] == pytest.approx(2.0)
    assert first["incidents"] == 2
    assert second["total"] == pytest.approx(0.9)


def test_a_recovery_ends_when_every_rank_stepped_as_the_peers_are_timed(
    recovery: ModuleType,
) -> None:
    faults = [Injected(Fault(20, "rank_kill"), "n1", at=100.0, step=20)]
    goodput = jobs_pb2.Goodput(
        incidents=[
            incident(100.1, jobs_pb2.INCIDENT_OUTCOME_RESUMED, decided=100.3, resumed=101.5),
        ]
    )
    ranks = recovery.RankTimes(
        # rank 0 joined twice (a superseded generation first): its last join counts
        joined=[(100.6, 0), (100.8, 0), (100.9, 1)],
        # rank 1 stepped before the failure (old generation), then after its join
        stepped=[(99.9, 1), (100.7, 0), (101.0, 0), (101.2, 1), (101.3, 0), (101.4, 1)],
    )
    rows, missed = recovery.split(goodput, faults, restores=[], left=[], ranks=ranks)
    assert missed == []
    (row,) = rows
    assert row["total"] == pytest.approx(1.2)  # rank 1's first step in its generation
    assert row["reported"] == pytest.approx(0.3)  # the scheduler heard of it later
    # A rank that joined but whose step the logs do not show: the scheduler's word.
    ranks.stepped = [(101.0, 0)]
    (row,), _ = recovery.split(goodput, faults, restores=[], left=[], ranks=ranks)
    assert row["total"] == pytest.approx(1.5)
    assert row["reported"] == 0.0


def test_a_failure_nothing_resumed_is_reported_not_dropped(recovery: ModuleType) -> None:
    faults = [
        Injected(Fault(20, "agent_hang"), "n3", at=100.0, step=20),
        Injected(Fault(40, "xid"), "n4", at=200.0, step=40),
    ]
    goodput = jobs_pb2.Goodput(
        incidents=[
            incident(100.5, jobs_pb2.INCIDENT_OUTCOME_SUPERSEDED, decided=100.6),
            incident(200.3, jobs_pb2.INCIDENT_OUTCOME_RESUMED, decided=200.4, resumed=201.0),
        ]
    )
    rows, missed = recovery.split(goodput, faults, restores=[], left=[])
    assert [r["kind"] for r in rows] == ["xid"]
    (lost,) = missed
    assert (lost["kind"], lost["node"], lost["step"]) == ("agent_hang", "n3", 20)
    assert "INCIDENT_OUTCOME_SUPERSEDED" in lost["why"]


def test_every_system_meets_as_many_failures_of_each_shared_kind(recovery: ModuleType) -> None:
    faults = recovery.schedule(failures=3, own=1, every=20)
    kinds = [fault.kind for fault in faults]
    assert kinds.count("rank_kill") == kinds.count("node_freeze") == 3
    for own in ("node_kill", "xid", "agent_hang", "app_xid"):
        assert kinds.count(own) == 1
    assert [fault.at_step for fault in faults] == [20 * (i + 1) for i in range(len(faults))]
    # The peers meet the same two kinds, as many of each, under the names shared by all.
    peer_kinds = recovery.peers.kinds_in_turn(3)
    assert sorted(peer_kinds) == sorted(
        recovery.REPORTED.get(k, k) for k in kinds if k in recovery.SHARED
    )


def test_a_kinds_costs_are_summarized_apart(recovery: ModuleType) -> None:
    peers = recovery.peers
    rows = [
        {"kind": "rank_kill", "to_progress": 1.0, "to_full": 1.0, "lost_gpu": 4.0, "lost_steps": 1},
        {
            "kind": "rank_kill",
            "to_progress": 3.0,
            "to_full": 3.0,
            "lost_gpu": 12.0,
            "lost_steps": 0,
        },
        {
            "kind": "node_silent",
            "to_progress": 5.0,
            "to_full": 6.0,
            "lost_gpu": 21.0,
            "lost_steps": 2,
        },
    ]
    out = peers.by_kind(rows, peers.KINDS)
    assert out["rank_kill"]["failures"] == 2
    assert out["rank_kill"]["to_full_s"]["max"] == 3.0
    assert out["rank_kill"]["steps_lost_per_failure"] == 0.5
    assert out["node_silent"]["lost_gpu_s"]["p50"] == 21.0
    # Every GPU waits when all restart; when survivors go on, only the failed slot waits
    # past their first step.
    assert peers.lost_gpu_all_restart(4, to_full=2.0, lost_steps=5, step_seconds=0.1) == 10.0
    assert peers.lost_gpu_survivors_go_on(4, to_progress=1.0, to_full=6.0) == 9.0


def test_an_unpaced_jobs_step_time_is_read_from_its_ranks_step_lines(
    recovery: ModuleType,
) -> None:
    """The 3D job is not paced: the GPU-seconds a failure cost count its steps at the
    pace its ranks kept, the median gap between one rank's steps (a recovery's gap and
    the other rank's interleaved lines do not move it)."""
    ranks = recovery.RankTimes(
        stepped=[(10.0, 0), (10.5, 0), (11.0, 0), (14.0, 0), (10.1, 1), (10.6, 1), (11.1, 1)]
    )
    assert ranks.step_seconds() == pytest.approx(0.5)
    assert recovery.RankTimes().step_seconds() == 0.0


def test_the_3d_jobs_targets_are_judged_apart_and_a_left_out_system_is_not(
    recovery: ModuleType,
) -> None:
    def kinds(p50: float) -> dict[str, object]:
        full = {"to_full_s": {"p50": p50, "p95": p50, "max": p50}}
        return {"rank_kill": full, "node_silent": full, "final_hash_equal": True}

    met = recovery.targets_met({"pitstop_3d": kinds(2.9)})
    assert met == {
        "pitstop_3d": {
            "final_hash_equal": True,
            "rank_kill_to_full_p50": True,
            "node_silent_to_full_p50": True,
        }
    }
    assert not recovery.targets_met({"pitstop_3d": kinds(3.1)})["pitstop_3d"][
        "rank_kill_to_full_p50"
    ]
    assert recovery.ratios({"pitstop_3d": kinds(1.0)}) == {}
