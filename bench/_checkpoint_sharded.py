"""bench/checkpoint.py's sharded case: a model's state sharded over two rank processes
of bench/checkpoint.py on a gloo mesh, each snapshotting into pitstop's daemons, against
async save of the same state."""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import grpc
import torch

from bench._checkpoint_cases import (
    LARGE_MB,
    LARGE_REPS,
    MB,
    TARGET_VS_ASYNC_SAVE,
    TARGET_VS_MEMCPY,
    bench_memcpy_and_pitstop,
    budget_bytes,
    daemons,
    progress,
    spin,
    state_bytes,
    tuned_stager,
)
from pitstop.client.launch import clean_env
from pitstop.v1 import checkpoint_pb2_grpc

SCRIPT = Path(__file__).resolve().with_name("checkpoint.py")
"""What each rank process runs: bench/checkpoint.py, with --sharded-rank."""
SHARDED_WORLD = 2
SHARDED_LAYERS = 8


class Stack(torch.nn.Module):
    """A stack of square linear layers: the sharded case's model (never run forward)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width, bias=False) for _ in range(SHARDED_LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def sharded_state(local_bytes: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model FSDP2-sharded over a gloo mesh of SHARDED_WORLD ranks with AdamW's state:
    `local_bytes` on this rank, a third parameters and two thirds exp_avg/exp_avg_sq,
    all DTensors. Built on the meta device, so no rank ever holds the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    whole_parameters = local_bytes // 3 * SHARDED_WORLD
    width = int((whole_parameters / (SHARDED_LAYERS * 4)) ** 0.5) // SHARDED_WORLD * SHARDED_WORLD
    mesh = init_device_mesh("cpu", (SHARDED_WORLD,))
    with torch.device("meta"):
        model = Stack(width)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for parameter in model.parameters():
            assert isinstance(parameter, DTensor)
            parameter._local_tensor.uniform_(-0.02, 0.02, generator=generator)
            parameter.grad = torch.zeros_like(parameter)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.step()  # with zero gradients: the moments exist, as DTensors
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def bench_sharded_async_save(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, reps: int, workdir: Path
) -> tuple[float, float]:
    """DCP's async_save of the sharded state with a persistent stager (tuned_stager),
    made by every rank in step (it is collective): the median stall from get_state_dict
    until its staging completes, and the get_state_dict part of it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    stager = tuned_stager()
    stalls, built = [], []
    for rep in range(1 + reps):  # one unmeasured warm-up
        target = workdir / f"dcp-sharded-{rep}"
        dist.barrier()
        spin()
        started = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        got = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pending = async_save(
                {"model": model_state, "optim": optim_state},
                checkpoint_id=str(target),
                async_stager=stager,
            )
        if not isinstance(pending, AsyncSaveResponse):
            raise RuntimeError("a staging stager's async_save answered no staging future")
        pending.staging_completion.result()
        elapsed = time.perf_counter() - started
        pending.upload_completion.result()
        dist.barrier()  # every rank's files written before they are removed
        if dist.get_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)
        if rep:
            stalls.append(elapsed)
            built.append(got - started)
    return statistics.median(stalls), statistics.median(built)


