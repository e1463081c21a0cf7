"""The global sample order and its cursor (pitstop.data.order, pitstop.data.cursor): the
same samples per step at any dp, and a resume at any dp from the cursor alone."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.data import Cursor, SampleOrder


def step_by_replicas(order: SampleOrder, step: int, dp: int) -> list[int]:
    """What dp replicas read at `step`, put back in microbatch order: each replica's
    microbatches, as the replica itself computes them, placed at their index."""
    placed: dict[int, list[int]] = {}
    for replica in range(dp):
        for microbatch in order.replica_microbatches(dp, replica):
            assert microbatch not in placed, f"microbatch {microbatch} read twice at dp {dp}"
            placed[microbatch] = order.microbatch_samples(step, microbatch)
    assert sorted(placed) == list(range(order.microbatches)), "a microbatch nobody read"
    return [sample for microbatch in sorted(placed) for sample in placed[microbatch]]


@settings(max_examples=60, deadline=None)
@given(
    microbatch_size=st.integers(1, 4),
    microbatches=st.integers(1, 9),
    extra=st.integers(0, 30),
    seed=st.integers(0, 2**40),
    step=st.integers(0, 40),
)
def test_replicas_together_read_the_step_slice_in_order_at_every_dp(
    microbatch_size: int, microbatches: int, extra: int, seed: int, step: int
) -> None:
    global_batch = microbatch_size * microbatches
    order = SampleOrder(global_batch + extra, global_batch, microbatch_size, seed)
    expected = order.step_samples(step)
    assert len(expected) == global_batch
    for dp in range(1, microbatches + 1):
        assert step_by_replicas(order, step, dp) == expected
        shares = [len(order.replica_microbatches(dp, r)) for r in range(dp)]
        assert max(shares) - min(shares) <= 1
        assert min(shares) >= 1


def test_an_epoch_reads_every_sample_at_most_once_and_drops_only_the_tail() -> None:
    order = SampleOrder(samples=103, global_batch=10, microbatch_size=2, seed=5)
    assert order.steps_per_epoch == 10
    for epoch in (0, 1):
        steps = range(epoch * 10, epoch * 10 + 10)
        read = [sample for step in steps for sample in order.step_samples(step)]
        assert len(read) == len(set(read)) == 100
        assert set(read) <= set(range(103))
        # The 3 dropped are the permutation's tail, so which ones changes per epoch.
        assert set(range(103)) - set(read) == set(order.permutation(epoch)[100:].tolist())
    assert order.epoch_of(9) == 0
    assert order.epoch_of(10) == 1


def test_the_permutation_is_fixed_by_seed_and_epoch() -> None:
    first = SampleOrder(1000, 8, 2, seed=11)
    again = SampleOrder(1000, 8, 2, seed=11)
    other_seed = SampleOrder(1000, 8, 2, seed=12)
    assert np.array_equal(first.permutation(3), again.permutation(3))
    assert sorted(first.permutation(3).tolist()) == list(range(1000))
    assert not np.array_equal(first.permutation(3), other_seed.permutation(3))
    assert not np.array_equal(first.permutation(3), first.permutation(4))
    # Hashed seeds: seed 12's epoch 0 is not seed 11's epoch 1.
    assert not np.array_equal(other_seed.permutation(0), first.permutation(1))


def test_the_order_is_pinned() -> None:
    """A canary: these digests are the order every job with this config has read. If torch
    changes randperm, this fails, and a job resumed across that upgrade would read other
    samples than it saved its cursor under."""
    order = SampleOrder(samples=1000, global_batch=16, microbatch_size=4, seed=1234)
    assert order.step_samples(0)[:6] == PINNED_FIRST_SAMPLES
    assert order.step_digest(0) == PINNED_STEP_0_DIGEST
    assert order.step_digest(62) == PINNED_STEP_62_DIGEST  # epoch 1 (62 steps per epoch)


# Computed with torch 2.13.0 (CPU); the same on any machine for that torch.
PINNED_FIRST_SAMPLES = [678, 882, 290, 671, 685, 339]
PINNED_STEP_0_DIGEST = "4f3f14c71e473fe7337261c7256ed05c7feeb86c4e80368593d63d213bab0454"
PINNED_STEP_62_DIGEST = "6d99affb1ef433da0baa8cb33d06620488e274ddd7f8f06b99f79b47c8030019"


def test_step_digest_is_the_sha256_of_the_ids_as_little_endian_int64() -> None:
    order = SampleOrder(50, 10, 5, seed=3)
    ids = order.step_samples(2)
    expected = hashlib.sha256(b"".join(i.to_bytes(8, "little") for i in ids)).hexdigest()
    assert order.step_digest(2) == expected
    assert order.step_digest(2) != order.step_digest(3)


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 5, 6])
def test_loss_scale_gives_the_global_mean_after_a_sum_all_reduce(dp: int) -> None:
    order = SampleOrder(60, 12, 2, seed=0)  # 6 microbatches
    losses = np.random.default_rng(dp).random(60)
    step = 1
    global_mean = losses[order.step_samples(step)].mean()
    replica_sums = [
        sum(
            losses[order.microbatch_samples(step, m)].mean() * order.loss_scale
            for m in order.replica_microbatches(dp, replica)
        )
        for replica in range(dp)
    ]
    assert sum(replica_sums) == pytest.approx(global_mean, rel=1e-12)
    averaged = [s / order.loss_scale * order.averaged_loss_scale(dp) for s in replica_sums]
    assert sum(averaged) / dp == pytest.approx(global_mean, rel=1e-12)
    weights = [order.replica_weight(dp, replica) for replica in range(dp)]
    assert sum(weights) == pytest.approx(1.0)


def test_an_order_pickles_to_an_equal_order() -> None:
    order = SampleOrder(60, 12, 2, seed=8)
    order.permutation(0)  # something cached, and the lock, must not stop it
    copied = pickle.loads(pickle.dumps(order))
    assert copied == order
    assert copied.step_samples(4) == order.step_samples(4)


def test_the_permutation_cannot_be_changed_through_what_it_returns() -> None:
    order = SampleOrder(20, 4, 2)
    with pytest.raises(ValueError, match="read-only"):
        order.permutation(0)[0] = 7


def run(order_args: dict[str, int], plan: list[tuple[int, int]]) -> list[str]:
    """Step digests of a run that trains `steps` steps at each (dp, steps) of `plan`,
    saving the cursor and building a fresh order and cursor at every change (a restart)."""
    digests: list[str] = []
    state: dict[str, int] | None = None
    for dp, steps in plan:
        order = SampleOrder(**order_args)
        cursor = Cursor(order)
        if state is not None:
            cursor.load_state_dict(state)
        for _ in range(steps):
            ids = step_by_replicas(order, cursor.step, dp)
            digests.append(hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest())
            cursor.advance()
        state = cursor.state_dict()
        assert all(type(value) is int for value in state.values())
    return digests


ORDER = {"samples": 97, "global_batch": 24, "microbatch_size": 2, "seed": 9}  # 4 steps/epoch


def test_a_run_that_changes_dp_reads_what_an_uninterrupted_run_reads() -> None:
    steady = run(ORDER, [(4, 14)])
    changing = run(ORDER, [(4, 3), (3, 4), (2, 2), (4, 5)])  # across three epoch ends
    assert changing == steady
    order = SampleOrder(**ORDER)
    assert steady == [order.step_digest(step) for step in range(14)]


@pytest.mark.parametrize("dp", [1, 2, 3, 5, 12])
def test_any_dp_resumes_from_a_cursor(dp: int) -> None:
    assert run(ORDER, [(4, 5), (dp, 4)]) == run(ORDER, [(4, 9)])


def test_cursor_state_is_plain_ints_and_says_where_it_is() -> None:
    cursor = Cursor(SampleOrder(**ORDER), step=9)
    assert cursor.state_dict() == {
        "step": 9,
        "epoch": 2,
        "step_in_epoch": 1,
        "samples": 97,
        "global_batch": 24,
        "seed": 9,
    }


def test_a_cursor_loads_under_another_microbatch_size() -> None:
    saved = Cursor(SampleOrder(**ORDER), step=6).state_dict()
    resumed = Cursor(SampleOrder(**{**ORDER, "microbatch_size": 4}))
    resumed.load_state_dict(saved)
    assert resumed.step == 6
    assert resumed.order.step_samples(6) == SampleOrder(**ORDER).step_samples(6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"samples": 0, "global_batch": 1, "microbatch_size": 1}, "samples 0: must be"),
        ({"samples": 10, "global_batch": 0, "microbatch_size": 1}, "global_batch 0: must be"),
        ({"samples": 10, "global_batch": 4, "microbatch_size": 0}, "microbatch_size 0: must"),
        (
            {"samples": 100, "global_batch": 10, "microbatch_size": 4},
            r"global_batch 10: must be a multiple of microbatch_size 4; use a multiple \(e.g. 8\)",
        ),
        (
            {"samples": 10, "global_batch": 12, "microbatch_size": 4},
            "global_batch 12: larger than the dataset's 10 samples",
        ),
        ({"samples": 10, "global_batch": 4, "microbatch_size": 2, "seed": -1}, "seed -1"),
    ],
)
def test_bad_orders_are_refused_saying_what_to_do(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SampleOrder(**args)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.replica_microbatches(0, 0), r"dp 0: must be in 1\.\.6, the microbatches"),
        (lambda o: o.replica_microbatches(7, 0), r"dp 7: must be in 1\.\.6.*fewer replicas"),
        (lambda o: o.replica_microbatches(3, 3), r"replica 3: must be in 0\.\.2 for dp 3"),
        (lambda o: o.step_samples(-1), "step -1: must be an integer >= 0"),
        (lambda o: o.microbatch_samples(0, 6), r"microbatch 6: must be in 0\.\.5"),
        (lambda o: o.averaged_loss_scale(9), "dp 9"),
        (lambda o: o.permutation(-2), "epoch -2"),
    ],
)
def test_bad_questions_are_refused(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(SampleOrder(60, 12, 2))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 10}, "cursor state seed 10: this order has seed 9"),
        ({"global_batch": 12}, "cursor state global_batch 12: this order has global_batch 24"),
        ({"samples": 98}, "cursor state samples 98"),
        ({"epoch": 0}, "cursor state epoch 0, step_in_epoch 1: step 9 is epoch 2"),
        ({"step": -3, "epoch": -1, "step_in_epoch": 1}, "step -3: must be an integer >= 0"),
    ],
)
def test_a_cursor_from_another_schedule_is_refused(change: dict[str, int], message: str) -> None:
    state = {**Cursor(SampleOrder(**ORDER), step=9).state_dict(), **change}
    cursor = Cursor(SampleOrder(**ORDER))
    with pytest.raises(ValueError, match=message):
        cursor.load_state_dict(state)
    assert cursor.step == 0


def test_a_cursor_state_without_its_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="lacks samples, global_batch, seed"):
        Cursor(SampleOrder(**ORDER)).load_state_dict({"step": 3})
