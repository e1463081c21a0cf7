"""Admission: quotas, preemption victims and the reasons a job waits."""

from __future__ import annotations

from pitstop.scheduler.admission import Pending, Running, admit
from pitstop.scheduler.placement import GangRequest, NodeInfo


def fleet(count: int, gpus: int = 2) -> list[NodeInfo]:
    return [
        NodeInfo(f"n{i}", "z0", "b0", "r0", "worker", "ready", tuple(range(gpus)))
        for i in range(count)
    ]


def job(job_id: str, dp: int, *, priority: int = 0, seq: int = 0, project: str = "p") -> Pending:
    return Pending(GangRequest(job_id, 1, 1, dp, 2, priority=priority, sequence=seq), project)


def held(*nodes: str) -> tuple[tuple[str, int], ...]:
    return tuple((n, g) for n in nodes for g in (0, 1))


def test_a_job_that_fits_is_placed_and_books_for_the_next() -> None:
    verdict = admit(fleet(2), [], [job("a", 4, seq=0), job("b", 4, seq=1)])
    assert set(verdict.placed) == {"a"}
    assert verdict.waiting["b"].startswith("priority:")


def test_a_job_over_its_quota_waits_and_names_the_quota() -> None:
    verdict = admit(fleet(4), [], [job("a", 4)], quotas={"p": (6, 4)})
    assert verdict.placed == {}
    why = verdict.waiting["a"]
    assert why.startswith("quota: project p holds 4 of its 6 GPUs")
    assert "needs 4" in why
    # Another project's quota does not touch it.
    assert set(admit(fleet(4), [], [job("a", 4)], quotas={"q": (0, 0)}).placed) == {"a"}


def test_a_higher_priority_job_preempts_the_least_costly_lower_one() -> None:
    busy = held("n0", "n1", "n2", "n3")
    running = [
        Running("old", priority=1, unsaved_steps=50, gpus=held("n0", "n1")),
        Running("cheap", priority=1, unsaved_steps=2, gpus=held("n2", "n3")),
    ]
    verdict = admit(fleet(4), busy, [job("hi", 4, priority=5)], preemptible=running)
    assert verdict.preempt == {"cheap": "hi"}
    assert verdict.placed == {}
    assert verdict.waiting["hi"].startswith("preempting cheap")


def test_lowest_priority_goes_first_and_only_as_many_as_needed() -> None:
    busy = held("n0", "n1", "n2", "n3")
    running = [
        Running("mid", priority=3, unsaved_steps=0, gpus=held("n0", "n1")),
        Running("low", priority=1, unsaved_steps=99, gpus=held("n2", "n3")),
    ]
    verdict = admit(fleet(4), busy, [job("hi", 8, priority=5)], preemptible=running)
    assert verdict.preempt == {"low": "hi", "mid": "hi"}
    verdict = admit(fleet(4), busy, [job("hi", 4, priority=5)], preemptible=running)
    assert verdict.preempt == {"low": "hi"}


def test_no_preemption_of_equal_priority_or_when_it_would_not_be_enough() -> None:
    busy = held("n0", "n1")
    same = [Running("peer", priority=5, unsaved_steps=0, gpus=held("n0", "n1"))]
    verdict = admit(fleet(2), busy, [job("hi", 4, priority=5)], preemptible=same)
    assert verdict.preempt == {}
    assert verdict.waiting["hi"].startswith("capacity: needs 4 GPUs")
    assert "no running job of lower priority may be preempted" in verdict.waiting["hi"]
    small = [Running("low", priority=0, unsaved_steps=0, gpus=held("n0"))]
    verdict = admit(fleet(2), busy, [job("hi", 8, priority=5)], preemptible=small)
    assert verdict.preempt == {}


def test_one_victim_makes_room_for_one_job_only() -> None:
    busy = held("n0", "n1")
    running = [Running("low", priority=0, unsaved_steps=0, gpus=held("n0", "n1"))]
    pending = [job("a", 4, priority=5, seq=0), job("b", 4, priority=4, seq=1)]
    verdict = admit(fleet(2), busy, pending, preemptible=running)
    assert verdict.preempt == {"low": "a"}
    assert not verdict.waiting["b"].startswith("preempting")


def test_free_gpus_scattered_over_nodes_are_a_topology_reason() -> None:
    busy = [("n0", 0), ("n1", 0)]
    verdict = admit(fleet(2), busy, [job("a", 2)])
    assert verdict.waiting["a"].startswith("topology: 2 GPUs are free on READY workers")


def replicas(*nodes: str) -> tuple[tuple[tuple[str, int], ...], ...]:
    return tuple(held(n) for n in nodes)


def test_a_job_that_may_shrink_drops_its_last_replicas_instead_of_stopping() -> None:
    busy = held("n0", "n1", "n2", "n3")
    elastic = Running(
        "low",
        priority=0,
        unsaved_steps=0,
        gpus=busy,
        replicas=replicas("n0", "n1", "n2", "n3"),
        min_dp=2,
    )
    verdict = admit(fleet(4), busy, [job("hi", 4, priority=5)], preemptible=[elastic])
    assert verdict.shrink == {"low": (2, "hi")}
    assert verdict.preempt == {}
    assert verdict.waiting["hi"].startswith("shrinking low by 2 replica(s)")
    # Needing more than its min_dp leaves: preempted whole.
    verdict = admit(fleet(4), busy, [job("hi", 6, priority=5)], preemptible=[elastic])
    assert verdict.shrink == {}
    assert verdict.preempt == {"low": "hi"}
