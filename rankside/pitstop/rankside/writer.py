"""The rank's side: snapshot a flat state into a checkpointd slot, and restore it.

`snapshot` copies every tensor straight into a slot's shared memory and hands the seal
to a background thread: the copy is the rank's only stall. Everything else is done
ahead, once, or off the rank's path:

* the layout: planned once for a loop's tensors (format.plan_tensors) and planned again
  only when a tensor's name, dtype or shape changes; each step only encodes its
  metadata into the header;
* the slot: the background thread seals the slot and, in the same call, leases the
  slot for the next snapshot (SealSlot's `next_size_bytes`), so neither the round trip
  nor the allocation of a new segment falls inside the stall, and a snapshot costs one
  call's CPU on both sides, not two: on a few cores busy training, that CPU is taken
  from the training thread. A daemon that predates the lease, or refused it (its
  budget full), answers no slot, and the thread asks AcquireSlot on its own; a refusal
  there is reported by the next snapshot, which asks again when it needs the slot;
* the page faults: the background thread also maps that next slot with its pages
  populated, and mappings are kept from snapshot to snapshot. The daemon hands a rank
  back the segments its evicted snapshots gave up, so in steady state every snapshot
  lands in memory this process has already mapped and faulted in. A kept mapping
  whose segment the daemon dropped is unmapped at the next seal, so that it does not
  keep the memory alive.

The rank never waits for the seal's answer, yet a snapshot is readable only once the
daemon has sealed it: until then its slot is leased, no reader is given it, and the
snapshots the daemon holds sit in other segments, so a rank killed mid-copy leaves the
previous snapshot the newest. The next snapshot waits for the previous seal first (it
has long arrived unless steps are shorter than a round trip). Checksums, replication
and flushes happen in the daemon.

The copy itself can leave the rank's path too (CheckFreq's split): the tensors named in
`snapshot`'s `behind` (a training loop's parameters and optimizer state, which only the
next optimizer step changes) are copied on a thread of their own while the next step's
forward and backward run, and `wait_copied()` (which a Session calls in the optimizer's
step pre-hook) waits for what is left of it. The seal waits for the copy.

CUDA tensors are copied into pinned host memory on a side stream with a CUDA event
marking completion (tensorcopy.CudaStager); the background thread moves them into the
slot and seals it. `snapshot` returns once the copies are enqueued when every CUDA
tensor is named in `behind`, else once they have landed in pinned memory. That path
needs a GPU to run.

torch is imported only when a torch tensor is given or a restore returns tensors, so
the daemon and torch-free callers never import it.

Training outlives the daemon: a daemon that is down, refuses, or whose slot vanished
from /dev/shm costs a skipped snapshot (`SnapshotResult.skipped`), and a seal that
failed costs that snapshot (`lost_seals`), never the next one. A restore whose daemon
is unreachable, or whose segment vanished, pulls the shard from the other holders
instead (restoring.py, peers.py): those the catalog names, else the buddy. Each seal's
answer says where the catalog and the buddy are, so a rank knows them before it needs
them.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Set
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pitstop.common.tls import identity_from_env, open_channel
from pitstop.rankside.format import TensorPlan, plan_tensors, write_header
from pitstop.rankside.restoring import (
    SOURCES,
    Holders,
    RestoredState,
    decoded,
    restore_elsewhere,
    said,
)
from pitstop.rankside.shm import SHM_DIR
from pitstop.rankside.tensorcopy import (
    CUDA,
    PLAIN,
    Copier,
    CudaStager,
    MappedSlot,
    Signature,
    copy_into,
    describe,
    signature,
)
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 << 20)]
_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""The daemon is down or hung: a snapshot is skipped, a restore goes to other holders."""
_OUTAGES = _GONE | {grpc.StatusCode.RESOURCE_EXHAUSTED}
"""Errors that skip a snapshot instead of failing the rank: training outlives the daemon."""


