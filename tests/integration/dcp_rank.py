"""A rank for the DCP test: saves pitstop's durable checkpoint of `sharded_rank.py`'s
model (tensor parallel over "tp", FSDP2 over "dp"), or loads one with
torch.distributed.checkpoint through `DurableReader`.

    python dcp_rank.py save --url URL --job JOB --out DIR
    python dcp_rank.py load --url URL --job JOB --out DIR
    (RANK, WORLD_SIZE, MASTER_*, PITSTOP_DP/PP/TP set)

save: trains 3 steps, captures the state and writes it the way checkpointd flushes it
(`DurableStore.write_checkpoint`: the rank's safetensors shard, then its node's
manifest); rank 0 keeps the whole tensors (`full_tensor()`) in DIR/full.safetensors.
Then trains 2 more steps and flushes step 5 from ranks 0 and 1 only: a flush another
node never finished.

load: builds the model on this run's mesh, zeroes it, `dcp.load`s the newest complete
durable step into `model.state_dict()` and writes DIR/load-R.json: the step loaded,
whether each local shard equals the one this rank saved (same rank, same mesh), and
whether each whole tensor equals the saved one, bitwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load, load_file, save, save_file
from sharded_rank import build, train
from torch.distributed.tensor import DTensor

from pitstop.rankside.durable import DurableShard, DurableStore
from pitstop.rankside.shards import shard_checksum
from pitstop.trainer.config import RankConfig
from pitstop.trainer.dcp import DurableReader
from pitstop.trainer.mesh import build_mesh
from pitstop.trainer.state import TrainState, capture


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def flush(state: TrainState, url: str, job: str, rank: int) -> None:
    flat, metadata = capture(state)
    data = save({k: v.detach().contiguous() for k, v in flat.items()}, metadata)
    shard = DurableShard(rank, memoryview(data), shard_checksum(data))
    DurableStore(url, f"node-{rank}").write_checkpoint(job, state.step, 1, [shard])


def whole(state: TrainState) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().contiguous()
        for k, v in state.model.state_dict().items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = RankConfig.from_env()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    state = build(build_mesh(config.shape, torch.device("cpu")))
    if args.mode == "save":
        train(state, 3)
        flush(state, args.url, args.job, config.rank)
        full = whole(state)
        if config.rank == 0:
            save_file(full, str(args.out / "full.safetensors"))
        train(state, 2)
        if config.rank < 2:
            flush(state, args.url, args.job, config.rank)
    else:
        with torch.no_grad():
            for tensor in state.model.state_dict().values():
                tensor.zero_()
        reader = DurableReader(args.url, args.job)
        state_dict = state.model.state_dict()
        dcp.load(state_dict, storage_reader=reader)
        full = load_file(str(args.out / "full.safetensors"))
        same_world = len(reader.entries) == config.shape.world_size
        mine = reader.entries[config.rank].path if same_world else None
        saved = load(Path(mine).read_bytes()) if mine else {}
        local = {}
        for key, value in state_dict.items():
            held = value._local_tensor if isinstance(value, DTensor) else value
            if f"model.{key}" in saved:
                local[key] = bool(torch.equal(bits(held), bits(saved[f"model.{key}"])))
        loaded = whole(state)
        record = {
            "step": reader.step,
            "local": local,
            "full": {k: bool(torch.equal(bits(v), bits(full[k]))) for k, v in loaded.items()},
        }
        (args.out / f"load-{config.rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
