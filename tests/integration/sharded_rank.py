"""A rank for the sharded-state test: a small model tensor-parallel over "tp" and
FSDP2-sharded over "dp" on pitstop's ("dp", "pp", "tp") mesh (gloo), trained with AdamW.

    python sharded_rank.py --out DIR   (RANK, WORLD_SIZE, MASTER_*, PITSTOP_DP/PP/TP set)

Trains 3 steps and captures the state (pitstop's `capture`: local shards plus their
placement metadata), saves it as DIR/rank-R.safetensors, trains 2 more steps. Then it
builds the model afresh on a new mesh (step 0, no optimizer state: what a replacement
rank or a rebuild after a recovery starts from), restores the saved state into it
(`apply`) and trains the same 2 steps. Writes DIR/rank-R.json: the local shards' digest after both
runs, the whole tensors' digest (model and optimizer state, gathered) at step 3 and 5,
and for each sharded tensor whether the shards placed by their metadata (gathered from
every rank) equal the whole tensor.

    python sharded_rank.py --out DIR2 --reshard-from DIR --survivor D

A job of fewer data-parallel replicas (a shrink) builds its model on its own mesh,
cuts the saved step-3 states of the first run's ranks to its shards (`reshard`, with
the non-sharded state from the old replica D's rank at its coordinates), and writes
DIR2/rank-R.json: the whole tensors' digest at step 3 and after the same 2 steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pitstop.trainer.config import RankConfig
from pitstop.trainer.mesh import Shape, build_mesh
from pitstop.trainer.reshard import reshard
from pitstop.trainer.state import TrainState, apply, capture


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build(mesh: object) -> TrainState:
    torch.manual_seed(0)
    model = Block()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState(model=model, optimizer=optimizer)


def train(state: TrainState, steps: int) -> None:
    for _ in range(steps):
        generator = torch.Generator().manual_seed(1000 + state.step)
        batch = torch.randn(4, 16, generator=generator)
        state.model(batch).pow(2).mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1


def digest(state: TrainState) -> str:
    flat, _ = capture(state)
    h = hashlib.sha256()
    for name in sorted(flat):
        if name.startswith(("model.", "optim.")):
            h.update(name.encode())
            h.update(
                flat[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
    return h.hexdigest()


def whole_digest(state: TrainState) -> str:
    """sha256 of every parameter and optimizer state tensor, whole (gathered from the
    shards): the same on every rank, and the same for any sharding of the same state."""
    h = hashlib.sha256()
    params = list(state.model.named_parameters())
    moments = state.optimizer.state
    for name, param in params:
        tensors = [("param", param), *sorted(moments.get(param, {}).items())]
        for key, value in tensors:
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            h.update(f"{name}.{key}".encode())
            h.update(whole.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def resharded(args: argparse.Namespace, config: RankConfig) -> None:
    """The shrunk job's rank: the first run's step-3 states, cut to this mesh."""
    state = build(build_mesh(config.shape, torch.device("cpu")))
    old = json.loads((args.reshard_from / "shape.json").read_text())
    taken = Shape(old["dp"], 1, old["tp"], 0, config.shape.pp_rank, config.shape.tp_rank)
    sources = []
    for dp_rank in range(taken.dp):
        path = args.reshard_from / f"rank-{taken.at(dp_rank).rank}.safetensors"
        with safe_open(str(path), "pt") as saved_file:
            sources.append((load_file(str(path)), saved_file.metadata()))
    own = sources[args.survivor]
    apply(state, *reshard(state, own, sources))
    record = {"restored_at": state.step, "whole_at_3": whole_digest(state)}
    train(state, 2)
    record["whole_at_5"] = whole_digest(state)
    (args.out / f"rank-{config.rank}.json").write_text(json.dumps(record))


def placed_right(state: TrainState) -> dict[str, bool]:
    """Per sharded tensor: do the shards, put where their metadata says, make the whole?"""
    flat, metadata = capture(state)
    shards = json.loads(metadata["pitstop.dtensor"])
    whole = {k: v for k, v in state.model.state_dict().items()}
    found = {}
    for name, where in shards.items():
        if not name.startswith("model."):
            continue
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (where, flat[name].detach().clone()))
        assembled = torch.zeros(where["shape"], dtype=flat[name].dtype)
        for shard_where, shard in gathered:
            index = tuple(
                slice(o, o + n)
                for o, n in zip(shard_where["offset"], shard_where["local"], strict=True)
            )
            assembled[index] = shard
        expected = whole[name.removeprefix("model.")]
        assert isinstance(expected, DTensor)
        found[name] = bool(torch.equal(assembled, expected.full_tensor()))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reshard-from", type=Path)
    parser.add_argument("--survivor", type=int, default=0)
    args = parser.parse_args()
    config = RankConfig.from_env()
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    if args.reshard_from is not None:
        resharded(args, config)
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)
    mesh = build_mesh(config.shape, torch.device("cpu"))
    state = build(mesh)
    train(state, 3)
    flat, metadata = capture(state)
    path = args.out / f"rank-{config.rank}.safetensors"
    save_file({k: v.detach().contiguous() for k, v in flat.items()}, str(path), metadata)
    layout = placed_right(state)
    whole_at_3 = whole_digest(state)
    train(state, 2)
    straight = digest(state)
    whole_at_5 = whole_digest(state)
    shape = {"dp": config.shape.dp, "tp": config.shape.tp}
    (args.out / "shape.json").write_text(json.dumps(shape))
    fresh = build(build_mesh(config.shape, torch.device("cpu")))
    saved = load_file(str(path))
    with safe_open(str(path), "pt") as saved_file:
        saved_metadata = saved_file.metadata()
    apply(fresh, saved, saved_metadata)
    restored_at = fresh.step
    train(fresh, 2)
    record = {
        "straight": straight,
        "restored": digest(fresh),
        "restored_at": restored_at,
        "placed_right": layout,
        "whole_at_3": whole_at_3,
        "whole_at_5": whole_at_5,
        "coordinates": list(config.shape.coordinates),
    }
    (args.out / f"rank-{config.rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