def sharded_rank(args: argparse.Namespace) -> None:
    """One rank of the sharded case, a process of its own (the hidden --sharded-rank).
    Rank 0 measures memcpy and pitstop while rank 1 waits; both make DCP's calls."""
    import torch.distributed as dist

    from pitstop.trainer.state import Capturer, TrainState

    if sys.platform == "linux":  # brought down with the bench, however it ends
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != args.sharded_parent:
            return
    rank = args.sharded_rank
    torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.sharded_port}",
        rank=rank,
        world_size=SHARDED_WORLD,
        timeout=datetime.timedelta(minutes=30),
    )
    try:
        workdir = Path(args.sharded_workdir)
        model, optimizer = sharded_state(args.sharded_mb * MB, rank)
        state = TrainState(model, optimizer)
        capturer = Capturer()
        captures: list[float] = []

        def take() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
            started = time.perf_counter()
            taken = capturer(state)
            captures.append(time.perf_counter() - started)
            return taken

        local, _ = capturer(state)
        total = state_bytes(local)
        dist.barrier()  # both ranks built
        if rank == 0:
            progress(f"sharded: {total} local bytes per rank in {len(local)} tensors")
            a, b = args.sharded_daemons.split(",")
            buddy = checkpoint_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(b))
            copies, single, stalls, sealed, writer = bench_memcpy_and_pitstop(
                local, args.reps, "bench-sharded", a, buddy, take
            )
            threads = writer.copy_threads
            writer.close()
            memcpy_s, pitstop_s = statistics.median(copies), statistics.median(stalls)
            capture_s = statistics.median(captures[-args.reps :])
            progress(
                f"sharded: memcpy {memcpy_s * 1e3:.1f} ms on {threads} threads, pitstop stall "
                f"{pitstop_s * 1e3:.1f} ms (capture {capture_s * 1e3:.1f} ms)"
            )
            progress(f"sharded: each memcpy, ms: {' '.join(f'{c * 1e3:.1f}' for c in copies)}")
            progress(f"sharded: each stall, ms:  {' '.join(f'{p * 1e3:.1f}' for p in stalls)}")
        del local
        async_s, state_dict_s = bench_sharded_async_save(model, optimizer, args.reps, workdir)
        if rank == 0:
            progress(f"sharded: dcp.async_save staged in {async_s * 1e3:.1f} ms (tuned)")
            result = {
                "bytes_per_rank": total,
                "world": SHARDED_WORLD,
                "reps": args.reps,
                "memcpy_ms": round(memcpy_s * 1e3, 2),
                "memcpy_threads": threads,
                "memcpy_1thread_ms": round(statistics.median(single) * 1e3, 2),
                "pitstop_stall_ms": round(pitstop_s * 1e3, 2),
                "pitstop_capture_ms": round(capture_s * 1e3, 2),
                "pitstop_sealed_ms": round(statistics.median(sealed) * 1e3, 2),
                "async_save_ms": round(async_s * 1e3, 2),
                "async_save_get_state_dict_ms": round(state_dict_s * 1e3, 2),
                "pitstop_vs_memcpy": round(pitstop_s / memcpy_s, 3),
                "pitstop_vs_memcpy_paired": round(
                    statistics.median(p / c for p, c in zip(stalls, copies, strict=True)), 3
                ),
                "pitstop_vs_async_save": round(pitstop_s / async_s, 3),
                "target_vs_memcpy_met": pitstop_s <= TARGET_VS_MEMCPY * memcpy_s,
                "target_vs_async_save_met": pitstop_s <= TARGET_VS_ASYNC_SAVE * async_s,
            }
            Path(args.sharded_out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_sharded_case(size_mb: int, reps: int, workdir: Path) -> dict[str, Any]:
    """The sharded case: two rank processes of this script on a gloo mesh, rank 0
    snapshotting into daemons of their own (the plain cases' are stopped by now)."""
    if size_mb >= LARGE_MB:
        reps = min(reps, LARGE_REPS)
    out = workdir / "sharded.json"
    with daemons(workdir, budget_bytes([size_mb])) as (a, b):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = clean_env()
        ranks: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(SHARDED_WORLD):
                command = [sys.executable, str(SCRIPT), "--reps", str(reps)]
                command += ["--sharded-rank", str(rank), "--sharded-mb", str(size_mb)]
                command += ["--sharded-port", str(port), "--sharded-daemons", f"{a},{b}"]
                command += ["--sharded-workdir", str(workdir), "--sharded-out", str(out)]
                command += ["--sharded-parent", str(os.getpid())]
                ranks.append(subprocess.Popen(command, stdout=sys.stderr, env=env))
            deadline = time.monotonic() + 3600
            while any(r.poll() is None for r in ranks):
                failed = [r.returncode for r in ranks if r.returncode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a sharded rank exited with {failed[0]}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the sharded case did not end within an hour")
                time.sleep(0.2)  # the parent of two busy ranks, not a test
            failed = [r.returncode for r in ranks if r.returncode]
            if failed:
                raise RuntimeError(f"a sharded rank exited with {failed[0]}")
        finally:
            for rank_process in ranks:
                if rank_process.poll() is None:
                    rank_process.kill()
                rank_process.wait()
    result: dict[str, Any] = json.loads(out.read_text())
    return result
