"""Shared-memory slots: the segments ranks snapshot into, under one memory budget.

Every segment is a file in /dev/shm, named after its node and its daemon instance (see
instances.py). Segments are opened from /dev/shm directly rather than through
multiprocessing.shared_memory: before Python 3.13 that class registers every segment it
opens with a resource tracker that unlinks it when the opening process exits, which
would let a rank's exit destroy the daemon's snapshots. Each segment is fully allocated
when created (posix_fallocate), so a full /dev/shm is a refused slot here, never a
SIGBUS in a rank.

A segment is referenced by its holder (a writing rank, or a stored shard) and pinned
by readers (replication, flush, a restore stream); it returns to the free list only when
nothing references it, so a snapshot that is being written never lands in a segment
that still holds the last complete one (double buffering), and free segments are reused
so that a rank's mapping stays warm from step to step. A free segment whose file has
vanished from /dev/shm (removed by hand) is dropped rather than handed to a rank.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pitstop.checkpointd.errors import FailedPrecondition, ResourceExhausted
from pitstop.checkpointd.instances import InstanceMarker
from pitstop.checkpointd.instances import remove_stale_segments as remove_stale_segments
from pitstop.checkpointd.instances import segment_prefix as segment_prefix
from pitstop.rankside.shm import SHM_DIR as SHM_DIR

log = logging.getLogger(__name__)

_LARGE = 64 << 20
STALE_WRITE_SECONDS = 600.0
"""A slot unsealed this long is reclaimed when the budget needs its memory."""
_LARGE_GRANULE = 2 << 20
ENDED_JOBS_KEPT = 256
"""Ended jobs remembered, so that a segment of one released late is unlinked too."""

Owner = tuple[str, int]
"""(job id, rank) a segment was last written for."""


class MemoryBudgetFull(ResourceExhausted):
    """No slot fits the memory budget: the snapshot (or replica) is skipped."""


class SlotMismatch(FailedPrecondition):
    """A rank sealed a slot it was not given."""


def slot_size(size_bytes: int) -> int:
    """Bytes of a segment for a shard of `size_bytes`: rounded up so that the few header
    bytes a growing step number adds never force a new segment."""
    granule = _LARGE_GRANULE if size_bytes >= _LARGE else mmap.PAGESIZE
    return max(granule, -(-size_bytes // granule) * granule)


class Segment:
    """One shared-memory segment mapped into the daemon. `view` spans all of it."""

    def __init__(self, path: Path, size: int, mapping: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self._mapping = mapping
        self.view = memoryview(mapping)
        self.refs = 0
        self.owner: Owner | None = None

    @property
    def name(self) -> str:
        """Name of the segment under /dev/shm, as a rank opens it."""
        return self.path.name

    @classmethod
    def create(cls, path: Path, size: int) -> Segment:
        """Create, fully allocate and map a new segment at `path`."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return cls(path, size, mapping)

    def destroy(self) -> None:
        """Unmap and unlink. A mapping a reader still exports is left to the GC."""
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(BufferError):
            self.view.release()
            self._mapping.close()


