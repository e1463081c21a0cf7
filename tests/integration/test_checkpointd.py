"""checkpointd end to end: real daemons on port 0, real gRPC, real shared memory, a real
file:// durable store; daemons killed with SIGKILL run as subprocesses.

The scheduler side of the catalog is a fake servicer here: the tests assert what the
daemons report, and wait on those reports (never on a sleep)."""

from __future__ import annotations

import array
import asyncio
import ctypes
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from pitstop.checkpointd.config import CheckpointdSettings
from pitstop.checkpointd.daemon import CheckpointDaemon
from pitstop.checkpointd.slots import SHM_DIR, remove_stale_segments, segment_prefix
from pitstop.checkpointd.writer import SnapshotWriter
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

TIMEOUT = 15.0
LOCAL, REPLICA, DURABLE = (
    checkpoint_pb2.SHARD_TIER_LOCAL,
    checkpoint_pb2.SHARD_TIER_REPLICA,
    checkpoint_pb2.SHARD_TIER_DURABLE,
)
Report = checkpoint_pb2.ReportShardsRequest


class FakeCatalog(checkpoint_pb2_grpc.CheckpointCatalogServiceServicer):
    """The scheduler's CheckpointCatalogService, recording every report."""

    def __init__(self) -> None:
        self.reports: list[Report] = []
        self._changed = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        checkpoint_pb2_grpc.add_CheckpointCatalogServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def ReportShards(self, request: Report, context: Any) -> Any:  # noqa: N802
        with self._changed:
            self.reports.append(request)
            self._changed.notify_all()
        return checkpoint_pb2.ReportShardsResponse()

    def GetBuddy(self, request: Any, context: Any) -> Any:  # noqa: N802
        return checkpoint_pb2.GetBuddyResponse()

    def GetRestorePoint(self, request: Any, context: Any) -> Any:  # noqa: N802
        return checkpoint_pb2.GetRestorePointResponse()

    def wait_for(self, holds: Callable[[list[Report]], bool], timeout: float = TIMEOUT) -> None:
        """Until `holds` for the reports received so far."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not holds(self.reports):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no such reports in {timeout}s: {self.reports}")
                self._changed.wait(left)


def added(
    node: str, job: str, step: int, tier: int, ranks: set[int]
) -> Callable[[list[Report]], bool]:
    """Whether `node` has reported holding `ranks` of (job, step) in `tier`."""

    def holds(reports: list[Report]) -> bool:
        got = {
            s.header.key.rank
            for report in reports
            if report.node_id == node
            for s in report.added
            if s.tier == tier and s.header.key.job_id == job and s.header.key.step == step
        }
        return ranks <= got

    return holds


class DaemonThread:
    """A real CheckpointDaemon on its own event loop in a thread."""

    def __init__(self, settings: CheckpointdSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def start() -> CheckpointDaemon:
            daemon = CheckpointDaemon(settings)
            await daemon.start()
            return daemon

        self.daemon: CheckpointDaemon = self.call(start())

    def call(self, work: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(TIMEOUT)

    @property
    def address(self) -> str:
        return self.daemon.address

    def stop(self) -> None:
        self.call(self.daemon.stop(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(TIMEOUT)
        self.loop.close()


class DaemonProcess:
    """`python -m pitstop.checkpointd.main run` as a child process, for kill -9."""

    def __init__(self, node_id: str, state_dir: Path, *args: str, **env: str) -> None:
        self.node_id = node_id
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
        environ.update({f"PITSTOP_CHECKPOINTD_{k.upper()}": v for k, v in env.items()})
        command = [sys.executable, "-m", "pitstop.checkpointd.main", "run"]
        command += ["--node-id", node_id, "--host", "127.0.0.1", "--port", "0"]
        command += ["--scheduler", "", "--state-dir", str(state_dir), *args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self.wait_for_line("listening on").split("listening on ")[1].split()[0]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip())

    def wait_for_line(self, text: str, timeout: float = TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.node_id} never printed {text!r}") from None
            if text in line:
                return line

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(TIMEOUT)


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
        values: dict[str, Any] = {
            "node_id": node_id,
            "host": "127.0.0.1",
            "port": 0,
            "scheduler": "",
            "state_dir": tmp_path / node_id,
            "memory_budget_bytes": 64 << 20,
            "retry_max_seconds": 0.2,
            "flush_every_steps": 1000,
            **overrides,
        }
        daemon = DaemonThread(CheckpointdSettings(**values))
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
    for node_id in node_ids:
        remove_stale_segments(segment_prefix(node_id))


def make_state(rank: int, step: int) -> dict[str, Any]:
    """A rank's whole state without torch: weights, two Adam moments, RNG bytes."""
    n = 50_000
    return {
        "model.weight": array.array("f", (float(rank * 7 + step + i % 97) for i in range(n))),
        "optim.exp_avg": array.array("f", (0.5 * step + i % 13 for i in range(n))),
        "optim.exp_avg_sq": array.array("d", (0.25 * step + i % 5 for i in range(n // 2))),
        "optim.step": array.array("q", [step]),
        "rng.python": bytes(range(rank, rank + 200)),
    }


def as_bytes(state: dict[str, Any]) -> dict[str, bytes]:
    return {name: bytes(memoryview(value).cast("B")) for name, value in state.items()}


def restored_bytes(writer: SnapshotWriter, step: int = 0) -> tuple[dict[str, bytes], Any]:
    """The restored state as raw bytes per tensor, and the RestoredState."""
    restored = writer.restore(step)
    return {name: tensor_bytes(v) for name, v in restored.tensors.items()}, restored


def tensor_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    value = value.contiguous()
    return ctypes.string_at(value.data_ptr(), value.numel() * value.element_size())


def stub(address: str) -> Any:
    return checkpoint_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(address))


def key(job: str, rank: int, step: int) -> checkpoint_pb2.ShardKey:
    return checkpoint_pb2.ShardKey(job_id=job, rank=rank, step=step)


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
        result = writer.snapshot(2, make_state(0, 2))
        assert "memory budget full" in result.skipped
        assert node.daemon.skipped_snapshots >= 1
        got, restored = restored_bytes(writer)
        assert restored.step == 1
        assert got == as_bytes(make_state(0, 1))
    finally:
        writer.close()


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
