"""TrainState capture and restore: bitwise, through the shard format, without pickle."""

from __future__ import annotations

import pickle
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pitstop.rankside.format import plan_shard, read_layout, write_header  # noqa: E402
from pitstop.rankside.tensorcopy import copy_into, describe, read_tensor  # noqa: E402
from pitstop.trainer.commands import PAUSE, RECONFIGURE, STOP, agree  # noqa: E402
from pitstop.trainer.config import ConfigError, RankConfig  # noqa: E402
from pitstop.trainer.state import StateFormatError, TrainState, apply, capture  # noqa: E402


def make_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    return TrainState(model, optimizer, cursor={"epoch": 0, "index": 0})


def train(state: TrainState, steps: int) -> None:
    """Steps that draw their data from the global RNGs, so only a state whose RNGs were
    restored repeats them."""
    assert state.optimizer is not None
    for _ in range(steps):
        x = torch.randn(32, 8) + random.random()
        state.optimizer.zero_grad()
        state.model(x).square().mean().backward()
        for group in state.optimizer.param_groups:
            group["lr"] *= 0.9  # a schedule: hyperparameters change as training goes
        state.optimizer.step()
        state.cursor["index"] += 32
        state.step += 1


def through_shard(
    tensors: dict[str, Any], metadata: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Write a captured state into shard bytes and read it back, as checkpointd would."""
    layout = plan_shard([describe(name, value) for name, value in tensors.items()], metadata)
    buffer = bytearray(layout.size)
    view = memoryview(buffer)
    write_header(layout, view)
    for name, value in tensors.items():
        begin, end = layout.span(layout.entry(name))
        if end > begin:
            copy_into(value, view, begin, end)
    read = read_layout(bytes(buffer))
    data = memoryview(bytes(buffer))
    return {e.name: read_tensor(data, read, e.name, None) for e in read.entries}, dict(
        read.metadata
    )


def parameters_bytes(state: TrainState) -> list[bytes]:
    return [
        bytes(t.detach().reshape(-1).view(torch.uint8).tolist())
        for t in state.model.state_dict().values()
    ]


def test_restored_state_continues_bitwise() -> None:
    random.seed(5)
    original = make_state(0)
    original.metadata["note"] = "kept"
    original.tensors["ema"] = torch.arange(4.0)
    train(original, 3)
    saved = through_shard(*capture(original))
    train(original, 2)  # what the original does after the snapshot

    restored = make_state(1)  # another init, other RNG draws in between
    random.seed(99)
    train(restored, 1)
    apply(restored, *saved)
    assert restored.step == 3
    assert restored.cursor == {"epoch": 0, "index": 96}
    assert restored.metadata == {"note": "kept"}
    assert torch.equal(restored.tensors["ema"], torch.arange(4.0))
    train(restored, 2)
    assert parameters_bytes(restored) == parameters_bytes(original)
    assert restored.optimizer is not None
    assert original.optimizer is not None
    assert restored.optimizer.param_groups[0]["lr"] == original.optimizer.param_groups[0]["lr"]
    assert restored.optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    for param_r, param_o in zip(
        restored.model.parameters(), original.model.parameters(), strict=True
    ):
        state_r = restored.optimizer.state[param_r]
        state_o = original.optimizer.state[param_o]
        assert set(state_r) == set(state_o) == {"step", "exp_avg", "exp_avg_sq"}
        for key in state_o:
            assert torch.equal(state_r[key], state_o[key]), key


def test_rng_states_give_the_same_next_numbers() -> None:
    state = make_state(0)
    random.seed(3)
    torch.manual_seed(4)
    random.random()
    random.gauss(0, 1)  # leaves gauss_next set
    saved = through_shard(*capture(state))
    expected = (random.random(), random.gauss(0, 1), torch.rand(5))
    random.seed(0)
    torch.manual_seed(0)
    apply(state, *saved)
    assert (random.random(), random.gauss(0, 1)) == expected[:2]
    assert torch.equal(torch.rand(5), expected[2])


def test_a_fresh_optimizer_restores_into_an_empty_one() -> None:
    trained, fresh = make_state(0), make_state(0)
    apply(trained, *capture(fresh))  # roll back to step 0: no Adam state at all
    assert trained.optimizer is not None
    assert len(trained.optimizer.state) == 0


def test_nothing_is_pickled(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle used")

    for module, name in ((pickle, "dumps"), (pickle, "loads"), (pickle, "dump"), (pickle, "load")):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    state = make_state(0)
    train(state, 1)
    tensors, metadata = capture(state)
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    apply(make_state(1), *through_shard(tensors, metadata))


def test_another_model_is_refused_by_name() -> None:
    tensors, metadata = capture(make_state(0))
    other = TrainState(torch.nn.Linear(2, 2))
    with pytest.raises(StateFormatError, match="missing"):
        apply(other, tensors, metadata)


def test_commands_win_in_order_and_need_every_rank() -> None:
    assert agree([0, 0, 0], 1) is None
    assert agree([0, 0, 1], 1) == PAUSE
    assert agree([1, 1, 1], 1) == STOP
    assert agree([0, 1, 1], 1) == RECONFIGURE


def test_config_names_the_bad_variable() -> None:
    config = RankConfig.from_env({"RANK": "1", "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3"})
    assert (config.rank, config.world_size, config.gpu_index, config.distributed) == (1, 2, 3, True)
    assert not RankConfig.from_env({}).distributed
    with pytest.raises(ConfigError, match="PITSTOP_SNAPSHOT_EVERY"):
        RankConfig.from_env({"PITSTOP_SNAPSHOT_EVERY": "often"})
    with pytest.raises(ConfigError, match="RANK=2"):
        RankConfig.from_env({"RANK": "2", "WORLD_SIZE": "2"})
