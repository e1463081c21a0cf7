"""The integrity checks' decisions (pitstop.trainer.integrity): pure functions over the
rows the ranks exchange, so every rank reaches the same verdict from the same table."""

from __future__ import annotations

import math

import pytest
import torch

from pitstop.trainer.config import ConfigError, RankConfig
from pitstop.trainer.integrity import (
    NONFINITE,
    OK,
    REPLAY,
    SDC,
    SPIKE,
    UNLOCATED,
    IntegrityPolicy,
    LossWindow,
    Row,
    flip_a_bit,
    judge,
    poison,
    replica_groups,
    state_digest,
)
from pitstop.trainer.mesh import Shape

POLICY = IntegrityPolicy(loss_window=5, spike_sigma=3.0)
DP4 = replica_groups(Shape(dp=4))


def rows(*digests: int, loss: float = 1.0) -> list[Row]:
    return [Row(digest=d, loss=loss) for d in digests]


def test_a_row_survives_the_exchange_bitwise() -> None:
    for row in (
        Row(2**64 - 1, 2**63, math.nan, -math.inf),
        Row(1, 0, 2.718281828459045, 1e-300),
    ):
        back = Row.decode(row.encode())
        assert (back.digest, back.first) == (row.digest, row.first)
        assert repr(back.loss) == repr(row.loss)
        assert repr(back.grad_norm) == repr(row.grad_norm)


def test_replica_groups_are_the_ranks_at_one_pipeline_and_tensor_coordinate() -> None:
    assert DP4 == [[0, 1, 2, 3]]
    # dp=2, pp=2, tp=2: rank = (dp_rank * pp + pp_rank) * tp + tp_rank
    assert replica_groups(Shape(dp=2, pp=2, tp=2)) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_agreeing_replicas_and_a_finite_loss_are_ok() -> None:
    verdict = judge(rows(7, 7, 7, 7, loss=2.0), DP4, [], POLICY)
    assert (verdict.kind, verdict.loss) == (OK, 2.0)


def test_the_odd_replica_out_of_three_or_more_is_named_with_the_digest_it_should_have() -> None:
    verdict = judge(rows(7, 7, 9, 7), DP4, [], POLICY)
    assert verdict.kind == SDC
    assert verdict.ranks == (2,)
    assert verdict.expected == {2: 7}


def test_two_replicas_that_disagree_or_a_tie_call_for_a_replay() -> None:
    assert judge(rows(7, 9), [[0, 1]], [], POLICY).kind == REPLAY
    tie = judge(rows(7, 7, 9, 9), DP4, [], POLICY)
    assert (tie.kind, tie.ranks) == (REPLAY, (0, 1, 2, 3))


def test_the_replay_names_the_rank_whose_first_result_it_does_not_reproduce() -> None:
    replayed = [Row(digest=7, first=7), Row(digest=7, first=9)]
    verdict = judge(replayed, [[0, 1]], [], POLICY, replaying=True)
    assert (verdict.kind, verdict.ranks, verdict.expected) == (SDC, (1,), {1: 7})


def test_a_replay_that_disagrees_again_or_names_nobody_is_unlocated() -> None:
    again = [Row(digest=7, first=7), Row(digest=8, first=9)]
    assert judge(again, [[0, 1]], [], POLICY, replaying=True).kind == UNLOCATED
    same = [Row(digest=7, first=7), Row(digest=9, first=9)]
    assert judge(same, [[0, 1]], [], POLICY, replaying=True).kind == UNLOCATED
    nobody = [Row(digest=7, first=7), Row(digest=7, first=7)]
    assert judge(nobody, [[0, 1]], [], POLICY, replaying=True).kind == UNLOCATED


def test_a_nan_or_infinite_loss_or_gradient_norm_names_its_ranks_before_any_digest() -> None:
    table = [Row(7, loss=1.0), Row(9, loss=math.nan), Row(7, grad_norm=math.inf), Row(7)]
    verdict = judge(table, DP4, [], POLICY)
    assert (verdict.kind, verdict.ranks) == (NONFINITE, (1, 2))


def test_a_spike_is_judged_only_against_a_full_window() -> None:
    window = [2.0, 2.1, 1.9, 2.0, 2.0]  # mean 2.0, deviation 0.063
    assert judge(rows(7, 7, loss=2.1), [[0, 1]], window, POLICY).kind == OK
    spike = judge(rows(7, 7, loss=2.5), [[0, 1]], window, POLICY)
    assert spike.kind == SPIKE
    assert "above" in spike.detail
    assert judge(rows(7, 7, loss=2.5), [[0, 1]], window[:4], POLICY).kind == OK  # not full
    off = IntegrityPolicy(loss_window=5, spike_watch=False)
    assert judge(rows(7, 7, loss=2.5), [[0, 1]], window, off).kind == OK


def test_the_loss_window_keeps_its_size_rewinds_and_travels_in_a_snapshot() -> None:
    window = LossWindow(3)
    for step in range(1, 6):
        window.add(step, float(step))
    assert window.values() == [3.0, 4.0, 5.0]
    saved = window.to_json()
    window.rewind(4)
    assert window.values() == [3.0, 4.0]
    other = LossWindow(3)
    other.load(saved, 4)  # a snapshot of step 5 restored as step 4's state: nothing later
    assert other.values() == [3.0, 4.0]


def test_the_digest_covers_the_weights_not_the_rng_and_sees_one_flipped_bit() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    digest = state_digest({**tensors, "rng.torch": torch.get_rng_state()})
    torch.rand(3)  # the RNG moves; the digest does not
    assert state_digest({**tensors, "rng.torch": torch.get_rng_state()}) == digest
    assert flip_a_bit(model) == "weight"
    assert state_digest(tensors) != digest
    poison(model)
    assert all(torch.isnan(p).all() for p in model.parameters())


def test_the_rank_reads_the_policy_and_the_steps_to_skip_from_its_environment() -> None:
    config = RankConfig.from_env(
        {
            "PITSTOP_SDC_CHECK": "0",
            "PITSTOP_LOSS_WINDOW": "50",
            "PITSTOP_SPIKE_SIGMA": "4.5",
            "PITSTOP_MAX_ROLLBACKS": "2",
            "PITSTOP_SKIP_STEPS": "17,40",
        }
    )
    assert config.integrity == IntegrityPolicy(
        sdc_check=False, spike_watch=True, loss_window=50, spike_sigma=4.5, max_rollbacks=2
    )
    assert config.skip_steps == {17, 40}
    assert RankConfig.from_env({}).integrity == IntegrityPolicy()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PITSTOP_SKIP_STEPS", "17,x"),
        ("PITSTOP_SKIP_STEPS", "0"),
        ("PITSTOP_SDC_CHECK", "maybe"),
        ("PITSTOP_SPIKE_SIGMA", "nan"),
        ("PITSTOP_LOSS_WINDOW", "1"),
    ],
)
def test_an_unusable_setting_is_refused_with_its_name(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        RankConfig.from_env({name: value})
