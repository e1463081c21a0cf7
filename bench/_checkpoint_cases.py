"""bench/checkpoint.py's measurements of one rank's state: memcpy, pitstop's snapshot into
its daemons (and the copy to a peer), torch.save, async save, and host-device transfers
on CUDA."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import torch

from pitstop.checkpointd.replication import CHANNEL_OPTIONS, push_shard
from pitstop.checkpointd.slots import SHM_DIR, remove_stale_segments, segment_prefix
from pitstop.client.launch import checkpointd_command, clean_env
from pitstop.rankside.durable import DurableShard, DurableStore
from pitstop.rankside.shards import shard_checksum
from pitstop.rankside.writer import SnapshotWriter
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

MB = 1_000_000
KEEP_IN_MEMORY = 2  # checkpointd's default keep_in_memory
WARMUP = KEEP_IN_MEMORY + 1  # the slots a rank rotates through: each mapped once first
TENSORS_PER_GROUP = 8
TARGET_VS_MEMCPY = 1.2
TARGET_VS_ASYNC_SAVE = 0.5
ASYNC_SAVE_SOURCE = (
    "torch.distributed.checkpoint.staging.DefaultStager (torch docs: a persistent stager "
    "reuses its staging storages); torchtitan checkpoint.async_mode='async_with_pinned_mem'"
)
LARGE_MB = 500
LARGE_REPS = 3


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def size_label(size_mb: int) -> str:
    return f"{size_mb}MB" if size_mb < 1000 else f"{size_mb / 1000:g}GB"


def make_state(total_bytes: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Parameters, exp_avg and exp_avg_sq: three equal groups of float32 tensors."""
    per_tensor = max(1, total_bytes // (3 * TENSORS_PER_GROUP * 4))
    generator = torch.Generator(device=device).manual_seed(0)
    state = {}
    for i in range(TENSORS_PER_GROUP):
        for group in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
            state[f"{group}.layer{i}"] = torch.rand(per_tensor, generator=generator, device=device)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def budget_bytes(sizes_mb: list[int]) -> int:
    """Each daemon's memory budget: for every case (their jobs stay in memory), the
    KEEP_IN_MEMORY snapshots held plus one more being written (the rank's leased slot
    on the first daemon, a replica being received on its buddy), and the replication
    measurement's pushed copy with the push replacing it; plus the headers' pages."""
    slots = KEEP_IN_MEMORY + 1 + 2
    return slots * sum(sizes_mb) * MB + (64 << 20)


def median_of(reps: int, measure: Callable[[], float], warmup: int = 1) -> float:
    for _ in range(warmup):
        measure()
    return statistics.median(measure() for _ in range(reps))


DAEMON_PIDS: dict[str, int] = {}
"""The running daemons' pids by address (the loop case pins them to CPUs of their own)."""


@contextmanager
def daemons(workdir: Path, budget: int) -> Iterator[tuple[str, str]]:
    """Two checkpointd subprocesses on loopback: A replicates to B."""
    started: list[tuple[subprocess.Popen[str], str]] = []
    addresses: list[str] = []

    def start(name: str, *extra: str) -> str:
        node_id = f"bench-{name}-{os.getpid()}"
        memory = ["--memory-budget-bytes", str(budget), "--flush-every-steps", "1000000"]
        command = checkpointd_command(
            node_id=node_id,
            host="127.0.0.1",
            port=0,
            scheduler="",
            state_dir=workdir / name,
            log_level="WARNING",
            as_module=True,
            extra=[*memory, *extra, "--keep-in-memory", str(KEEP_IN_MEMORY)],
        )
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=clean_env())
        started.append((process, node_id))
        assert process.stdout is not None
        line = process.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"checkpointd {name} did not start: {line!r}")
        address = line.split("listening on ")[1].split()[0]
        DAEMON_PIDS[address] = process.pid
        addresses.append(address)
        return address

    try:
        b = start("b")
        a = start("a", "--buddy", b)
        yield a, b
    finally:
        for process, node_id in started:
            process.terminate()
            process.wait(30)
            remove_stale_segments(segment_prefix(node_id))
        for address in addresses:
            del DAEMON_PIDS[address]


