"""bench/checkpoint.py's loop case: what a snapshot adds to a training loop whose steps
compute (forward, backward, an Adam step), for pitstop and for DCP's tuned async_save,
each treated alike: saved at the end of a step, the next step's optimizer step waiting
for what is left of the copy (pitstop: the pre-hook a Session puts on the optimizer;
async_save: its `staging_completion`, as torchtitan waits for staging before the next
optimizer step), and the background work after the copy (pitstop's seal and replica,
async_save's write) done before the next round, untimed, as between snapshots seconds
apart.

Two ways to share the machine's CPUs (`cpus`): "split" stands for a GPU node, whose
training computes on the accelerator while the host's many cores are free: the loop
computes on half the CPUs' worth of torch threads and the checkpoint daemons are pinned
to the other half, where the copy's, the seal's and async_save's own threads find room
too. "shared": the loop on every CPU and the daemons anywhere, so that on a few cores
whatever runs in the background (pitstop's daemons checksumming and replicating a
snapshot, async_save writing its files) is taken from the loop's compute."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import torch

from bench._checkpoint_cases import (
    DAEMON_PIDS,
    MB,
    WARMUP,
    CopyPool,
    memcpy_once,
    progress,
    size_label,
    spin,
    state_bytes,
    wait_for_replica,
)
from pitstop.rankside.writer import SnapshotWriter
from pitstop.trainer.state import Capturer, TrainState
from pitstop.v1 import checkpoint_pb2_grpc

WIDTH = 1024
"""The model's layers are WIDTH x WIDTH linear maps."""
BATCH = 32
TARGET_VS_MEMCPY = 0.25
TARGET_VS_ASYNC_SAVE = 0.5


