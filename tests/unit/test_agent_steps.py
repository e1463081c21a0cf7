"""StepSummarizer: a node's step samples folded into one summary per job, windows cut
as the job's command says, news, bounds."""

from __future__ import annotations

import pytest

from pitstop.agent.steps import StepSummarizer
from pitstop.v1 import agent_pb2


def sample(rank: int, step: int, seconds: float = 0.5, **fields: object) -> agent_pb2.StepSample:
    return agent_pb2.StepSample(rank=rank, step=step, step_seconds=seconds, **fields)  # type: ignore[arg-type]


def test_a_summary_says_where_the_nodes_ranks_stand_and_what_they_did() -> None:
    steps = StepSummarizer()
    for step in (1, 2, 3):
        steps.add("a", 1, sample(0, step, tokens=100, model_flops=5.0, peak_flops=1e12, loss=2.0))
    for step in (1, 2):
        steps.add("a", 1, sample(1, step, tokens=100, model_flops=5.0, peak_flops=1e12, loss=4.0))
    steps.add("b", 1, sample(7, 9))

    a, b = steps.drain()

    assert (a.job_id, a.generation, a.ranks) == ("a", 1, 2)
    assert (a.slowest_step, a.newest_step) == (2, 3)
    assert (a.samples, a.tokens, a.model_flops, a.peak_flops) == (5, 500, 25.0, 2e12)
    # The loss at the slowest rank's step: the mean of every rank's loss at step 2.
    assert (a.loss_step, a.loss) == (2, 3.0)
    assert (b.job_id, b.slowest_step, b.newest_step, b.ranks) == ("b", 9, 9, 1)
    # Since the last summary: the counts start over, where the ranks stand does not.
    steps.add("a", 1, sample(1, 3, tokens=100))
    (a,) = steps.drain()
    assert (a.slowest_step, a.newest_step, a.samples, a.tokens, a.ranks) == (3, 3, 1, 100, 2)
    assert steps.drain() == []  # nothing new


def test_windows_are_cut_as_the_command_says_from_the_restore_step() -> None:
    steps = StepSummarizer()
    steps.expect("a", 2, 100, agent_pb2.StepWindows(window_steps=3, warmup_steps=1))
    for step in range(101, 109):  # 101: warm-up; windows 102-104, 105-107; 108 open
        for rank in (0, 1):
            steps.add("a", 2, sample(rank, step, seconds=1.0 + rank + step % 2))
    (summary,) = steps.drain()
    assert [(w.rank, w.window, w.first_step, w.steps, w.timed) for w in summary.windows] == [
        (0, 0, 102, 3, 3),
        (1, 0, 102, 3, 3),
        (0, 1, 105, 3, 3),
        (1, 1, 105, 3, 3),
    ]
    first = summary.windows[0]  # rank 0 at 102, 103, 104: 1, 2, 1 s
    assert (first.median_seconds, first.max_seconds) == (1.0, 2.0)
    steps.add("a", 2, sample(0, 109))
    (summary,) = steps.drain()
    assert summary.windows == []  # a window goes out once, when complete


def test_an_unset_warmup_takes_the_default_and_zero_is_zero() -> None:
    for windows, first in (
        (agent_pb2.StepWindows(window_steps=2), 11),  # 10 warm-up steps by default
        (agent_pb2.StepWindows(window_steps=2, warmup_steps=0), 1),
    ):
        steps = StepSummarizer()
        steps.expect("a", 1, 0, windows)
        for step in range(1, 13):
            steps.add("a", 1, sample(0, step))
        (summary,) = steps.drain()
        assert summary.windows[0].first_step == first


def test_a_jobs_first_step_in_a_newer_generation_is_news() -> None:
    """The agent reports at once when a job steps in a new generation (it resumed)."""
    steps = StepSummarizer()
    news = [
        steps.add(job, generation, sample(0, step))
        for job, generation, step in [
            ("a", 1, 1),  # news: a's first step
            ("a", 1, 2),
            ("b", 1, 1),  # news: b's first
            ("a", 2, 3),  # news: a resumed in generation 2
            ("a", 1, 3),  # a late sample of the older generation: dropped
            ("a", 2, 4),
        ]
    ]
    assert news == [True, False, True, True, False, False]
    summaries = {s.job_id: s for s in steps.drain()}
    assert (summaries["a"].generation, summaries["a"].samples) == (2, 2)
    assert not steps.add("a", 2, sample(0, 5))  # draining forgets no generation


def test_a_rank_that_loaded_the_restore_step_is_told_once() -> None:
    steps = StepSummarizer()
    restored = sample(0, 8, restored_from="replica")
    restored.restored_at.FromSeconds(1_000)
    steps.add("a", 2, restored)
    (summary,) = steps.drain()
    assert [(r.rank, r.restored_from, r.restored_at.seconds) for r in summary.restored] == [
        (0, "replica", 1_000)
    ]
    steps.add("a", 2, sample(0, 9))
    (summary,) = steps.drain()
    assert list(summary.restored) == []


