"""The CUDA snapshot stall: how long a pitstop snapshot of 1 GB and of 10 GB of CUDA
tensors holds the training loop, beside a plain copy of the same bytes into pinned host
memory (cudaMemcpy, the least any copy off the GPU costs).

The snapshot is the trainer's own: `Session.snapshot`, as `Session.commit` calls it when
a snapshot is due, into a real checkpoint daemon process. On CUDA the session enqueues
the copies into pinned host memory (`SnapshotWriter.snapshot` returns then) and waits
until they have landed before the loop may go on (the next optimizer step must not
change the tensors under the copy); the move into the daemon's slot and the seal go on
in the background. Between snapshots the check waits for the seal, untimed, as a step's
compute would overlap it. The three times are reported. The check asserts what a user
relies on, that the snapshot holds the tensors' bytes; the times are numbers to read,
not assertions (speed is measured, not asserted, in this project)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kit.checkpointd import DaemonProcess
from kit.gpu import cuda, machine, needs_gpu, report
from kit.hardware import NO_HARDWARE
from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.rankside.shm import SHM_DIR

# A hang guard far above the seconds a 10 GB snapshot takes; not a speed bound.
pytestmark = [pytest.mark.gpu, needs_gpu, pytest.mark.timeout(300)]

GB = 10**9
TENSOR_BYTES = 250_000_000  # a 1 GB state is 4 such tensors, 10 GB 40
SNAPSHOTS = {1: 5, 10: 3}  # per size: the first takes the slot, the staging buffer, the faults
COPIES = 5  # pinned-memory copies of the same bytes


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _fits(total: int) -> str:
    """Why a `total`-byte snapshot cannot run here ("" when it can): the daemon's
    segments in /dev/shm (the newest snapshot, the next one's slot, and at times a third
    while the oldest is given back), the writer's pinned staging buffer and the pinned
    copy beside them in host memory, and the tensors with their restored copy on the
    GPU."""
    import torch

    shm_free = shutil.disk_usage(SHM_DIR).free
    host_free = psutil.virtual_memory().available
    gpu_free, _ = torch.cuda.mem_get_info()
    needs = {
        f"{SHM_DIR} free": (shm_free, 3.2 * total),
        "host memory available": (host_free, 5.5 * total),  # 3 segments + 2 pinned buffers
        "GPU memory free": (gpu_free, 2.2 * total),  # the tensors and their restored copy
    }
    short = [
        f"{what} {have / GB:.1f} GB < {need / GB:.1f} GB needed"
        for what, (have, need) in needs.items()
        if have < need
    ]
    return "; ".join(short)


@pytest.fixture
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A real checkpoint daemon process, no scheduler: it keeps the newest snapshot and
    leases the next one's slot as it seals; no durable flush during the check. Its budget
    is four states: on an H100 it asked for a third slot while two were in use (a slot
    is the state and its header), and three states refused the fourth snapshot."""
    total = int(request.node.callspec.params["gigabytes"]) * GB
    node_id = f"gpu-stall-{uuid.uuid4().hex[:6]}"
    started = DaemonProcess(
        node_id,
        tmp_path / "checkpointd",
        memory_budget_bytes=str(4 * total),
        keep_in_memory="1",
        flush_every_steps="1000000000",
        log_level="WARNING",
    )
    try:
        yield started
    finally:
        started.stop()
        remove_stale_segments(segment_prefix(node_id))


