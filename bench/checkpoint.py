"""Benchmark of the rank-visible checkpoint stall, side by side with the alternatives.

For each state size (default 100 MB and 1 GB, in one run) it builds a realistic
model-plus-optimizer state (float32 parameters in 8 tensors plus Adam's two moments,
so parameters are a third of the bytes) and measures, median of --reps repetitions after
unmeasured warm-ups:

* memcpy: memmove of the same bytes into a pre-faulted buffer on as many threads as
  pitstop's writer copies with (`SnapshotWriter.copy_threads`: one per CPU, at most
  4), each thread a contiguous share, as the floor; and on one thread, for reference;
* pitstop: SnapshotWriter.snapshot into a real checkpointd -- the rank's whole stall: the
  copy into shared memory, and whatever else the writer does before returning (its
  seal and the lease of the next slot run in the background). Between repetitions the
  bench waits until the buddy holds the replica, so each snapshot starts with the
  daemons idle, as at a step boundary seconds after the previous one;
* torch_save: torch.save of the state to a file on local disk (until it returns; the
  bytes may still be in the page cache);
* async_save: torch.distributed.checkpoint.async_save at its best, as torch's docs
  describe it: one persistent `DefaultStager` (its staging buffers allocated once and
  reused; pinned memory and non-blocking copies on a side stream where there is a GPU,
  as torchtitan's `async_with_pinned_mem` mode stages), a process group (gloo, one
  rank), timed from the call to its `staging_completion`: the moment training may change
  the state again. The write to disk goes on in a thread and is awaited, untimed;
* async_save_cold: async_save with its defaults (a fresh stager each call, no process
  group), until it returns, for reference.

Also replication MB/s (one shard pushed over PushShard to the buddy daemon on loopback,
checksum verified by the receiver) and flush MB/s (DurableStore.write_checkpoint to a
file:// store on local disk, fsync included).

Then the sharded case (--sharded-mb, default 1000; 0 leaves it out): a stack of linear
layers FSDP2-sharded (`fully_shard`) over a gloo mesh of two ranks, with AdamW's moments
after one step, ~1 GB of local bytes per rank (a third parameters), all DTensors built on
the meta device. The two ranks are processes of this script (a hidden --sharded-rank),
killed with it however it ends. Rank 0 measures, interleaved as above, one memcpy of its
local bytes against pitstop's stall as a Session's snapshot has it: `Capturer` (local
shards plus their placement metadata) and SnapshotWriter.snapshot of the tensors and
metadata, capture included; then both ranks, in step, DCP's async_save of
get_state_dict(model, optimizer) until it returns (get_state_dict included).

Targets (issue 30): pitstop's stall at most 1.2 x the threaded memcpy and at most 0.5 x
the tuned async_save's, for every size.

Then the loop case (--loop-sizes-mb, default 100,1000; empty leaves it out): a training
loop whose steps compute (a stack of 1024 x 1024 linear layers, a batch of 32, Adam;
parameters and Adam's moments of the given size), and what a snapshot adds to it: the
snapshot at the end of a step plus the next step, against a bare step, median of --reps
rounds (bench/_checkpoint_loop.py). pitstop's copy of the parameters and the optimizer's
state runs beside the next step's forward and backward, and its optimizer step waits
for what is left (as a Session has it); the tuned async_save is treated alike (its
optimizer step waits for `staging_completion`, as torchtitan waits for staging).
Each runs twice: "split" stands for a GPU node (the loop computes on half the CPUs,
the checkpoint daemons are pinned to the other half, as an accelerator leaves a node's
host cores free), "shared" has the loop and the daemons on every CPU (on a few cores,
the daemons' checksums and replication, and async_save's writes, are taken from the
loop). Targets (issue 54): what pitstop adds at most 0.25 x the threaded memcpy of the
same bytes (`pitstop_vs_memcpy`) and at most 0.5 x what async_save adds
(`pitstop_vs_async_save`).

Two daemons run as subprocesses (`python -m pitstop.checkpointd.main run`), the first
replicating to the second, each with the memory budget `budget_bytes` gives: room for
every plain case at once, so the 1 GB case runs after the 100 MB one in the same daemons;
the sharded case has a pair of its own, started after those are stopped.
--cuda adds the same for a state on the GPU (default 1 and 10 GB), where the floor is
one copy into pinned host memory (cudaMemcpy) and pitstop's stall is what a Session's
snapshot holds the loop for on CUDA: the device-to-pinned-host copies enqueued on a side
stream, then waited for until they have landed (`SnapshotWriter.wait_copied`); the move
into the slot and the seal go on in the background. Run from the repository root:

    .venv/bin/python bench/checkpoint.py [--sizes-mb 100,1000] [--sharded-mb 1000]
        [--loop-sizes-mb 100,1000] [--reps 5] [--cuda]

Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._checkpoint_cases import (
    async_save_config,
    budget_bytes,
    daemons,
    run_case,
    run_cuda_case,
    single_rank_group,
    size_label,
    tuned_stager,
)
from bench._checkpoint_loop import run_loop_case
from bench._checkpoint_sharded import run_sharded_case, sharded_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--sizes-mb", default="100,1000", help="state sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="measured repetitions per method")
    parser.add_argument("--cuda", action="store_true", help="also a state on the GPU")
    parser.add_argument(
        "--loop-sizes-mb", default="100,1000", help="state sizes of the loop case (empty: none)"
    )
    parser.add_argument(
        "--cuda-sizes-gb", default="1,10", help="state sizes on the GPU, GB, comma-separated"
    )
    parser.add_argument(
        "--sharded-mb",
        type=int,
        default=1000,
        help="local bytes per rank of the FSDP2-sharded case, in MB (0: no sharded case)",
    )
    for hidden in ("rank", "port", "parent"):
        parser.add_argument(f"--sharded-{hidden}", type=int, default=-1, help=argparse.SUPPRESS)
    for hidden in ("daemons", "workdir", "out"):
        parser.add_argument(f"--sharded-{hidden}", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sharded_rank >= 0:
        sharded_rank(args)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks stop the daemons
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    loop_sizes = [int(s) for s in args.loop_sizes_mb.split(",") if s]
    torch.set_num_threads(os.cpu_count() or 1)
    report: dict[str, Any] = {
        "bench": "checkpoint",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "reps": args.reps,
        "cases": {},
    }
    cuda_sizes = [float(s) for s in args.cuda_sizes_gb.split(",") if s] if args.cuda else []
    gpu = torch.cuda.is_available()
    if gpu:
        report["gpu"] = torch.cuda.get_device_name(0)
    budget = budget_bytes(sizes + loop_sizes + [int(size * 1000) for size in cuda_sizes if gpu])
    report["memory_budget_bytes"] = budget
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-", dir="/var/tmp") as tmp:
        workdir = Path(tmp)
        with daemons(workdir, budget) as (a, b), single_rank_group():
            stager = tuned_stager()
            report["async_save_config"] = async_save_config(stager)
            for size in sizes:
                label = size_label(size)
                report["cases"][label] = run_case(size, args.reps, a, b, workdir, stager)
            report["loop"] = {
                size_label(size): run_loop_case(size, args.reps, a, b, workdir, stager)
                for size in loop_sizes
            }
            stager.close()
            if cuda_sizes and gpu:
                stager = tuned_stager(gpu=True)
                report["cuda_async_save_config"] = async_save_config(stager)
                report["cuda"] = {
                    f"{size:g}GB": run_cuda_case(size, args.reps, a, b, workdir, stager)
                    for size in cuda_sizes
                }
                stager.close()
            elif cuda_sizes:
                report["cuda"] = "skipped: torch.cuda.is_available() is False"
        if args.sharded_mb > 0:
            label = f"sharded-{size_label(args.sharded_mb)}-per-rank"
            report["cases"][label] = run_sharded_case(args.sharded_mb, args.reps, workdir)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
