"""StepBatcher: grouping per (job, generation), arrival order, draining, bounded buffer."""

from __future__ import annotations

import pytest

from pitstop.agent.steps import StepBatcher
from pitstop.v1 import agent_pb2


def sample(rank: int, step: int) -> agent_pb2.StepSample:
    return agent_pb2.StepSample(rank=rank, step=step, step_seconds=0.5)


def test_groups_by_job_and_generation_in_arrival_order() -> None:
    batcher = StepBatcher()
    batcher.add("a", 1, sample(0, 1))
    batcher.add("b", 1, sample(0, 7))
    batcher.add("a", 1, sample(1, 1))
    batcher.add("a", 2, sample(0, 2))
    batcher.add("a", 1, sample(0, 3))

    batches = batcher.drain()

    assert [(b.job_id, b.generation) for b in batches] == [("a", 1), ("b", 1), ("a", 2)]
    assert [(s.rank, s.step) for s in batches[0].samples] == [(0, 1), (1, 1), (0, 3)]
    assert [(s.rank, s.step) for s in batches[1].samples] == [(0, 7)]
    assert [(s.rank, s.step) for s in batches[2].samples] == [(0, 2)]


def test_a_jobs_first_step_in_a_newer_generation_is_news() -> None:
    """The agent reports at once when a job steps in a new generation (it resumed)."""
    batcher = StepBatcher()
    news = [
        batcher.add(job, generation, sample(0, step))
        for job, generation, step in [
            ("a", 1, 1),  # news: a's first step
            ("a", 1, 2),
            ("b", 1, 1),  # news: b's first
            ("a", 2, 3),  # news: a resumed in generation 2
            ("a", 1, 3),  # a late sample of the older generation
            ("a", 2, 4),
        ]
    ]
    assert news == [True, False, True, True, False, False]
    batcher.drain()
    assert not batcher.add("a", 2, sample(0, 5))  # draining forgets no generation


def test_drain_empties_the_buffer() -> None:
    batcher = StepBatcher()
    assert batcher.drain() == []
    batcher.add("a", 1, sample(0, 1))
    assert batcher.pending == 1
    assert len(batcher.drain()) == 1
    assert batcher.pending == 0
    assert batcher.drain() == []


def test_drops_oldest_beyond_capacity_and_counts_them() -> None:
    batcher = StepBatcher(max_samples=3)
    for step in range(1, 6):
        batcher.add("a", 1, sample(0, step))

    assert batcher.pending == 3
    assert batcher.dropped == 2
    (batch,) = batcher.drain()
    assert [s.step for s in batch.samples] == [3, 4, 5]
    assert batcher.dropped == 2  # a count since start, not reset by drain


def test_rejects_an_empty_capacity() -> None:
    with pytest.raises(ValueError, match="max_samples 0"):
        StepBatcher(max_samples=0)