def make_loop_state(total_bytes: int) -> TrainState:
    """Linear layers and Adam, `total_bytes` of state in all (a third parameters), after
    one step (Adam's moments exist)."""
    layers = max(1, round(total_bytes / (3 * 4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(m for _ in range(layers) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()))
    )
    state = TrainState(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    train_step(state)
    return state


def train_step(state: TrainState) -> None:
    assert state.optimizer is not None
    batch = torch.randn(BATCH, WIDTH)
    state.optimizer.zero_grad()
    state.model(batch).pow(2).mean().backward()
    state.optimizer.step()


@contextmanager
def cpus(mode: str) -> Iterator[dict[str, Any]]:
    """The CPUs shared as `mode` says (see the module), for the length of the block;
    yields how, for the output."""
    every = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if mode == "shared" or len(every) < 2:
        yield {"cpus": "shared", "torch_threads": threads, "cpu_count": len(every)}
        return
    half = len(every) // 2
    daemons = set(every[half:])
    torch.set_num_threads(half)
    _pin_daemons(daemons)
    try:
        yield {"cpus": "split", "torch_threads": half, "daemon_cpus": sorted(daemons)}
    finally:
        torch.set_num_threads(threads)
        _pin_daemons(set(every))


def _pin_daemons(cpus: set[int]) -> None:
    """Every thread of the checkpoint daemons onto `cpus` (those they start later
    inherit it)."""
    for pid in DAEMON_PIDS.values():
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended
                os.sched_setaffinity(int(task), cpus)


MODES = ("split", "shared")


def run_loop_case(
    size_mb: int, reps: int, a: str, b: str, workdir: Path, stager: Any
) -> dict[str, Any]:
    """For each way of sharing the CPUs (MODES), bare steps and a snapshot plus the next
    step for pitstop and for async_save, interleaved round by round (the order turning),
    each round's median taken. One state and one writer (one job) for all: the daemons
    keep one job's snapshots, not one per mode."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    label = size_label(size_mb)
    state = make_loop_state(size_mb * MB)
    assert state.optimizer is not None
    capture = Capturer()
    tensors, _ = capture(state)
    saved = {k: v for k, v in tensors.items() if k in capture.behind}
    total = state_bytes(saved)
    writer = SnapshotWriter(a, f"loop-{label}", 0, timeout_s=120)
    buddy = checkpoint_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(b))
    waiting: list[Callable[[], None]] = []  # what the next optimizer step waits for

    def before_optimizer_step(*_: object) -> None:
        for wait in waiting:
            wait()

    state.optimizer.register_step_pre_hook(before_optimizer_step)
    progress(f"loop {label}: {total} bytes of parameters and Adam state")
    step = 0

    def pitstop() -> float:
        nonlocal step
        step += 1
        spin()
        started = time.perf_counter()
        tensors, metadata = capture(state)
        result = writer.snapshot(step, tensors, metadata, behind=capture.behind)
        waiting[:] = [writer.wait_copied]
        train_step(state)
        elapsed = time.perf_counter() - started
        if result.skipped:
            raise RuntimeError(f"snapshot skipped: {result.skipped}")
        wait_for_replica(buddy, writer.job_id, step)
        writer.wait()
        return elapsed

    counter = iter(range(1_000_000))

    def dcp() -> float:
        assert state.optimizer is not None
        target = workdir / f"loop-dcp-{next(counter)}"
        spin()
        started = time.perf_counter()
        dcp_state = {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pending = async_save(dcp_state, checkpoint_id=str(target), async_stager=stager)
        if not isinstance(pending, AsyncSaveResponse):
            raise RuntimeError("a staging stager's async_save answered no staging future")
        waiting[:] = [pending.staging_completion.result]
        train_step(state)
        elapsed = time.perf_counter() - started
        pending.upload_completion.result()
        shutil.rmtree(target, ignore_errors=True)
        return elapsed

    def bare() -> float:
        waiting.clear()
        spin()
        started = time.perf_counter()
        train_step(state)
        return time.perf_counter() - started

    measures = {"bare": bare, "pitstop": pitstop, "async_save": dcp}
    target = torch.zeros(total, dtype=torch.uint8)  # pre-faulted
    pool = CopyPool(writer.copy_threads)
    results = {}
    for mode in MODES:
        with cpus(mode) as shared:
            rounds: dict[str, list[float]] = {name: [] for name in (*measures, "memcpy")}
            for _ in range(WARMUP):  # each slot mapped, the stager's buffers allocated
                for measure in measures.values():
                    measure()
            for rep in range(reps):
                order = list(measures)[rep % 3 :] + list(measures)[: rep % 3]
                for name in order:
                    rounds[name].append(measures[name]())
                rounds["memcpy"].append(memcpy_once(saved, target, pool))
        for name, times in rounds.items():
            progress(
                f"loop {label} ({mode}): {name}, ms: {' '.join(f'{t * 1e3:.1f}' for t in times)}"
            )
        results[mode] = {**shared, **_summary(rounds, total, reps, state, writer.copy_threads)}
    pool.shutdown()
    writer.close()
    return results


def _summary(
    rounds: dict[str, list[float]], total: int, reps: int, state: TrainState, threads: int
) -> dict[str, Any]:
    median = {name: statistics.median(times) for name, times in rounds.items()}
    added = {name: median[name] - median["bare"] for name in ("pitstop", "async_save")}
    return {
        "bytes": total,
        "reps": reps,
        "layers": sum(isinstance(m, torch.nn.Linear) for m in state.model.modules()),
        "width": WIDTH,
        "batch": BATCH,
        "step_ms": round(median["bare"] * 1e3, 2),
        "pitstop_added_ms": round(added["pitstop"] * 1e3, 2),
        "async_save_added_ms": round(added["async_save"] * 1e3, 2),
        "memcpy_ms": round(median["memcpy"] * 1e3, 2),
        "memcpy_threads": threads,
        "pitstop_vs_memcpy": round(added["pitstop"] / median["memcpy"], 3),
        "pitstop_vs_async_save": round(added["pitstop"] / added["async_save"], 3)
        if added["async_save"] > 0
        else None,
        "target_vs_memcpy_met": added["pitstop"] <= TARGET_VS_MEMCPY * median["memcpy"],
        "target_vs_async_save_met": added["pitstop"]
        <= TARGET_VS_ASYNC_SAVE * max(added["async_save"], 0.0),
        "rounds_ms": {k: [round(t * 1e3, 2) for t in v] for k, v in rounds.items()},
    }