def test_pending_counts_samples_since_the_last_drain() -> None:
    steps = StepSummarizer()
    assert steps.drain() == []
    steps.add("a", 1, sample(0, 1))
    assert steps.pending == 1
    assert len(steps.drain()) == 1
    assert steps.pending == 0


def test_drops_the_oldest_windows_beyond_capacity_and_counts_them() -> None:
    steps = StepSummarizer(max_windows=2)
    steps.expect("a", 1, 0, agent_pb2.StepWindows(window_steps=1, warmup_steps=0))
    for step in range(1, 6):
        steps.add("a", 1, sample(0, step))
    assert steps.dropped == 3
    (summary,) = steps.drain()
    assert [w.first_step for w in summary.windows] == [4, 5]
    assert steps.dropped == 3  # a count since start, not reset by drain


def test_rejects_an_empty_capacity() -> None:
    with pytest.raises(ValueError, match="max_windows 0"):
        StepSummarizer(max_windows=0)


def test_the_gradient_norm_is_the_mean_of_the_ranks_that_state_one() -> None:
    steps = StepSummarizer()
    steps.add("a", 1, sample(0, 4, loss=2.0, grad_norm=1.5))
    steps.add("a", 1, sample(1, 4, loss=2.0, grad_norm=2.5))
    steps.add("a", 1, sample(2, 4, loss=2.0))  # a script that does not give it
    (summary,) = steps.drain()
    assert (summary.loss_step, summary.grad_norm) == (4, 2.0)
    for rank in range(3):
        steps.add("a", 1, sample(rank, 5, loss=2.0))
    (quiet,) = steps.drain()
    assert quiet.grad_norm == 0.0  # nobody stated one at the slowest step


def test_between_reports_only_a_generations_first_steps_go_out() -> None:
    """Step summaries go out with the periodic report; between two, only what the
    scheduler acts on at once: a generation getting going, rank by rank."""
    steps = StepSummarizer()
    steps.expect("a", 1, 0, agent_pb2.StepWindows(window_steps=2, warmup_steps=0))
    steps.add("a", 1, sample(0, 1))
    (first,) = steps.drain(due=False)  # the generation's first step: at once
    assert (first.generation, first.ranks, first.newest_step) == (1, 1, 1)
    steps.add("a", 1, sample(0, 2))  # rank 0 closes window 0 (steps 1-2)
    assert steps.drain(due=False) == []  # progress and windows wait for the report
    steps.add("a", 1, sample(1, 1))  # a second rank reported its first step
    (more,) = steps.drain(due=False)
    assert (more.ranks, more.slowest_step) == (2, 1)
    assert [(w.rank, w.window) for w in more.windows] == [(0, 0)]  # rides along
    steps.add("a", 1, sample(1, 2))
    assert steps.drain(due=False) == []
    (report,) = steps.drain(due=True)
    assert (report.ranks, report.slowest_step, report.newest_step) == (2, 2, 2)
    assert [(w.rank, w.window) for w in report.windows] == [(1, 0)]
    steps.add("a", 2, sample(0, 3))  # a new generation: news again
    (news,) = steps.drain(due=False)
    assert (news.generation, news.ranks) == (2, 1)


def test_a_job_that_left_the_node_is_forgotten_once_idle_and_nothing_unsent_is_lost() -> None:
    """An agent runs through thousands of jobs: what it keeps of one whose ranks left
    goes after the idle time, never before its last steps were sent, and never while a
    rank of it runs or a new generation was just announced."""
    steps = StepSummarizer()
    steps.expect("done", 1, 0)
    steps.add("done", 1, sample(0, 1))
    steps.add("runs", 1, sample(0, 1))
    # Unsent steps keep a job however long ago it was active.
    assert steps.forget_idle(active={"runs"}, now=0.0, after=10.0) == []
    assert steps.forget_idle(active={"runs"}, now=100.0, after=10.0) == []
    assert {s.job_id for s in steps.drain()} == {"done", "runs"}
    assert steps.forget_idle(active={"runs"}, now=100.0, after=10.0) == []  # idle from now
    assert steps.forget_idle(active={"runs"}, now=109.9, after=10.0) == []
    assert steps.forget_idle(active={"runs"}, now=110.0, after=10.0) == ["done"]
    assert steps.jobs == 1
    # A job started again here (its command announced the generation) is kept.
    steps.expect("runs", 2, 5)
    assert steps.forget_idle(active=set(), now=200.0, after=10.0) == []
    steps.expect("runs", 3, 5)  # told again: its idle time starts over
    assert steps.forget_idle(active=set(), now=205.0, after=10.0) == []
    assert steps.forget_idle(active=set(), now=215.0, after=10.0) == ["runs"]
    assert steps.jobs == 0