class SlotPool:
    """Every segment of one daemon instance and the memory budget they share. Creating
    a pool claims a new instance (its marker); `close` unlinks every segment and then
    the marker. Thread-safe: segments are created in worker threads."""

    def __init__(
        self,
        prefix: str,
        budget_bytes: int,
        shm_dir: Path = SHM_DIR,
        stale_write_seconds: float = STALE_WRITE_SECONDS,
    ) -> None:
        self.prefix = prefix
        self.stale_write_seconds = stale_write_seconds
        self.budget_bytes = budget_bytes
        self.shm_dir = shm_dir
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._free: list[Segment] = []
        self._writing: dict[Owner, tuple[Segment, float]] = {}
        self._ended: dict[str, None] = {}  # the jobs forgotten last, oldest first
        self._reserved = 0
        self._names = itertools.count()
        self._marker = InstanceMarker.claim(prefix, shm_dir)
        self.instance = self._marker.instance
        """This pool's instance id: every segment it creates is named after it."""

    @property
    def used_bytes(self) -> int:
        """Bytes of every segment, free ones included, and those being created."""
        with self._lock:
            return self._used()

    def segment(self, name: str) -> Segment | None:
        """The live segment called `name`."""
        with self._lock:
            return self._segments.get(name)

    def allocate(self, size_bytes: int, owner: Owner) -> Segment:
        """A segment of at least `size_bytes`, referenced once by the caller: a free one
        if one fits (the owner's own first), else a new one if the budget allows after
        dropping free ones. Blocking; raises MemoryBudgetFull."""
        need = slot_size(size_bytes)
        with self._lock:
            segment = self._take_free(need, owner)
            if segment is None and self._used() + need > self.budget_bytes:
                self._reclaim_stale_writes()
                segment = self._take_free(need, owner)
            if segment is None:
                self._make_room(need)
                self._reserved += need
        if segment is not None:
            return segment
        path = self.shm_dir / f"{self.prefix}{self.instance}-{next(self._names)}"
        try:
            segment = Segment.create(path, need)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise MemoryBudgetFull(
                    f"{self.shm_dir} has no room for a {need}-byte slot ({exc.strerror}); "
                    "lower memory_budget_bytes below its free space"
                ) from None
            raise
        finally:
            with self._lock:
                self._reserved -= need
        with self._lock:
            segment.refs, segment.owner = 1, owner
            self._segments[segment.name] = segment
        return segment

    def begin_write(
        self, owner: Owner, size_bytes: int, *, may_create: bool = True
    ) -> Segment | None:
        """A slot for `owner`'s next snapshot. A slot the owner took before and never
        sealed (the rank died mid-copy) is given up first. With `may_create` False, only
        a free segment is taken (None if none fits): that never blocks."""
        with self._lock:
            abandoned, _ = self._writing.pop(owner, (None, 0.0))
        if abandoned is not None:
            log.info("slot %s of %s was never sealed: reclaimed", abandoned.name, owner)
            self.unref(abandoned)
        if may_create:
            segment: Segment | None = self.allocate(size_bytes, owner)
        else:
            with self._lock:
                segment = self._take_free(slot_size(size_bytes), owner)
        if segment is not None:
            with self._lock:
                self._writing[owner] = (segment, time.monotonic())
        return segment

    def finish_write(self, owner: Owner, name: str, size_bytes: int) -> Segment:
        """The slot `owner` wrote, now sealed; its reference passes to the caller."""
        with self._lock:
            segment, _ = self._writing.get(owner, (None, 0.0))
            if segment is None or segment.name != name:
                raise SlotMismatch(
                    f"slot {name!r} is not the one given to job {owner[0]} rank {owner[1]}"
                    f" ({segment.name if segment else 'none'}); acquire a slot first"
                )
            if size_bytes > segment.size:
                raise SlotMismatch(f"{size_bytes} bytes sealed in a {segment.size}-byte slot")
            del self._writing[owner]
        return segment

    def ref(self, segment: Segment) -> None:
        """Pin `segment` so that it is not reused until unref."""
        with self._lock:
            segment.refs += 1

    def unref(self, segment: Segment) -> None:
        """Drop one reference; the last one returns the segment to the free list, or
        unlinks it when its job ended (see `forget_job`)."""
        ended = False
        with self._lock:
            segment.refs -= 1
            if segment.refs == 0 and segment.name in self._segments:
                ended = segment.owner is not None and segment.owner[0] in self._ended
                if ended:
                    del self._segments[segment.name]
                else:
                    self._free.append(segment)
        if ended:
            segment.destroy()

    def forget_job(self, job_id: str) -> int:
        """The job ended: give up the slots its ranks took for their next snapshot, and
        unlink every free segment last written for it (the next job's shards may be of
        other sizes; a node between jobs holds none). A segment still pinned (a flush
        or a transfer under way) is unlinked when released. The bytes freed now."""
        with self._lock:
            self._ended[job_id] = None
            while len(self._ended) > ENDED_JOBS_KEPT:
                del self._ended[next(iter(self._ended))]
            for owner in [o for o in self._writing if o[0] == job_id]:
                segment, _ = self._writing.pop(owner)
                segment.refs -= 1
                if segment.refs == 0 and segment.name in self._segments:
                    self._free.append(segment)
            gone = [s for s in self._free if s.owner is not None and s.owner[0] == job_id]
            for segment in gone:
                self._free.remove(segment)
                del self._segments[segment.name]
        for segment in gone:
            segment.destroy()
        return sum(s.size for s in gone)

    @contextlib.contextmanager
    def pinned(self, segment: Segment) -> Iterator[Segment]:
        """`segment`, pinned for the duration of the block."""
        self.ref(segment)
        try:
            yield segment
        finally:
            self.unref(segment)

    def close(self) -> None:
        """Unlink every segment, then the instance's marker."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            self._free.clear()
            self._writing.clear()
        for segment in segments:
            segment.destroy()
        self._marker.release()

    def _reclaim_stale_writes(self) -> None:
        # A slot taken long ago and never sealed belongs to a rank that died or finished
        # (writers take their next slot ahead of time): its memory is needed now.
        deadline = time.monotonic() - self.stale_write_seconds
        for owner, (segment, since) in list(self._writing.items()):
            if since < deadline:
                log.info("slot %s of %s unsealed for long: reclaimed", segment.name, owner)
                del self._writing[owner]
                segment.refs -= 1
                if segment.refs == 0:
                    self._free.append(segment)

    def _take_free(self, need: int, owner: Owner) -> Segment | None:
        fits = [s for s in self._free if need <= s.size <= max(2 * need, need + _LARGE_GRANULE)]
        for segment in sorted(fits, key=lambda s: (s.owner != owner, s.size)):
            self._free.remove(segment)
            if not segment.path.exists():
                # Removed from /dev/shm behind our back: a rank could not open it.
                log.warning("free segment %s vanished from %s: dropped", segment.name, self.shm_dir)
                del self._segments[segment.name]
                segment.destroy()
                continue
            segment.refs, segment.owner = 1, owner
            return segment
        return None

    def _used(self) -> int:
        return self._reserved + sum(s.size for s in self._segments.values())

    def _make_room(self, need: int) -> None:
        used = self._used()
        while used + need > self.budget_bytes and self._free:
            victim = max(self._free, key=lambda s: s.size)
            self._free.remove(victim)
            del self._segments[victim.name]
            victim.destroy()
            used -= victim.size
        if used + need > self.budget_bytes:
            raise MemoryBudgetFull(
                f"memory budget full: a {need}-byte slot does not fit, {used} of "
                f"{self.budget_bytes} bytes are in use by {len(self._segments)} snapshots, "
                "replicas and leased slots; raise memory_budget_bytes to at least "
                f"{used + need} ({(used + need) / 1e9:.2f} GB), or lower keep_in_memory. "
                "Each rank needs keep_in_memory + 1 slots the size of its snapshot, and "
                "its buddy as many for the replicas"
            )
