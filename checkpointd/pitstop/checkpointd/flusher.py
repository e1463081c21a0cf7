"""Background durable flushes: which steps, and retrying them until they land.

A step is flushed every `every_steps` steps (step % M == 0), or, with M = 0, at the
Young/Daly interval from the measured step time, the measured flush cost and the job's
failure rate, rounded down to a power of two: daemons that measure slightly different
intervals then still flush common steps, so the job gets complete durable checkpoints.

A failed flush (disk full, permission, store down) is logged, reported to the scheduler
and retried with backoff; it never reaches a rank and never drops the in-memory copies.
A retry is given up only when a newer step of the same job is waiting to be flushed.
A flush that would leave a local filesystem with less than `min_free_bytes` free is
refused before it writes a byte (and so retried, and reported, until there is room): a
full disk never holds a half-written shard, nor does a write that failed half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable

from pitstop.checkpointd.catalog import CatalogClient
from pitstop.checkpointd.slots import SlotPool
from pitstop.checkpointd.store import ShardRecord, Tier
from pitstop.health.interval import durable_every_steps
from pitstop.rankside.durable import DurableEntry, DurableShard, DurableStore
from pitstop.v1 import checkpoint_pb2

log = logging.getLogger(__name__)

_EWMA = 0.3
_FIRST_RETRY_SECONDS = 0.1


class DurableFlusher:
    """Flushes due local shards to the durable store, oldest step first."""

    def __init__(
        self,
        durable: DurableStore,
        pool: SlotPool,
        catalog: CatalogClient,
        *,
        every_steps: int,
        keep_durable: int,
        failures_per_hour: float,
        max_every_steps: int = 10_000,
        retry_max_seconds: float = 30.0,
        hold_at_step: int = 0,
        min_free_bytes: int = 0,
    ) -> None:
        self.durable = durable
        self._pool = pool
        self._catalog = catalog
        self._every = every_steps
        self._keep = keep_durable
        self._failures_per_hour = failures_per_hour
        self._max_every = max_every_steps
        self._retry_max = retry_max_seconds
        self._hold_at_step = hold_at_step
        self._min_free = min_free_bytes
        self._released = threading.Event()
        self._pending: dict[tuple[str, int], list[ShardRecord]] = {}
        self._wake = asyncio.Event()
        self._last_seal: dict[str, tuple[int, float]] = {}
        self._step_seconds: dict[str, float] = {}
        self.flush_cost_s: float | None = None
        self.flushed_bytes = 0
        self.failures = 0

    def jobs(self) -> set[str]:
        """The jobs whose step time it keeps."""
        return set(self._last_seal)

    def forget(self, job_id: str) -> None:
        """The job ended: its step time is learned again should it ever come back."""
        self._last_seal.pop(job_id, None)
        self._step_seconds.pop(job_id, None)

    def every_steps(self, job_id: str) -> int:
        """Steps between durable flushes of `job_id` now."""
        if self._every:
            return self._every
        step_s, cost = self._step_seconds.get(job_id), self.flush_cost_s
        if step_s is None or cost is None or step_s <= 0:
            return 1
        steps = durable_every_steps(step_s, cost, self._failures_per_hour, 1, self._max_every)
        return 1 << (steps.bit_length() - 1)

    def observe_seal(self, job_id: str, step: int, now: float | None = None) -> None:
        """Learn the job's step time from the seals of its local ranks."""
        now = time.monotonic() if now is None else now
        last = self._last_seal.get(job_id)
        if last is None or step > last[0]:
            if last is not None:
                sample = (now - last[1]) / (step - last[0])
                old = self._step_seconds.get(job_id)
                self._step_seconds[job_id] = sample if old is None else _mix(old, sample)
            self._last_seal[job_id] = (step, now)

    def submit(self, record: ShardRecord) -> None:
        """Flush `record` if its step is due."""
        job_id, step = record.shard.job_id, record.shard.step
        if step % self.every_steps(job_id):
            return
        # Flushes slower than due steps arrive must not pile up pinned memory: a newer
        # due step replaces an older one still waiting.
        for older in [js for js in self._pending if js[0] == job_id and js[1] < step]:
            log.info("durable flush of job %s step %d skipped for step %d", job_id, older[1], step)
            for stale in self._pending.pop(older):
                self._pool.unref(stale.segment)
        self._pool.ref(record.segment)
        self._pending.setdefault((job_id, step), []).append(record)
        self._wake.set()

    async def run(self) -> None:
        """Flush pending steps until cancelled."""
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            job_step = min(self._pending, key=lambda js: js[1])
            records = self._pending.pop(job_step)
            try:
                await self._flush_until_done(*job_step, records)
            finally:
                for record in records:
                    self._pool.unref(record.segment)

    async def _flush_until_done(self, job_id: str, step: int, records: list[ShardRecord]) -> None:
        delay = 0.0
        while True:
            try:
                await self._flush(job_id, step, records)
                return
            except Exception as exc:  # any store failure: it is reported, never raised
                self.failures += 1
                message = (
                    f"durable flush of job {job_id} step {step} to {self.durable.url} failed: "
                    f"{type(exc).__name__}: {exc}"
                )
                self._catalog.flush_failed(message)
                if any(j == job_id and s > step for j, s in self._pending):
                    log.warning("%s; a newer step supersedes it", message)
                    return
                delay = min(self._retry_max, max(_FIRST_RETRY_SECONDS, delay * 2))
                log.warning("%s; retrying in %.1fs", message, delay)
                with contextlib.suppress(TimeoutError):
                    self._wake.clear()
                    await asyncio.wait_for(self._wake.wait(), delay * random.uniform(0.5, 1))

    async def _flush(self, job_id: str, step: int, records: list[ShardRecord]) -> None:
        shards = [DurableShard(r.shard.rank, r.data(), r.checksum or "") for r in records]
        generation = max(r.generation for r in records)
        needed = sum(len(s.data) for s in shards)
        free = await asyncio.to_thread(self.durable.free_bytes)
        if free is not None and free - needed < self._min_free:
            raise DurableStoreFull(
                f"refused before writing: {_size(free)} free, the flush needs {_size(needed)}"
                f" and durable_min_free_bytes keeps {_size(self._min_free)}; free space"
                " there or set durable_url to another store (flushing resumes by itself,"
                " the snapshots in memory are kept)"
            )
        started = time.monotonic()
        entries = await asyncio.to_thread(
            self.durable.write_checkpoint, job_id, step, generation, shards, self._hold(step)
        )
        cost = time.monotonic() - started
        self.flush_cost_s = cost if self.flush_cost_s is None else _mix(self.flush_cost_s, cost)
        size = sum(len(s.data) for s in shards)
        self.flushed_bytes += size
        log.info(
            "durable checkpoint written: job=%s step=%d ranks=%s (%d bytes in %.3fs)",
            job_id,
            step,
            sorted(s.rank for s in shards),
            size,
            cost,
        )
        for entry in entries:
            self._catalog.shard_added(durable_info(entry), Tier.DURABLE)
        for shard in await asyncio.to_thread(self.durable.prune, job_id, self._keep):
            self._catalog.shard_removed(shard, 0, Tier.DURABLE)

    def _hold(self, step: int) -> Callable[[], None] | None:
        if step != self._hold_at_step:
            return None

        def hold() -> None:
            log.warning("durable flush held before its manifest (fault injection): step=%d", step)
            self._released.wait()
            raise RuntimeError("daemon stopping during a held flush")

        return hold

    def close(self) -> None:
        """Release a flush held by fault injection, so its thread can end."""
        self._released.set()
        for records in self._pending.values():
            for record in records:
                self._pool.unref(record.segment)
        self._pending.clear()


class DurableStoreFull(Exception):
    """The durable store's filesystem has no room for a flush (it is retried)."""


def _size(count: int) -> str:
    return f"{count / (1 << 30):.2f} GiB" if count >= 1 << 30 else f"{count / (1 << 20):.1f} MiB"


def durable_info(entry: DurableEntry) -> checkpoint_pb2.ShardInfo:
    """The wire description of a durable shard."""
    return checkpoint_pb2.ShardInfo(
        header=checkpoint_pb2.ShardHeader(
            key=checkpoint_pb2.ShardKey(
                job_id=entry.shard.job_id,
                rank=entry.shard.rank,
                step=entry.shard.step,
                generation=entry.generation,
            ),
            size_bytes=entry.size,
            checksum=entry.checksum,
            checksum_algorithm="xxh3_64",
            origin_node_id=entry.node_id,
        ),
        tier=checkpoint_pb2.SHARD_TIER_DURABLE,
    )


def _mix(old: float, sample: float) -> float:
    return (1 - _EWMA) * old + _EWMA * sample
