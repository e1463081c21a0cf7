"""The rank's side: snapshot a flat state into a checkpointd slot, and restore it.

`snapshot` lays the tensors out (format.py), copies every tensor straight into a slot's
shared memory and hands the seal to a background thread: the copy is the rank's only
stall. The background thread seals the slot and at once acquires the slot for the next
snapshot, so that neither round trip to the daemon, nor the allocation of a new
segment, falls inside the stall. Checksums, replication and flushes happen in the daemon.

CUDA tensors are copied into pinned host memory on a side stream with a CUDA event
marking completion (tensorcopy.CudaStager); `snapshot` returns once the copies are
enqueued and the background thread moves them into the slot and seals it. Call `wait()`
before anything overwrites a snapshotted CUDA tensor (the next optimizer step). That
path needs a GPU to run.

torch is imported only when a torch tensor is given or a restore returns tensors, so
the daemon and torch-free callers never import it. Slot mappings are kept from snapshot
to snapshot: the daemon reuses slots, so their pages stay mapped.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pitstop.checkpointd.format import plan_shard, read_layout, write_header
from pitstop.checkpointd.slots import SHM_DIR
from pitstop.checkpointd.tensorcopy import (
    Copier,
    CudaStager,
    MappedSlot,
    copy_into,
    describe,
    is_cuda,
    is_plain_cpu_tensor,
    read_tensor,
)
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 << 20)]
_OUTAGES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
"""Errors that skip a snapshot instead of failing the rank: training outlives the daemon."""
_SOURCES = {
    checkpoint_pb2.SHARD_TIER_LOCAL: "local",
    checkpoint_pb2.SHARD_TIER_REPLICA: "replica",
    checkpoint_pb2.SHARD_TIER_DURABLE: "durable",
}


@dataclass(frozen=True)
class SnapshotResult:
    """How a snapshot went. `skipped`: why there was no slot (memory budget full, or
    the daemon unreachable); the state was not saved and training goes on."""

    step: int
    size_bytes: int
    stall_seconds: float
    skipped: str = ""


@dataclass
class RestoredState:
    """A restored shard: its tensors (torch tensors; bytes without torch), metadata and
    where the daemon found it ("local", "replica" or "durable")."""

    step: int
    generation: int
    tensors: dict[str, Any]
    metadata: dict[str, str]
    source: str
    checksum: str = ""


class SnapshotWriter:
    """Snapshots and restores one rank's state through the local checkpointd."""

    def __init__(
        self,
        address: str,
        job_id: str,
        rank: int,
        *,
        generation: int = 0,
        token: str = "",
        timeout_s: float = 30.0,
        shm_dir: Path = SHM_DIR,
        keep_mappings: int = 4,
        copy_threads: int | None = None,
    ) -> None:
        self.job_id, self.rank, self.generation = job_id, rank, generation
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = checkpoint_pb2_grpc.CheckpointServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._timeout = timeout_s
        self._shm_dir = shm_dir
        self._keep = keep_mappings
        self._slots: OrderedDict[str, MappedSlot] = OrderedDict()
        self._copier = Copier(copy_threads or min(4, os.cpu_count() or 1))
        self._background = ThreadPoolExecutor(1, "pitstop-seal")
        self._finishing: Future[None] | None = None
        self._next_slot: checkpoint_pb2.AcquireSlotResponse | None = None
        self._cuda: CudaStager | None = None
        self.sealed_seconds = 0.0
        """From the start of the last snapshot to the daemon's acknowledgement of its seal."""

    def snapshot(
        self, step: int, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None
    ) -> SnapshotResult:
        """Copy `tensors` (name -> torch tensor, numpy array or bytes-like) and `metadata`
        into a slot; it is sealed as (job, rank, step) in the background."""
        started = time.perf_counter()
        try:
            self.wait()
        except grpc.RpcError as exc:
            if exc.code() not in _OUTAGES:
                raise
            log.warning("the previous snapshot was not sealed (it is lost): %s", exc.details())
        meta = {
            **(metadata or {}),
            "format": "pt",
            "pitstop.job_id": self.job_id,
            "pitstop.rank": str(self.rank),
            "pitstop.step": str(step),
            "pitstop.generation": str(self.generation),
        }
        layout = plan_shard([describe(name, value) for name, value in tensors.items()], meta)
        key = self._key(step)
        slot, self._next_slot = self._next_slot, None
        if slot is None or slot.size_bytes < layout.size:
            try:
                slot = self._acquire(key, layout.size)
            except grpc.RpcError as exc:
                if exc.code() not in _OUTAGES:
                    raise
                reason = f"checkpointd unreachable: {exc.code().name} {exc.details()}"
                return SnapshotResult(step, layout.size, time.perf_counter() - started, reason)
        if slot.refused:
            return SnapshotResult(step, layout.size, time.perf_counter() - started, slot.refused)
        mapped = self._mapped(slot.shm_name, slot.size_bytes)
        write_header(layout, mapped.view)
        on_gpu, moves = {}, []
        for name, value in tensors.items():
            begin, end = layout.span(layout.entry(name))
            if is_cuda(value):
                on_gpu[name] = value
            elif end == begin:
                continue
            elif is_plain_cpu_tensor(value):
                moves.append((mapped.address + begin, int(value.data_ptr()), end - begin))
            else:
                copy_into(value, mapped.view, begin, end)
        self._copier.move(moves)
        complete: Callable[[], None] | None = None
        if on_gpu:
            self._cuda = self._cuda or CudaStager()
            complete = self._cuda.stage(on_gpu, layout, mapped.view)
        seal = checkpoint_pb2.SealSlotRequest(
            key=key, shm_name=slot.shm_name, size_bytes=layout.size
        )
        self._finishing = self._background.submit(self._finish, seal, complete, started)
        return SnapshotResult(step, layout.size, time.perf_counter() - started)

    def wait(self) -> None:
        """Block until the last snapshot is sealed; raise what sealing it raised."""
        finishing, self._finishing = self._finishing, None
        if finishing is not None:
            finishing.result()

    def restore(self, step: int = 0, into: Mapping[str, Any] | None = None) -> RestoredState:
        """The state at `step` (0: the newest committed), from wherever the daemon finds
        it. Tensors named in `into` are copied into those tensors in place."""
        self.wait()
        response = self._stub.Restore(
            checkpoint_pb2.RestoreRequest(key=self._key(step)),
            timeout=self._timeout,
            metadata=self._metadata,
        )
        header = response.header
        path = self._shm_dir / response.shm_name
        slot = MappedSlot.open(path, header.size_bytes, writable=False)
        try:
            layout = read_layout(slot.view, header.size_bytes)
            tensors = {e.name: read_tensor(slot.view, layout, e.name, into) for e in layout.entries}
        finally:
            slot.close()
        return RestoredState(
            header.key.step,
            header.key.generation,
            tensors,
            dict(layout.metadata),
            _SOURCES.get(response.source, "unknown"),
            header.checksum,
        )

    def close(self) -> None:
        """Finish the pending seal, unmap the slots, close the channel."""
        try:
            self.wait()
        finally:
            self._background.shutdown()
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
            self._copier.close()
            self._channel.close()

    def _key(self, step: int) -> checkpoint_pb2.ShardKey:
        return checkpoint_pb2.ShardKey(
            job_id=self.job_id, rank=self.rank, step=step, generation=self.generation
        )

    def _acquire(self, key: checkpoint_pb2.ShardKey, size: int) -> Any:
        return self._stub.AcquireSlot(
            checkpoint_pb2.AcquireSlotRequest(key=key, size_bytes=size),
            timeout=self._timeout,
            metadata=self._metadata,
        )

    def _finish(
        self,
        seal: checkpoint_pb2.SealSlotRequest,
        complete: Callable[[], None] | None,
        started: float,
    ) -> None:
        if complete is not None:
            complete()
        self._stub.SealSlot(seal, timeout=self._timeout, metadata=self._metadata)
        self.sealed_seconds = time.perf_counter() - started
        # Only after the seal: an acquire that overtook it would reclaim the slot.
        try:
            self._next_slot = self._acquire(self._key(seal.key.step + 1), seal.size_bytes)
        except grpc.RpcError as exc:
            log.debug("acquiring the next slot ahead failed: %s", exc)

    def _mapped(self, name: str, size: int) -> MappedSlot:
        slot = self._slots.get(name)
        if slot is None or len(slot.mapping) != size:
            if slot is not None:
                slot.close()
            slot = self._slots[name] = MappedSlot.open(self._shm_dir / name, size, writable=True)
        self._slots.move_to_end(name)
        while len(self._slots) > self._keep:
            self._slots.popitem(last=False)[1].close()
        return slot