_Span = tuple[str, int, int]
"""How a tensor is copied (tensorcopy.PLAIN, CUDA, OTHER) and its [begin, end) relative
to the shard's data start."""
_Move = tuple[int, int, int]
"""A memmove: (target address, source address, bytes)."""
_COPIED: Future[None] = Future()
_COPIED.set_result(None)
"""A copy behind that is done (or that there never was)."""


@dataclass(frozen=True)
class SnapshotResult:
    """How a snapshot went. `skipped`: why it was not saved (the daemon unreachable,
    its memory budget full, its slot vanished); training goes on."""

    step: int
    size_bytes: int
    stall_seconds: float
    skipped: str = ""


class SnapshotWriter:
    """Snapshots and restores one rank's state through the local checkpointd.
    `catalog_address` (the scheduler) and `buddy_address` are where a restore looks when
    that daemon cannot serve; each seal's answer updates them. `keep_mappings`: the most
    slot mappings kept (the least recently used beyond it are unmapped); `copy_threads`:
    threads that copy a large state (default: up to 4, one per CPU)."""

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
        keep_mappings: int = 32,
        copy_threads: int | None = None,
        catalog_address: str = "",
        buddy_address: str = "",
    ) -> None:
        self.job_id, self.rank, self.generation = job_id, rank, generation
        self.address = address
        self.catalog_address = catalog_address
        self.buddy_address = buddy_address
        self._identity = identity_from_env()  # a rank's node identity, when its agent set one
        self._channel = open_channel(address, self._identity, options=_CHANNEL_OPTIONS)
        self._stub = checkpoint_pb2_grpc.CheckpointServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._timeout = timeout_s
        self._shm_dir = shm_dir
        self._keep = keep_mappings
        self._slots: OrderedDict[str, MappedSlot] = OrderedDict()
        self.copy_threads = copy_threads or min(4, os.cpu_count() or 1)
        self._copier = Copier(self.copy_threads)
        self._background = ThreadPoolExecutor(1, "pitstop-seal")
        self._finishing: Future[None] | None = None
        self._copying: Future[None] = _COPIED
        """The last snapshot's copy of its tensors named `behind`, while it runs."""
        self._finishing_step = 0
        self._next_slot: checkpoint_pb2.AcquireSlotResponse | None = None
        self._plan: tuple[list[tuple[str, Signature]], TensorPlan, list[_Span]] | None = None
        self._cuda: CudaStager | None = None
        self.sealed_seconds = 0.0
        """From the start of the last snapshot to the daemon's acknowledgement of its seal."""
        self.lost_seals = 0
        """Snapshots taken whose seal failed (each logged): they are not in memory."""
        self.copy_waited_seconds = 0.0
        """The time `wait_copied` held its callers, all told (beside the stalls)."""

    def snapshot(
        self,
        step: int,
        tensors: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
        *,
        behind: Set[str] = frozenset(),
    ) -> SnapshotResult:
        """Copy `tensors` (name -> torch tensor, numpy array or bytes-like) and `metadata`
        into a slot, sealed as (job, rank, step) in the background. Those named in
        `behind` are copied after this returns: none may change until `wait_copied()`
        has (the others are copied, or landed in pinned memory, when this returns)."""
        started = time.perf_counter()
        self.settle()
        meta = {
            **(metadata or {}),
            "format": "pt",
            "pitstop.job_id": self.job_id,
            "pitstop.rank": str(self.rank),
            "pitstop.step": str(step),
            "pitstop.generation": str(self.generation),
        }
        plan, spans = self._planned(tensors)
        layout = plan.shard(meta)
        key = self._key(step)
        slot, self._next_slot = self._next_slot, None
        if slot is None or slot.size_bytes < layout.size:
            try:
                slot = self._acquire(key, layout.size)
            except grpc.RpcError as exc:
                if exc.code() not in _OUTAGES:
                    raise
                what = "unreachable" if exc.code() in _GONE else "refused the slot"
                reason = f"checkpointd {what}: {exc.code().name} {exc.details()}"
                if exc.code() in _GONE:
                    self._reconnect()
                return SnapshotResult(step, layout.size, time.perf_counter() - started, reason)
        try:
            mapped = self._mapped(slot.shm_name, slot.size_bytes)
            # A kept mapping outlives its file: a slot leased from a daemon that has
            # restarted since would be sealed into one that never gave it.
            if mapped.unlinked():
                self._slots.pop(slot.shm_name).close()
                raise FileNotFoundError(slot.shm_name)
        except FileNotFoundError:
            reason = (
                f"slot {slot.shm_name} vanished from {self._shm_dir} (checkpointd restarted, "
                "or its memory was removed)"
            )
            return SnapshotResult(step, layout.size, time.perf_counter() - started, reason)
        write_header(layout, mapped.view)
        on_gpu: dict[str, Any] = {}
        moves, later = list[_Move](), list[_Move]()  # now, and behind
        start = layout.data_start
        base = mapped.address + start
        for (name, value), (kind, offset, stop) in zip(tensors.items(), spans, strict=True):
            if kind is PLAIN:
                move = (base + offset, value.data_ptr(), stop - offset)
                (later if name in behind else moves).append(move)
            elif kind is CUDA:
                on_gpu[name] = value
            elif stop > offset:
                copy_into(value, mapped.view, start + offset, start + stop)
        self._copier.move(moves)
        copying = self._copying = self._copier.behind(later) if later else _COPIED
        complete: Callable[[], None] | None = None
        if on_gpu:
            self._cuda = self._cuda or CudaStager()
            complete = self._cuda.stage(on_gpu, layout, mapped.view)
            if not on_gpu.keys() <= behind:
                self._cuda.wait_landed()  # one of them may change as soon as this returns
        seal = checkpoint_pb2.SealSlotRequest(
            key=key, shm_name=slot.shm_name, size_bytes=layout.size, next_size_bytes=layout.size
        )
        self._finishing = self._background.submit(self._finish, seal, complete, copying, started)
        self._finishing_step = step
        return SnapshotResult(step, layout.size, time.perf_counter() - started)

    def wait_copied(self) -> None:
        """Block until the last snapshot's tensors named `behind` are copied (a CUDA one:
        into pinned host memory), so they may change; the seal goes on. A copy that
        failed is its seal's to report (`lost_seals`)."""
        started = time.perf_counter()
        futures.wait([self._copying])
        if self._cuda is not None:
            self._cuda.wait_landed()
        self.copy_waited_seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Block until the last snapshot is sealed; raise what sealing it raised."""
        finishing, self._finishing = self._finishing, None
        if finishing is not None:
            finishing.result()

    def settle(self) -> None:
        """Block until the last snapshot is sealed; a seal that failed costs that
        snapshot only, logged and counted in `lost_seals`."""
        try:
            self.wait()
        except Exception as exc:
            self.lost_seals += 1
            self._next_slot = None
            log.warning(
                "rank %d: the snapshot of step %d was not sealed (it is lost): %s",
                self.rank,
                self._finishing_step,
                said(exc),
            )

    def restore(
        self, step: int = 0, into: Mapping[str, Any] | None = None, rank: int | None = None
    ) -> RestoredState:
        """The state at `step` (0: the newest committed), from wherever the daemon finds
        it, or from another holder when the daemon is unreachable or its segment
        vanished. Tensors named in `into` are copied into those tensors in place (where
        the shapes agree). `rank`: another rank's shard (default this writer's; a job
        resharded after a shrink reads the old ranks'). Raises grpc.RpcError when the
        daemon refuses (e.g. NOT_FOUND: no copy anywhere), and ShardUnavailable when no
        holder could serve."""
        self.settle()
        rank = self.rank if rank is None else rank
        try:
            response = self._stub.Restore(
                checkpoint_pb2.RestoreRequest(key=self._key(step, rank)),
                timeout=self._timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() not in _GONE:
                raise
            self._reconnect()
            reason = f"checkpointd {self.address} unreachable: {said(exc)}"
            return restore_elsewhere(self._holders(False), step, into, reason, rank)
        header = response.header
        try:
            slot = MappedSlot.open(self._shm_dir / response.shm_name, header.size_bytes, False)
        except FileNotFoundError:
            reason = f"segment {response.shm_name} vanished from {self._shm_dir}"
            return restore_elsewhere(self._holders(True), int(header.key.step), into, reason, rank)
        try:
            return decoded(header, slot.view, SOURCES.get(response.source, "unknown"), into)
        finally:
            slot.close()

    def close(self) -> None:
        """Finish the pending seal (one that fails is logged and counted), unmap the
        slots, close the channel."""
        try:
            self.settle()
        finally:
            self._background.shutdown()
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
            self._copier.close()
            self._channel.close()

    def _holders(self, local_answers: bool) -> Holders:
        """Where a restore looks when this writer's daemon cannot serve it."""
        return Holders(
            self.job_id,
            self.address,
            local_answers,
            self.catalog_address,
            self.buddy_address,
            self._timeout,
            self._metadata,
            self._identity,
        )

    def _reconnect(self) -> None:
        """A fresh channel, so the next call tries the daemon at once: the old one
        would wait out its reconnect backoff (up to minutes) after a daemon restart."""
        self._channel.close()
        self._channel = open_channel(self.address, self._identity, options=_CHANNEL_OPTIONS)
        self._stub = checkpoint_pb2_grpc.CheckpointServiceStub(self._channel)

    def _key(self, step: int, rank: int | None = None) -> checkpoint_pb2.ShardKey:
        return checkpoint_pb2.ShardKey(
            job_id=self.job_id,
            rank=self.rank if rank is None else rank,
            step=step,
            generation=self.generation,
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
        copying: Future[None],
        started: float,
    ) -> None:
        copying.result()
        if complete is not None:
            complete()
        sealed = self._stub.SealSlot(seal, timeout=self._timeout, metadata=self._metadata)
        self.sealed_seconds = time.perf_counter() - started
        self.catalog_address = sealed.catalog_address or self.catalog_address
        self.buddy_address = sealed.buddy_address or self.buddy_address
        if sealed.HasField("next_slot"):
            slot = sealed.next_slot
        else:
            # Only after the seal: an acquire that overtook it would reclaim the slot.
            try:
                slot = self._acquire(self._key(seal.key.step + 1), seal.next_size_bytes)
            except grpc.RpcError as exc:
                log.debug("acquiring the next slot ahead failed: %s", exc)
                return
        for name, mapped in list(self._slots.items()):
            if mapped.unlinked():
                del self._slots[name]
                mapped.close()
        try:
            self._mapped(slot.shm_name, slot.size_bytes)  # its page faults, taken here
        except OSError as exc:
            log.debug("mapping the next slot %s ahead failed: %s", slot.shm_name, exc)
        self._next_slot = slot

    def _planned(self, tensors: Mapping[str, Any]) -> tuple[TensorPlan, list[_Span]]:
        """The layout of `tensors`' data, and how each is copied and to which [begin,
        end) relative to the data start, in the order given: planned again only when a
        tensor changed."""
        signatures = [(name, signature(value)) for name, value in tensors.items()]
        if self._plan is None or self._plan[0] != signatures:
            plan = plan_tensors(describe(name, value) for name, value in tensors.items())
            where = {entry.name: (entry.begin, entry.end) for entry in plan.entries}
            spans = [(kind, *where[name]) for name, (kind, _, _) in signatures]
            self._plan = signatures, plan, spans
        return self._plan[1], self._plan[2]

    def _mapped(self, name: str, size: int) -> MappedSlot:
        slot = self._slots.pop(name, None)
        if slot is not None and len(slot.mapping) != size:
            slot.close()
            slot = None
        if slot is None:
            slot = MappedSlot.open(self._shm_dir / name, size, writable=True)
        self._slots[name] = slot
        while len(self._slots) > self._keep:
            self._slots.popitem(last=False)[1].close()
        return slot
