"""checkpointd end to end: real daemons on port 0, real gRPC, real shared memory, a real
file:// durable store; daemons killed with SIGKILL run as subprocesses.

The scheduler side of the catalog is a fake servicer here: the tests assert what the
daemons report, and wait on those reports (never on a sleep)."""

from __future__ import annotations

import errno
import mmap
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kit.checkpointd import (
    DURABLE,
    LOCAL,
    REPLICA,
    TIMEOUT,
    DaemonProcess,
    DaemonThread,
    FakeCatalog,
    Report,
    added,
    as_bytes,
    daemon_settings,
    key,
    make_state,
    node_segments,
    restored_bytes,
    stub,
)
from kit.dirs import tmpfs
from pitstop.checkpointd.daemon import CheckpointDaemon
from pitstop.checkpointd.slots import SHM_DIR, remove_stale_segments, segment_prefix
from pitstop.rankside.durable import DurableShard, DurableStore
from pitstop.rankside.format import TensorSpec, plan_shard, write_header
from pitstop.rankside.restoring import ShardUnavailable
from pitstop.rankside.writer import SnapshotWriter
from pitstop.v1 import checkpoint_pb2


@pytest.fixture
def catalog() -> Iterator[FakeCatalog]:
    fake = FakeCatalog()
    yield fake
    fake.server.stop(None)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., DaemonThread]]:
    started: list[DaemonThread] = []
    node_ids: list[str] = []

    def start(node: str, **overrides: Any) -> DaemonThread:
        node_id = f"{node}-{uuid.uuid4().hex[:6]}"
        node_ids.append(node_id)
        daemon = DaemonThread(daemon_settings(node_id, tmp_path / node_id, **overrides))
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
    for node_id in node_ids:
        remove_stale_segments(segment_prefix(node_id))


def test_snapshot_restores_bitwise_from_local_memory(
    daemons: Callable[..., DaemonThread],
) -> None:
    # The scheduler is down: reports fail and are retried, snapshots are unaffected.
    node = daemons("a", scheduler="127.0.0.1:1")
    writer = SnapshotWriter(node.address, "job-rt", 3)
    try:
        for step in (1, 2):
            result = writer.snapshot(step, make_state(3, step), {"cursor": f"batch={step}"})
            assert not result.skipped
        got, restored = restored_bytes(writer)
        assert got == as_bytes(make_state(3, 2))
        assert restored.step == 2
        assert restored.source == "local"
        assert restored.metadata["cursor"] == "batch=2"
        assert restored.metadata["pitstop.step"] == "2"
        older, _ = restored_bytes(writer, 1)
        assert older == as_bytes(make_state(3, 1))
    finally:
        writer.close()


def test_torch_state_restores_bitwise_and_in_place(daemons: Callable[..., DaemonThread]) -> None:
    torch = pytest.importorskip("torch")
    node = daemons("a")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=generator)
    state = {
        "model.weight": weight,
        "model.weight_t": weight.t(),  # not contiguous
        "model.bias": torch.randn(32, generator=generator).to(torch.bfloat16),
        "optim.exp_avg": torch.randn(64, 32, generator=generator).to(torch.float16),
        "optim.step": torch.tensor(17, dtype=torch.int64),
        "mask": torch.rand(10, generator=generator) > 0.5,
        "rng.torch": torch.get_rng_state(),
        "empty": torch.empty(0, 3),
    }
    writer = SnapshotWriter(node.address, "job-pt", 0)
    try:
        assert not writer.snapshot(5, state).skipped
        restored = writer.restore()
        for name, tensor in state.items():
            assert restored.tensors[name].dtype == tensor.dtype
            assert torch.equal(restored.tensors[name], tensor), name
        target = {"model.weight": torch.zeros(64, 32)}
        writer.restore(5, into=target)
        assert torch.equal(target["model.weight"], weight)
    finally:
        writer.close()


