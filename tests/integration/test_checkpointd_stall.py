"""The snapshot stall (issue 14): slots reused and pre-faulted, nothing on the rank's
path but the copy, and never a half-written snapshot visible. Real daemons on port 0,
real gRPC, real shared memory; a rank killed mid-copy is a real process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kit.checkpointd import (
    LOCAL,
    TIMEOUT,
    DaemonThread,
    RankCalls,
    as_bytes,
    daemon_settings,
    make_state,
    node_segments,
    restored_bytes,
    stub,
)
from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.rankside.writer import SnapshotWriter
from pitstop.v1 import checkpoint_pb2


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., DaemonThread]]:
    started: list[DaemonThread] = []

    def start(node: str, **overrides: Any) -> DaemonThread:
        settings = daemon_settings(f"{node}-{uuid.uuid4().hex[:6]}", tmp_path / node, **overrides)
        daemon = DaemonThread(settings)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        remove_stale_segments(segment_prefix(daemon.daemon.node_id))


def test_without_a_scheduler_the_newest_k_are_kept_in_the_same_segments(
    daemons: Callable[..., DaemonThread],
) -> None:
    """No scheduler ever commits a step, so nothing awaits a commit: the daemon keeps
    keep_in_memory snapshots per rank and the rank writes each new one into a segment
    an old one gave back, not into a fresh (unfaulted) one."""
    node = daemons("a", keep_in_memory=2)
    writer = SnapshotWriter(node.address, "job-reuse", 0)
    try:
        for step in range(1, 9):
            assert not writer.snapshot(step, make_state(0, step)).skipped
            writer.wait()
        listed = stub(node.address).ListShards(checkpoint_pb2.ListShardsRequest(job_id="job-reuse"))
        assert sorted(s.header.key.step for s in listed.shards if s.tier == LOCAL) == [7, 8]
        # Two kept, one leased for the next snapshot.
        assert len(node_segments(node.daemon.node_id)) == 3
        assert restored_bytes(writer)[0] == as_bytes(make_state(0, 8))
        assert restored_bytes(writer, 7)[0] == as_bytes(make_state(0, 7))
    finally:
        writer.close()


def test_a_snapshot_costs_the_rank_one_call_off_the_training_thread(
    daemons: Callable[..., DaemonThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SealSlot leases the next snapshot's slot as it seals: once the first snapshot
    has its slot, each snapshot is one call, made by the seal thread. On a node whose
    cores are busy training, each call's CPU (the rank's and the daemon's) is taken
    from the training thread."""
    calls = RankCalls()
    calls.install(monkeypatch)
    node = daemons("a", keep_in_memory=2)
    writer = SnapshotWriter(node.address, "job-one-call", 0)
    try:
        for step in range(1, 7):
            assert not writer.snapshot(step, make_state(0, step)).skipped
            writer.wait()
        assert calls.count("SealSlot") == 6
        assert calls.count("AcquireSlot") == 1  # the first snapshot's, before any seal
        on_training_thread = [m for m, thread in calls.calls if thread == "MainThread"]
        assert on_training_thread == ["AcquireSlot"]
        # Two kept, one leased for the next snapshot: the leases reuse given-up slots.
        assert len(node_segments(node.daemon.node_id)) == 3
        assert restored_bytes(writer)[0] == as_bytes(make_state(0, 6))
        assert restored_bytes(writer, 5)[0] == as_bytes(make_state(0, 5))
    finally:
        writer.close()