def wait_for_replica(buddy: Any, job: str, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    request = checkpoint_pb2.ListShardsRequest(job_id=job)
    while time.monotonic() < deadline:
        shards = buddy.ListShards(request).shards
        if any(s.header.key.step == step for s in shards):
            return
        time.sleep(0.02)  # a benchmark polling an idle daemon, not a test
    raise RuntimeError(f"replica of {job} step {step} never reached the buddy")


def spin(seconds: float = 0.05) -> None:
    """Busy CPU before a timed operation, as a rank's is right after a training step:
    on a VM, a copy right after idle time runs up to 3x slower."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class CopyPool(ThreadPoolExecutor):
    """The threaded memcpy's threads, started before any copy is timed."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads, "bench-memcpy")
        self.threads = threads
        barrier = threading.Barrier(threads)
        list(self.map(lambda _: barrier.wait(), range(threads)))  # each thread exists


def memcpy_once(
    state: dict[str, torch.Tensor], target: torch.Tensor, pool: CopyPool | None = None
) -> float:
    """One memmove of every tensor into `target`: on this thread, or split into one
    contiguous share per thread of `pool` (the threads started beforehand, untimed)."""
    moves, offset, base = [], 0, target.data_ptr()
    for tensor in state.values():
        size = tensor.numel() * tensor.element_size()
        moves.append((base + offset, tensor.data_ptr(), size))
        offset += size
    threads = pool.threads if pool is not None else 1
    share = -(-offset // threads)
    pieces = []  # (target, source, bytes), each thread's share of the whole
    for thread in range(threads):
        begin, end = thread * share, min(offset, (thread + 1) * share)
        for to, source, size in moves:
            start = to - base
            lo, hi = max(begin, start), min(end, start + size)
            if lo < hi:
                pieces.append((thread, base + lo, source + (lo - start), hi - lo))
    spin()
    started = time.perf_counter()
    if pool is None:
        for _, to, source, size in pieces:
            ctypes.memmove(to, source, size)
    else:

        def run(thread: int) -> None:
            for owner, to, source, size in pieces:
                if owner == thread:
                    ctypes.memmove(to, source, size)

        list(pool.map(run, range(threads)))
    return time.perf_counter() - started


def bench_memcpy_and_pitstop(
    state: dict[str, torch.Tensor],
    reps: int,
    job: str,
    a: str,
    buddy: Any,
    take: Callable[[], tuple[dict[str, torch.Tensor], dict[str, str]]] | None = None,
) -> tuple[list[float], list[float], list[float], list[float], SnapshotWriter]:
    """Threaded memcpy, one-thread memcpy and pitstop stalls, interleaved (alternating
    which goes first) so that all see the same machine state; the daemons are idle
    before every snapshot. `take`: what a Session's snapshot does first (capture the
    state as tensors and metadata), timed as part of the stall; without it `state` is
    snapshotted as is."""
    target = torch.zeros(state_bytes(state), dtype=torch.uint8)  # pre-faulted
    writer = SnapshotWriter(a, job, 0, timeout_s=120)
    pool = CopyPool(writer.copy_threads)
    step = 0
    sealed: list[float] = []

    def snapshot() -> float:
        nonlocal step
        step += 1
        spin()
        started = time.perf_counter()
        tensors, metadata = take() if take is not None else (state, None)
        result = writer.snapshot(step, tensors, metadata)
        stall = time.perf_counter() - started if take is not None else result.stall_seconds
        if result.skipped:
            raise RuntimeError(f"snapshot skipped: {result.skipped}")
        wait_for_replica(buddy, job, step)
        writer.wait()
        sealed.append(writer.sealed_seconds)
        return stall

    for _ in range(WARMUP):
        snapshot()
    memcpy_once(state, target, pool)
    sealed.clear()
    copies, single, stalls = [], [], []
    for rep in range(reps):
        if rep % 2:
            stalls.append(snapshot())
            copies.append(memcpy_once(state, target, pool))
        else:
            copies.append(memcpy_once(state, target, pool))
            stalls.append(snapshot())
        single.append(memcpy_once(state, target))
    pool.shutdown()
    del target
    return copies, single, stalls, sealed, writer


def bench_torch_save(state: dict[str, torch.Tensor], reps: int, workdir: Path) -> float:
    path = workdir / "torch_save.pt"

    def once() -> float:
        spin()
        started = time.perf_counter()
        torch.save(state, path)
        elapsed = time.perf_counter() - started
        path.unlink()
        return elapsed

    return median_of(reps, once)


def tuned_stager(gpu: bool = False) -> Any:
    """DCP's stager at its best: persistent (its staging storages reused from save to
    save), staging in the background; for a state on the GPU, into pinned memory by
    non-blocking copies on a side stream (StagingOptions' defaults, which need one)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=gpu,
            use_shared_memory=False,  # for a checkpointer process; this one is a thread
            use_async_staging=True,
            use_non_blocking_copy=gpu,
        )
    )


def async_save_config(stager: Any) -> dict[str, Any]:
    options = stager._config
    return {
        "stager": "DefaultStager, one for the whole run",
        "use_pinned_memory": options.use_pinned_memory,
        "use_shared_memory": options.use_shared_memory,
        "use_async_staging": options.use_async_staging,
        "use_non_blocking_copy": options.use_non_blocking_copy,
        "async_checkpointer_type": "thread",
        "process_group": "gloo, one rank" if _dist_up() else "none",
        "timed_until": "staging_completion",
        "source": ASYNC_SAVE_SOURCE,
        "fallback": "where this stager fails (a case's async_save_error says so): one "
        "FileSystemWriter(cache_staged_state_dict=True), timed until async_save returns "
        "(torch's async checkpoint tutorial)",
    }


@contextmanager
def single_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone, as a training script has one when it
    saves (async_save plans over it)."""
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dist_up() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def bench_async_save(
    state: dict[str, torch.Tensor], reps: int, workdir: Path, stager: Any
) -> tuple[float | None, float, str]:
    """The tuned async_save (until its staging completes) and the cold one (defaults,
    until it returns): each median of `reps` after a warm-up. Where the persistent
    DefaultStager fails (torch 2.11's raises KeyError on a plain state), the tuned save
    is the recipe of torch's async-checkpoint tutorial instead: one FileSystemWriter
    with `cache_staged_state_dict=True` (its staged copy, pinned where there is a GPU,
    kept and reused), timed until async_save returns (it stages before). The error
    string says so; None where both fail."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    counter = iter(range(1_000_000))
    cached = FileSystemWriter(workdir / "dcp-cached", cache_staged_state_dict=True)

    def once(mode: str) -> float:
        target = workdir / f"dcp-{next(counter)}"
        sync()
        spin()
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode == "stager":
                pending = async_save(state, checkpoint_id=str(target), async_stager=stager)
            elif mode == "cached":
                pending = async_save(state, checkpoint_id=str(target), storage_writer=cached)
            else:
                pending = async_save(state, checkpoint_id=str(target), no_dist=True)
        if mode == "stager":
            if not isinstance(pending, AsyncSaveResponse):
                raise RuntimeError("a staging stager's async_save answered no staging future")
            pending.staging_completion.result()
        elapsed = time.perf_counter() - started
        if isinstance(pending, AsyncSaveResponse):
            pending.upload_completion.result()
        else:
            pending.result()
        shutil.rmtree(target, ignore_errors=True)
        return elapsed

    tuned: float | None = None
    error = ""
    for mode in ("stager", "cached"):
        try:
            tuned = median_of(reps, functools.partial(once, mode))
            break
        except Exception as exc:  # recorded in the output; the other measurements go on
            error += f"{mode}: {type(exc).__name__}: {exc}; "
            progress(f"the tuned async_save ({mode}) failed: {exc!r}")
    if tuned is not None and error:
        error += "measured with FileSystemWriter(cache_staged_state_dict=True) instead"
    return tuned, median_of(reps, functools.partial(once, "cold")), error


def versus(stall: float, other: float | None, target: float) -> dict[str, Any]:
    """pitstop's stall over the tuned async_save's, and whether that meets `target`
    (both None where the tuned save failed)."""
    if other is None:
        return {"pitstop_vs_async_save": None, "target_vs_async_save_met": None}
    return {
        "pitstop_vs_async_save": round(stall / other, 3),
        "target_vs_async_save_met": stall <= target * other,
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def sync() -> None:
    """Every queued GPU copy and kernel done (nothing without a GPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_transfers(
    writer: SnapshotWriter, a: str, b: str, workdir: Path, reps: int
) -> tuple[float, float]:
    """Replication and flush MB/s of the newest shard `writer` sealed."""
    stub = checkpoint_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(a))
    restored = stub.Restore(
        checkpoint_pb2.RestoreRequest(
            key=checkpoint_pb2.ShardKey(job_id=writer.job_id, rank=writer.rank)
        )
    )
    size = restored.header.size_bytes
    with (SHM_DIR / restored.shm_name).open("rb") as file:
        data = memoryview(file.read(size))
    header = checkpoint_pb2.ShardHeader()
    header.CopyFrom(restored.header)
    header.key.job_id = f"{writer.job_id}-push"

    async def push() -> float:
        async with grpc.aio.insecure_channel(b, options=CHANNEL_OPTIONS) as channel:
            buddy = checkpoint_pb2_grpc.CheckpointServiceStub(channel)
            started = time.perf_counter()
            response = await push_shard(buddy, header, data)
            elapsed = time.perf_counter() - started
        if not response.stored:
            raise RuntimeError(f"buddy refused the push: {response.error}")
        return elapsed

    push_s = statistics.median(asyncio.run(push()) for _ in range(reps))
    durable = DurableStore(f"file://{workdir / 'durable'}", "bench")
    checksum = shard_checksum(data)

    def flush() -> float:
        started = time.perf_counter()
        durable.write_checkpoint(writer.job_id, 1, 0, [DurableShard(0, data, checksum)])
        elapsed = time.perf_counter() - started
        shutil.rmtree(workdir / "durable")
        return elapsed

    flush_s = statistics.median(flush() for _ in range(reps))
    return size / push_s / MB, size / flush_s / MB


def run_case(size_mb: int, reps: int, a: str, b: str, workdir: Path, stager: Any) -> dict[str, Any]:
    label = size_label(size_mb)
    if size_mb >= LARGE_MB:
        reps = min(reps, LARGE_REPS)  # keeps the whole run within a few minutes
    state = make_state(size_mb * MB)
    total = state_bytes(state)
    buddy = checkpoint_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(b))
    progress(f"{label}: state of {total} bytes in {len(state)} float32 tensors")
    copies, single, stalls, sealed, writer = bench_memcpy_and_pitstop(
        state, reps, f"bench-{label}", a, buddy
    )
    memcpy_s, pitstop_s = statistics.median(copies), statistics.median(stalls)
    progress(
        f"{label}: memcpy {memcpy_s * 1e3:.1f} ms on {writer.copy_threads} threads "
        f"({statistics.median(single) * 1e3:.1f} ms on one), pitstop stall "
        f"{pitstop_s * 1e3:.1f} ms"
    )
    progress(f"{label}: each memcpy, ms: {' '.join(f'{c * 1e3:.1f}' for c in copies)}")
    progress(f"{label}: each stall, ms:  {' '.join(f'{p * 1e3:.1f}' for p in stalls)}")
    save_s = bench_torch_save(state, reps, workdir)
    progress(f"{label}: torch.save {save_s * 1e3:.1f} ms")
    async_s, cold_s, async_error = bench_async_save(state, reps, workdir, stager)
    progress(
        f"{label}: dcp.async_save staged in {ms(async_s)} ms (tuned); "
        f"returned in {cold_s * 1e3:.1f} ms (defaults)"
    )
    replication, flush = bench_transfers(writer, a, b, workdir, 2)
    progress(f"{label}: replication {replication:.0f} MB/s, flush {flush:.0f} MB/s")
    writer.close()
    return {
        "bytes": total,
        "reps": reps,
        "memcpy_ms": round(memcpy_s * 1e3, 2),
        "memcpy_threads": writer.copy_threads,
        "memcpy_1thread_ms": round(statistics.median(single) * 1e3, 2),
        "pitstop_stall_ms": round(pitstop_s * 1e3, 2),
        "pitstop_sealed_ms": round(statistics.median(sealed) * 1e3, 2),
        "torch_save_ms": round(save_s * 1e3, 2),
        "async_save_ms": ms(async_s),
        "async_save_error": async_error,
        "async_save_cold_ms": round(cold_s * 1e3, 2),
        "pitstop_vs_memcpy": round(pitstop_s / memcpy_s, 3),
        "pitstop_vs_memcpy_paired": round(
            statistics.median(p / c for p, c in zip(stalls, copies, strict=True)), 3
        ),
        "target_vs_memcpy_met": pitstop_s <= TARGET_VS_MEMCPY * memcpy_s,
        **versus(pitstop_s, async_s, TARGET_VS_ASYNC_SAVE),
        "replication_MBps": round(replication, 1),
        "flush_MBps": round(flush, 1),
    }


def pinned_buffer(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def device_to_host(state: dict[str, torch.Tensor], pinned: torch.Tensor) -> float:
    """One copy of every tensor into pinned host memory: the GPU's "memcpy"."""
    offset = 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    for tensor in state.values():
        size = tensor.numel() * tensor.element_size()
        pinned[offset : offset + size].view(torch.float32).copy_(tensor, non_blocking=True)
        offset += size
    torch.cuda.synchronize()
    return time.perf_counter() - started


def run_cuda_case(
    size_gb: float, reps: int, a: str, b: str, workdir: Path, stager: Any
) -> dict[str, Any]:
    """The GPU variant: a state in device memory. Needs an NVIDIA GPU. pitstop's stall is
    what `Session.snapshot` holds the loop for on CUDA: the copies enqueued, then waited
    for until they have landed in pinned memory; the seal is awaited untimed before the
    next, as a step's compute would overlap it."""
    state = make_state(int(size_gb * 1e9), device="cuda")
    total = state_bytes(state)
    label = f"cuda {size_gb:g}GB"
    memcpy_s = median_of(reps, functools.partial(device_to_host, state, pinned_buffer(total)))
    buddy = checkpoint_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(b))
    job = f"bench-cuda-{size_gb:g}"
    writer = SnapshotWriter(a, job, 0, timeout_s=600)
    stalls, enqueued, sealed = [], [], []
    for step in range(1, WARMUP + reps + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = writer.snapshot(step, state)
        writer.wait_copied()
        stall = time.perf_counter() - started
        if result.skipped:
            raise RuntimeError(f"snapshot skipped: {result.skipped}")
        writer.wait()
        if step > WARMUP:
            stalls.append(stall)
            enqueued.append(result.stall_seconds)
            sealed.append(writer.sealed_seconds)
        wait_for_replica(buddy, job, step, timeout=600)
    writer.close()
    pitstop_s = statistics.median(stalls)
    progress(
        f"{label}: pinned copy {memcpy_s * 1e3:.1f} ms, pitstop stall {pitstop_s * 1e3:.1f} ms "
        f"(each: {' '.join(f'{x * 1e3:.1f}' for x in stalls)})"
    )
    save_s = bench_torch_save(state, reps, workdir)
    async_s, cold_s, async_error = bench_async_save(state, reps, workdir, stager)
    progress(
        f"{label}: torch.save {save_s * 1e3:.1f} ms, dcp.async_save staged in "
        f"{ms(async_s)} ms (tuned), returned in {cold_s * 1e3:.1f} ms (defaults)"
    )
    return {
        "bytes": total,
        "reps": reps,
        "d2h_memcpy_ms": round(memcpy_s * 1e3, 2),
        "pitstop_stall_ms": round(pitstop_s * 1e3, 2),
        "pitstop_enqueue_ms": round(statistics.median(enqueued) * 1e3, 2),
        "pitstop_sealed_ms": round(statistics.median(sealed) * 1e3, 2),
        "torch_save_ms": round(save_s * 1e3, 2),
        "async_save_ms": ms(async_s),
        "async_save_error": async_error,
        "async_save_cold_ms": round(cold_s * 1e3, 2),
        "pitstop_vs_memcpy": round(pitstop_s / memcpy_s, 3),
        "target_vs_memcpy_met": pitstop_s <= TARGET_VS_MEMCPY * memcpy_s,
        **versus(pitstop_s, async_s, TARGET_VS_ASYNC_SAVE),
    }