def test_an_unsealed_slot_never_touches_the_last_snapshot(
    daemons: Callable[..., DaemonThread],
) -> None:
    node = daemons("a")
    writer = SnapshotWriter(node.address, "job-db", 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        writer.wait()  # sealed: from here on other clients see it
        sealed = stub(node.address).Restore(checkpoint_pb2.RestoreRequest(key=key("job-db", 0, 1)))
        # A writer takes the next slot, scribbles over it and dies before sealing.
        size = sealed.header.size_bytes
        slot = stub(node.address).AcquireSlot(
            checkpoint_pb2.AcquireSlotRequest(key=key("job-db", 0, 2), size_bytes=size)
        )
        assert slot.shm_name != sealed.shm_name
        with (SHM_DIR / slot.shm_name).open("r+b") as file, mmap.mmap(file.fileno(), 0) as buf:
            buf[: size // 2] = b"\xee" * (size // 2)
        got, restored = restored_bytes(writer)
        assert restored.step == 1
        assert got == as_bytes(make_state(0, 1))
        # The next snapshot reclaims the abandoned slot and works.
        assert not writer.snapshot(2, make_state(0, 2)).skipped
        assert restored_bytes(writer)[0] == as_bytes(make_state(0, 2))
    finally:
        writer.close()


def test_a_full_budget_skips_the_snapshot_and_keeps_the_last(
    daemons: Callable[..., DaemonThread],
) -> None:
    node = daemons("a", memory_budget_bytes=1 << 20)  # room for one slot of this state
    writer = SnapshotWriter(node.address, "job-mem", 0)
    try:
        assert not writer.snapshot(1, make_state(0, 1)).skipped
        # The budget has no room for the slot leased with this seal: the seal holds,
        # and the next snapshot, which needs that slot, says why it is skipped.
        writer.wait()
        assert writer.lost_seals == 0
        result = writer.snapshot(2, make_state(0, 2))
        assert "memory budget full" in result.skipped
        assert node.daemon.skipped_snapshots >= 1
        got, restored = restored_bytes(writer)
        assert restored.step == 1
        assert got == as_bytes(make_state(0, 1))
    finally:
        writer.close()


def test_a_refused_lease_does_not_fail_the_seal_it_came_with(
    daemons: Callable[..., DaemonThread],
) -> None:
    node = daemons("a", memory_budget_bytes=1 << 20)
    daemon = stub(node.address)
    layout = plan_shard([TensorSpec("w", "U8", (1000,))], {})

    def written(step: int) -> str:
        slot = daemon.AcquireSlot(
            checkpoint_pb2.AcquireSlotRequest(key=key("job-lease", 0, step), size_bytes=layout.size)
        )
        with (SHM_DIR / slot.shm_name).open("r+b") as file, mmap.mmap(file.fileno(), 0) as buf:
            write_header(layout, memoryview(buf))
            buf[layout.data_start : layout.size] = bytes([step]) * 1000
        return str(slot.shm_name)

    def seal(step: int, shm_name: str, next_size_bytes: int) -> Any:
        request = checkpoint_pb2.SealSlotRequest(
            key=key("job-lease", 0, step),
            shm_name=shm_name,
            size_bytes=layout.size,
            next_size_bytes=next_size_bytes,
        )
        return daemon.SealSlot(request)

    # A lease that fits comes with the seal, in a slot no reader is given.
    first = written(1)
    sealed = seal(1, first, layout.size)
    assert sealed.HasField("next_slot")
    assert sealed.next_slot.shm_name != first
    assert sealed.next_slot.size_bytes >= layout.size
    newest = daemon.Restore(checkpoint_pb2.RestoreRequest(key=key("job-lease", 0, 0)))
    assert (newest.header.key.step, newest.shm_name) == (1, first)
    # A lease over the budget: the seal holds all the same, answered without a slot.
    second = written(2)
    sealed = seal(2, second, 2 << 20)
    assert not sealed.HasField("next_slot")
    newest = daemon.Restore(checkpoint_pb2.RestoreRequest(key=key("job-lease", 0, 0)))
    assert (newest.header.key.step, newest.shm_name) == (2, second)
    # AcquireSlot is the call that says why no slot can be had.
    too_big = checkpoint_pb2.AcquireSlotRequest(key=key("job-lease", 0, 3), size_bytes=2 << 20)
    with pytest.raises(grpc.RpcError) as refused:
        daemon.AcquireSlot(too_big)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "memory budget full" in refused.value.details()


def test_shards_replicate_to_the_buddy_and_are_reported(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog
) -> None:
    buddy = daemons("b", scheduler=catalog.address)
    node = daemons("a", scheduler=catalog.address, buddy=buddy.address)
    writer = SnapshotWriter(node.address, "job-rep", 1)
    try:
        writer.snapshot(1, make_state(1, 1))
        catalog.wait_for(added(node.daemon.node_id, "job-rep", 1, LOCAL, {1}))
        catalog.wait_for(added(buddy.daemon.node_id, "job-rep", 1, REPLICA, {1}))
        listed = stub(buddy.address).ListShards(checkpoint_pb2.ListShardsRequest(job_id="job-rep"))
        (replica,) = listed.shards
        assert replica.tier == REPLICA
        assert replica.header.origin_node_id == node.daemon.node_id
        reader = SnapshotWriter(buddy.address, "job-rep", 1)
        got, restored = restored_bytes(reader)
        reader.close()
        assert restored.source == "replica"
        assert got == as_bytes(make_state(1, 1))
    finally:
        writer.close()


def test_a_shard_sealed_before_any_buddy_is_pushed_once_one_is_assigned(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog
) -> None:
    """The last snapshot a rank writes (it is stopped, or its run ends) is replicated when
    the scheduler names a buddy later: without that, its step never commits."""
    buddy = daemons("b", scheduler=catalog.address)
    node = daemons("a", scheduler=catalog.address)
    writer = SnapshotWriter(node.address, "job-late", 2)
    try:
        writer.snapshot(1, make_state(2, 1))
        catalog.wait_for(added(node.daemon.node_id, "job-late", 1, LOCAL, {2}))
        catalog.buddy = (buddy.daemon.node_id, buddy.address)  # no newer snapshot comes
        catalog.wait_for(added(buddy.daemon.node_id, "job-late", 1, REPLICA, {2}))
    finally:
        writer.close()


def test_a_full_buddy_refuses_the_push(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog
) -> None:
    buddy = daemons("b", memory_budget_bytes=4096)
    node = daemons("a", buddy=buddy.address)
    writer = SnapshotWriter(node.address, "job-full", 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        writer.wait()
        header = stub(node.address).Restore(
            checkpoint_pb2.RestoreRequest(key=key("job-full", 0, 1))
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub(buddy.address).PushShard(
                iter([checkpoint_pb2.ShardChunk(header=header.header, data=b"x")])
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "memory budget full" in refused.value.details()
    finally:
        writer.close()


def test_a_flipped_byte_in_memory_is_detected_and_served_by_the_buddy(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog
) -> None:
    buddy = daemons("b", scheduler=catalog.address)
    node = daemons("a", scheduler=catalog.address, buddy=buddy.address)
    writer = SnapshotWriter(node.address, "job-flip", 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        catalog.wait_for(added(buddy.daemon.node_id, "job-flip", 1, REPLICA, {0}))
        local = stub(node.address).Restore(checkpoint_pb2.RestoreRequest(key=key("job-flip", 0, 1)))
        assert local.source == LOCAL
        with (SHM_DIR / local.shm_name).open("r+b") as file, mmap.mmap(file.fileno(), 0) as buf:
            buf[local.header.size_bytes - 1] ^= 0x10
        got, restored = restored_bytes(writer, 1)
        assert restored.source == "replica"
        assert got == as_bytes(make_state(0, 1))
        assert node.daemon.sources.corrupted_shards == 1

        def dropped(reports: list[Report]) -> bool:
            return any(
                r.node_id == node.daemon.node_id and k.job_id == "job-flip" and k.step == 1
                for r in reports
                for k in r.removed
            )

        catalog.wait_for(dropped)
    finally:
        writer.close()


def test_a_killed_node_is_restored_from_its_buddy(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog, tmp_path: Path
) -> None:
    buddy = daemons("b", scheduler=catalog.address)
    node = DaemonProcess(f"a-{uuid.uuid4().hex[:6]}", tmp_path / "a", "--buddy", buddy.address)
    writers = [SnapshotWriter(node.address, "job-kill", rank) for rank in (0, 1)]
    try:
        for step in (1, 2, 3):
            for rank, writer in enumerate(writers):
                assert not writer.snapshot(step, make_state(rank, step)).skipped
        catalog.wait_for(added(buddy.daemon.node_id, "job-kill", 3, REPLICA, {0, 1}))
        node.kill()
        assert remove_stale_segments(segment_prefix(node.node_id))  # it left its memory
        spare = daemons("c", scheduler=catalog.address, buddy=buddy.address)
        for rank in (0, 1):
            reader = SnapshotWriter(spare.address, "job-kill", rank)
            got, restored = restored_bytes(reader)
            reader.close()
            assert restored.step == 3
            assert restored.source == "replica"
            assert got == as_bytes(make_state(rank, 3))
    finally:
        for writer in writers:
            writer.close()
        if node.process.poll() is None:
            node.kill()
        remove_stale_segments(segment_prefix(node.node_id))


def test_kill_during_a_durable_flush_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    node_id = f"a-{uuid.uuid4().hex[:6]}"
    state_dir = tmp_path / "a"
    job = "job-torn"
    node = DaemonProcess(
        node_id, state_dir, "--flush-every-steps", "1", fault_hold_flush_at_step="2"
    )
    writer = SnapshotWriter(node.address, job, 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        node.wait_for_line(f"durable checkpoint written: job={job} step=1")
        writer.snapshot(2, make_state(0, 2))
        node.wait_for_line("held before its manifest (fault injection): step=2")
        torn_dir = state_dir / "durable" / job / f"step-{2:012d}"
        assert list(torn_dir.glob("rank-*.safetensors"))  # the shard is written, no manifest
        node.kill()
        left = {p.name for p in SHM_DIR.iterdir() if p.name.startswith(segment_prefix(node_id))}
        assert left

        node = DaemonProcess(node_id, state_dir)  # same node, same store, empty memory
        assert not left & {p.name for p in SHM_DIR.iterdir()}  # the leftovers are removed
        listed = stub(node.address).ListShards(checkpoint_pb2.ListShardsRequest(job_id=job))
        assert [(s.header.key.step, s.tier) for s in listed.shards] == [(1, DURABLE)]
        reader = SnapshotWriter(node.address, job, 0)
        got, restored = restored_bytes(reader)
        assert restored.step == 1
        assert restored.source == "durable"
        assert got == as_bytes(make_state(0, 1))
        with pytest.raises(grpc.RpcError) as refused:
            reader.restore(2)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        reader.close()
        node.process.terminate()  # SIGTERM: a graceful stop unlinks every segment
        assert node.process.wait(TIMEOUT) == 0
        assert not any(p.name.startswith(segment_prefix(node_id)) for p in SHM_DIR.iterdir())
    finally:
        writer.close()
        if node.process.poll() is None:
            node.process.terminate()
            node.process.wait(TIMEOUT)
        remove_stale_segments(segment_prefix(node_id))


def test_a_failing_durable_store_is_reported_retried_and_memory_kept(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog, tmp_path: Path
) -> None:
    blocker = tmp_path / "store"
    blocker.write_text("a file where the store's folder should be")
    node = daemons(
        "a",
        scheduler=catalog.address,
        durable_url=f"file://{blocker}/durable",
        flush_every_steps=1,
    )
    writer = SnapshotWriter(node.address, "job-ro", 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        catalog.wait_for(
            lambda reports: any(
                "job-ro step 1" in error and str(blocker) in error
                for r in reports
                for error in r.flush_errors
            )
        )
        got, restored = restored_bytes(writer)
        assert restored.source == "local"
        assert got == as_bytes(make_state(0, 1))
        blocker.unlink()  # the store comes back: the retry lands
        catalog.wait_for(added(node.daemon.node_id, "job-ro", 1, DURABLE, {0}))
        assert list((blocker / "durable" / "job-ro").glob("step-*/manifest-*.json"))
    finally:
        writer.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 256 KiB (a tmpfs: mounting one needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem of a given size needs root")
    with tmpfs(tmp_path / "small", "256k") as mount:
        yield mount


def test_a_full_disk_refuses_the_flush_keeps_memory_and_flushes_once_room_returns(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog, small_disk: Path
) -> None:
    node = daemons(
        "a",
        scheduler=catalog.address,
        durable_url=f"file://{small_disk}/durable",
        flush_every_steps=1,
        durable_min_free_bytes=0,
    )
    writer = SnapshotWriter(node.address, "job-full", 0)
    try:
        writer.snapshot(1, make_state(0, 1))  # 600 KB of state, 256 KiB of disk
        catalog.wait_for(
            lambda reports: any(
                "job-full step 1" in error and "refused before writing" in error
                for r in reports
                for error in r.flush_errors
            )
        )
        assert not [p for p in small_disk.rglob("*") if p.is_file()]  # nothing half-written
        got, restored = restored_bytes(writer)
        assert restored.source == "local"
        assert got == as_bytes(make_state(0, 1))
        subprocess.run(["mount", "-o", "remount,size=8m", small_disk], check=True)
        catalog.wait_for(added(node.daemon.node_id, "job-full", 1, DURABLE, {0}))
        assert list((small_disk / "durable" / "job-full").glob("step-*/manifest-*.json"))
    finally:
        writer.close()


def test_a_write_that_fills_the_disk_leaves_no_partial_shard(small_disk: Path) -> None:
    store = DurableStore(f"file://{small_disk}/durable", "node-a")
    shard = DurableShard(0, memoryview(bytes(1 << 20)), "0123")
    with pytest.raises(OSError, match="No space left") as full:
        store.write_checkpoint("job-enospc", 1, 0, [shard])
    assert full.value.errno == errno.ENOSPC
    assert not [p for p in small_disk.rglob("*") if p.is_file()]
    assert store.entries("job-enospc") == []


def test_a_pruned_durable_copy_is_reported_as_removed_from_the_store(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog, tmp_path: Path
) -> None:
    """With one durable checkpoint kept, flushing step 2 prunes step 1, and the report
    says the durable copy is gone (not the memory copy), so the scheduler never picks a
    restore step whose files were deleted."""
    node = daemons(
        "a",
        scheduler=catalog.address,
        durable_url=f"file://{tmp_path / 'store'}",
        flush_every_steps=1,
        keep_durable=1,
    )
    writer = SnapshotWriter(node.address, "job-prune", 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        catalog.wait_for(added(node.daemon.node_id, "job-prune", 1, DURABLE, {0}))
        writer.snapshot(2, make_state(0, 2))
        catalog.wait_for(
            lambda reports: any(
                (k.job_id, k.rank, k.step) == ("job-prune", 0, 1)
                for r in reports
                for k in r.removed_durable
            )
        )
        memory = [(k.job_id, k.step) for r in catalog.reports for k in r.removed]
        assert ("job-prune", 1) not in memory  # step 1 is still in memory
    finally:
        writer.close()


def test_a_token_is_required_when_configured(daemons: Callable[..., DaemonThread]) -> None:
    node = daemons("a", token="s3cret")
    anonymous = SnapshotWriter(node.address, "job-auth", 0)
    with pytest.raises(grpc.RpcError) as refused:
        anonymous.snapshot(1, make_state(0, 1))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    anonymous.close()
    writer = SnapshotWriter(node.address, "job-auth", 0, token="s3cret")
    try:
        writer.snapshot(1, make_state(0, 1))
        assert restored_bytes(writer)[0] == as_bytes(make_state(0, 1))
    finally:
        writer.close()


def test_an_unreachable_daemon_skips_the_snapshot(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    writer = SnapshotWriter(address, "job-down", 0, timeout_s=2)
    try:
        result = writer.snapshot(1, make_state(0, 1))
        assert result.skipped.startswith("checkpointd unreachable: UNAVAILABLE")
    finally:
        writer.close()


def test_errors_are_status_codes_and_internal_ones_say_nothing(
    daemons: Callable[..., DaemonThread],
) -> None:
    node = daemons("a")
    daemon = stub(node.address)

    def code_of(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as failed:
            call()
        return failed.value.code(), failed.value.details()

    no_job = checkpoint_pb2.AcquireSlotRequest(key=key("", 0, 1), size_bytes=100)
    assert code_of(lambda: daemon.AcquireSlot(no_job))[0] == grpc.StatusCode.INVALID_ARGUMENT
    unknown = checkpoint_pb2.SealSlotRequest(key=key("job-e", 0, 1), shm_name="nope", size_bytes=8)
    assert code_of(lambda: daemon.SealSlot(unknown))[0] == grpc.StatusCode.FAILED_PRECONDITION
    missing = checkpoint_pb2.PullShardRequest(key=key("job-e", 0, 7))
    code, details = code_of(lambda: list(daemon.PullShard(missing)))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "not in the memory of node" in details

    async def broken(job_id: str) -> list[Any]:
        raise RuntimeError("a secret the caller must not see")

    node.daemon.list_shards = broken  # type: ignore[method-assign]
    code, details = code_of(lambda: daemon.ListShards(checkpoint_pb2.ListShardsRequest()))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in details
    assert "see its log" in details


def test_two_daemons_with_one_node_id_never_touch_each_others_memory(tmp_path: Path) -> None:
    # Two local clusters on one host, each with a node called the same.
    node_id = f"same-{uuid.uuid4().hex[:6]}"
    first = DaemonProcess(node_id, tmp_path / "first")
    second: DaemonProcess | None = None
    writer = SnapshotWriter(first.address, "job-twin", 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        writer.wait()
        held = node_segments(node_id)
        assert held
        second = DaemonProcess(node_id, tmp_path / "second")  # its start cleans up
        assert set(held) <= set(node_segments(node_id))
        cleanup = subprocess.run(
            [sys.executable, "-m", "pitstop.checkpointd.main", "cleanup", "--node-id", node_id],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=True,
        )
        assert cleanup.stdout.strip() == "removed 0 segments"
        assert restored_bytes(writer, 1)[0] == as_bytes(make_state(0, 1))
        other = SnapshotWriter(second.address, "job-twin", 0)
        other.snapshot(5, make_state(0, 5))
        other.close()
        first.kill()  # now its segments are a dead daemon's
        assert remove_stale_segments(segment_prefix(node_id)) == sorted(p.name for p in held)
        assert node_segments(node_id)  # the second daemon's are still there
        reader = SnapshotWriter(second.address, "job-twin", 0)
        assert restored_bytes(reader, 5)[0] == as_bytes(make_state(0, 5))
        reader.close()
    finally:
        writer.close()
        first.stop()
        if second is not None:
            second.stop()
        remove_stale_segments(segment_prefix(node_id))


def test_a_rank_whose_daemon_is_gone_restores_from_the_holders_the_catalog_names(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog, tmp_path: Path
) -> None:
    job = "job-gone"
    buddy = daemons("b", scheduler=catalog.address)
    node_id = f"a-{uuid.uuid4().hex[:6]}"
    node = DaemonProcess(
        node_id, tmp_path / "a", "--buddy", buddy.address, scheduler=catalog.address
    )
    catalog.addresses = {node_id: node.address, buddy.daemon.node_id: buddy.address}
    writer = SnapshotWriter(node.address, job, 0)
    try:
        for step in (1, 2, 3):
            assert not writer.snapshot(step, make_state(0, step)).skipped
        writer.wait()
        # Every seal's answer says where else the state can be found.
        assert (writer.catalog_address, writer.buddy_address) == (catalog.address, buddy.address)
        catalog.wait_for(added(buddy.daemon.node_id, job, 3, REPLICA, {0}))
        node.kill()
        # A rank started afresh knows only the catalog (PITSTOP_SCHEDULER): it names
        # the dead node and the buddy; the dead one refuses the connection.
        fresh = SnapshotWriter(node.address, job, 0, catalog_address=catalog.address)
        got, restored = restored_bytes(fresh, 3)
        fresh.close()
        assert (restored.step, restored.source) == (3, "replica")
        assert got == as_bytes(make_state(0, 3))
        # Without a catalog, the buddy its seals named; step 0: the newest it holds.
        catalog.server.stop(None)
        got, restored = restored_bytes(writer)
        assert (restored.step, restored.source) == (3, "replica")
        assert got == as_bytes(make_state(0, 3))
        # Nobody holds step 9: the error says what was tried.
        with pytest.raises(ShardUnavailable, match=f"tried: {buddy.address}"):
            writer.restore(9)
    finally:
        writer.close()
        node.stop()
        remove_stale_segments(segment_prefix(node_id))


def test_a_vanished_segment_costs_one_snapshot_and_no_restore(
    daemons: Callable[..., DaemonThread],
) -> None:
    node = daemons("a")
    writer = SnapshotWriter(node.address, "job-vanish", 0)
    try:
        writer.snapshot(1, make_state(0, 1))
        writer.wait()  # sealed, and the slot for step 2 taken ahead
        for path in node_segments(node.daemon.node_id):
            path.unlink()  # someone removes the daemon's memory from /dev/shm
        # The daemon still has step 1 mapped: the restore pulls it through the daemon.
        got, restored = restored_bytes(writer, 1)
        assert (restored.step, restored.source) == (1, "local")
        assert got == as_bytes(make_state(0, 1))
        assert "vanished" in writer.snapshot(2, make_state(0, 2)).skipped
        assert not writer.snapshot(3, make_state(0, 3)).skipped
        assert restored_bytes(writer, 3)[0] == as_bytes(make_state(0, 3))
    finally:
        writer.close()


def remembered_jobs(daemon: CheckpointDaemon) -> set[str]:
    """Every job the daemon keeps anything of: snapshots, step times, members."""
    held = {record.shard.job_id for record in daemon.store.records()}
    return held | daemon.flusher.jobs() | set(daemon.members)


def test_the_memory_of_a_job_that_ended_goes_back_to_dev_shm(
    daemons: Callable[..., DaemonThread], catalog: FakeCatalog
) -> None:
    """A fleet runs thousands of jobs: each one's last snapshots, replicas and leased
    slots must not stay in every node's /dev/shm once it ended. An idle daemon asks."""
    buddy = daemons("b", scheduler=catalog.address, idle_report_seconds=0.2)
    node = daemons("a", scheduler=catalog.address, buddy=buddy.address, idle_report_seconds=0.2)
    ended, running = SnapshotWriter(node.address, "job-ended", 0), None
    try:
        for step in (1, 2, 3):
            ended.snapshot(step, make_state(0, step))
        catalog.wait_for(added(buddy.daemon.node_id, "job-ended", 3, REPLICA, {0}))
        running = SnapshotWriter(node.address, "job-running", 0)
        running.snapshot(1, make_state(0, 1))
        catalog.wait_for(added(node.daemon.node_id, "job-running", 1, LOCAL, {0}))
        held = node_segments(node.daemon.node_id)
        assert len(held) >= 4  # two snapshots, the slot leased for the next, the other job's

        catalog.ended.add("job-ended")
        for daemon in (node, buddy):
            catalog.wait_for(
                lambda reports, d=daemon: any(
                    r.node_id == d.daemon.node_id
                    and any(k.job_id == "job-ended" and k.step == 3 for k in r.removed)
                    for r in reports
                )
            )
        listed = stub(node.address).ListShards(checkpoint_pb2.ListShardsRequest())
        assert {s.header.key.job_id for s in listed.shards} == {"job-running"}
        replicas = stub(buddy.address).ListShards(checkpoint_pb2.ListShardsRequest()).shards
        assert {s.header.key.job_id for s in replicas} == {"job-running"}
        assert len(node_segments(node.daemon.node_id)) <= 2  # its snapshot, its leased slot
        assert len(node_segments(buddy.daemon.node_id)) == 1  # its replica
        got, restored = restored_bytes(running)  # the running job's memory untouched
        assert got == as_bytes(make_state(0, 1))
        assert restored.step == 1
        # Nor does any other state of it stay: its step times, the buddy's member cache.
        assert remembered_jobs(node.daemon) == {"job-running"}
        assert "job-ended" not in remembered_jobs(buddy.daemon)
    finally:
        ended.close()
        if running is not None:
            running.close()