@pytest.mark.parametrize("gigabytes", [1, 10])
def test_cuda_snapshot_stall_beside_a_pinned_copy(
    gigabytes: int, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = cuda()
    total = gigabytes * GB
    short = _fits(total)
    if short:
        pytest.skip(f"{NO_HARDWARE}no room for a {gigabytes} GB snapshot here: {short}")
    from pitstop.trainer import Session, TrainState

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PITSTOP_AGENT_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PITSTOP_CHECKPOINTD", daemon.address)
    monkeypatch.setenv("PITSTOP_JOB_ID", f"gpu-stall-{gigabytes}gb")

    device = torch.device("cuda", 0)
    count = total // TENSOR_BYTES
    # Random bytes (NaN patterns too): compared as bytes, never as numbers.
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList(
        torch.nn.Parameter(
            torch.randint(
                -(2**31), 2**31 - 1, (TENSOR_BYTES // 4,), dtype=torch.int32, device=device
            ).view(torch.float32),
            requires_grad=False,
        )
        for _ in range(count)
    )
    weights = list(model.weights)
    state = TrainState(model)
    held: list[float] = []  # Session.snapshot: the loop held, until the copies landed
    enqueued: list[float] = []  # SnapshotWriter.snapshot: the copies enqueued
    sealed: list[float] = []  # from the snapshot's start to the daemon's seal
    with Session.from_env() as session:
        assert session.device.type == "cuda"
        assert session.writer is not None
        for step in range(1, SNAPSHOTS[gigabytes] + 1):
            for weight in weights:  # the step changed every tensor
                weight.data.view(torch.int32)[:1024] = step
            state.step = step
            torch.cuda.synchronize()
            began = time.perf_counter()
            saved = session.snapshot(state)
            held.append(time.perf_counter() - began)
            assert saved, f"snapshot of step {step} not saved: see the log above"
            assert session.last_snapshot is not None
            enqueued.append(session.last_snapshot.stall_seconds)
            session.writer.wait()  # the seal, off the loop: the next step's compute
            sealed.append(session.writer.sealed_seconds)
        snapshot_bytes = session.last_snapshot.size_bytes
        # The last snapshot holds the tensors' bytes: restored onto the GPU, compared there.
        into = {f"model.weights.{i}": torch.empty_like(w) for i, w in enumerate(weights)}
        restored = session.writer.restore(state.step, into=into)
        assert restored.step == state.step
        for i, weight in enumerate(weights):
            back = restored.tensors[f"model.weights.{i}"]
            assert back.device == device
            assert torch.equal(back.view(torch.uint8), weight.view(torch.uint8)), i
        del into, restored, back

    # The same bytes into pinned host memory, as a snapshot's first copy moves them.
    pinned = torch.empty(count * TENSOR_BYTES, dtype=torch.uint8, pin_memory=True)
    copies: list[float] = []
    for _ in range(COPIES):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for i, weight in enumerate(weights):
            part = pinned[i * TENSOR_BYTES : (i + 1) * TENSOR_BYTES]
            part.copy_(weight.view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - began)
    assert torch.equal(pinned[-TENSOR_BYTES:].to(device), weights[-1].view(torch.uint8))

    warm = held[1:]

    def first_and_after(values: list[float]) -> dict[str, float]:
        return {"first": round(values[0], 4), "median_after": _median(values[1:])}

    numbers: dict[str, Any] = {
        **machine(),
        "gigabytes": gigabytes,
        "state_bytes": count * TENSOR_BYTES,
        "snapshot_bytes": snapshot_bytes,
        "tensors": count,
        "snapshot_held_s": first_and_after(held),
        "snapshot_enqueue_s": first_and_after(enqueued),
        "snapshot_sealed_s": first_and_after(sealed),
        "pinned_memcpy_s": {"median": _median(copies), "all": [round(c, 4) for c in copies]},
        "snapshot_GBps": round(total / GB / statistics.median(warm), 2),
        "pinned_memcpy_GBps": round(total / GB / statistics.median(copies), 2),
        "held_over_memcpy": round(statistics.median(warm) / statistics.median(copies), 2),
        "snapshot_held_all_s": [round(h, 4) for h in held],
        "shm": f"{shutil.disk_usage(SHM_DIR).total / GB:.0f} GB",
        "cpus": os.cpu_count(),
    }
    report("snapshot_stall", numbers)