def test_a_seal_answered_without_a_slot_is_followed_by_its_own_lease(
    daemons: Callable[..., DaemonThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon from before the lease came with the seal answers no slot: the seal
    thread leases the next slot with AcquireSlot, so the training thread still finds
    it waiting, mapped and faulted in."""
    calls = RankCalls(old_daemon=True)
    calls.install(monkeypatch)
    node = daemons("a", keep_in_memory=2)
    writer = SnapshotWriter(node.address, "job-old-daemon", 0)
    try:
        for step in range(1, 5):
            assert not writer.snapshot(step, make_state(0, step)).skipped
            writer.wait()
        assert calls.count("SealSlot") == 4
        assert calls.count("AcquireSlot") == 1 + 4  # the first snapshot's, one after each seal
        on_training_thread = [m for m, thread in calls.calls if thread == "MainThread"]
        assert on_training_thread == ["AcquireSlot"]
        assert writer.lost_seals == 0
        assert restored_bytes(writer)[0] == as_bytes(make_state(0, 4))
    finally:
        writer.close()


# A rank that snapshots step 1, then dies (SIGKILL) halfway through copying step 2.
_RANK_KILLED_MID_COPY = """
import os, signal, sys
import torch
from pitstop.rankside import tensorcopy
from pitstop.rankside.writer import SnapshotWriter

def state(step):
    return {f"layer{i}": torch.full((64, 1024), float(step * 10 + i)) for i in range(8)}

def half_then_die(self, moves):
    for target, source, size in moves[: len(moves) // 2]:
        tensorcopy.ctypes.memmove(target, source, size)
    os.kill(os.getpid(), signal.SIGKILL)

writer = SnapshotWriter(sys.argv[1], "job-midcopy", 0)
assert not writer.snapshot(1, state(1)).skipped
writer.wait()
tensorcopy.Copier.move = half_then_die
writer.snapshot(2, state(2))
"""


def test_a_rank_killed_mid_copy_leaves_the_previous_snapshot_the_newest(
    daemons: Callable[..., DaemonThread],
) -> None:
    torch = pytest.importorskip("torch")
    node = daemons("a")
    rank = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RANK_KILLED_MID_COPY), node.address],
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 4,
    )
    assert rank.returncode == -signal.SIGKILL, rank.stderr
    listed = stub(node.address).ListShards(checkpoint_pb2.ListShardsRequest(job_id="job-midcopy"))
    assert [s.header.key.step for s in listed.shards] == [1]
    # The restarted rank restores step 1 bit for bit, and goes on snapshotting.
    writer = SnapshotWriter(node.address, "job-midcopy", 0)
    try:
        restored = writer.restore()
        assert restored.step == 1
        for i in range(8):
            assert torch.equal(restored.tensors[f"layer{i}"], torch.full((64, 1024), 10.0 + i))
        step2 = {f"layer{i}": torch.full((64, 1024), 20.0 + i) for i in range(8)}
        assert not writer.snapshot(2, step2).skipped
        again = writer.restore()
        assert again.step == 2
        assert all(torch.equal(again.tensors[k], v) for k, v in step2.items())
    finally:
        writer.close()


def test_snapshots_of_changing_shapes_read_back_bit_exact_from_reused_slots(
    daemons: Callable[..., DaemonThread],
) -> None:
    """The writer plans a loop's layout once: a tensor that grows, shrinks or changes
    dtype is planned again, and every sealed snapshot reads back exactly."""
    torch = pytest.importorskip("torch")
    node = daemons("a", keep_in_memory=2)
    writer = SnapshotWriter(node.address, "job-shapes", 0)
    shapes = [(100,), (100,), (300,), (300,), (50,), (50, 2), (50, 2)]
    dtypes = [torch.float32] * 6 + [torch.float64]
    taken = {}
    try:
        for step, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True), start=1):
            generator = torch.Generator().manual_seed(step)
            state = {
                "w": torch.rand(shape, generator=generator).to(dtype),
                "b": torch.arange(step, dtype=torch.int64),
            }
            assert not writer.snapshot(step, state, {"step": str(step)}).skipped
            taken[step] = state
            writer.wait()
            for back in (step - 1, step):
                if back in taken:
                    restored = writer.restore(back)
                    assert restored.metadata["step"] == str(back)
                    for name, tensor in taken[back].items():
                        assert restored.tensors[name].dtype == tensor.dtype
                        assert torch.equal(restored.tensors[name], tensor), (back, name)
    finally:
        writer.close()


def _deleted_mappings(prefix: str) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if prefix in line and "(deleted)" in line]


def test_a_segment_the_daemon_drops_is_unmapped_by_the_writer(
    daemons: Callable[..., DaemonThread],
) -> None:
    """The writer keeps its slots mapped from snapshot to snapshot, but not one the
    daemon removed to make room: that mapping alone would keep the memory in use."""
    torch = pytest.importorskip("torch")
    node = daemons("a", keep_in_memory=1, memory_budget_bytes=7 << 20)
    prefix = segment_prefix(node.daemon.node_id)
    writer = SnapshotWriter(node.address, "job-drop", 0)
    try:
        small = {"w": torch.zeros((1 << 20) // 4 - 1024)}  # a 1 MB slot
        assert not writer.snapshot(1, small).skipped
        writer.wait()
        big = {"w": torch.ones(3 * (1 << 20) // 4 - 1024)}  # a 3 MB slot
        assert not writer.snapshot(2, big).skipped
        # Leasing a second 3 MB slot ahead made the daemon drop a 1 MB one.
        writer.wait()
        assert len(node_segments(node.daemon.node_id)) == 3
        assert _deleted_mappings(prefix) == []
        assert torch.equal(writer.restore().tensors["w"], big["w"])
    finally:
        writer.close()
