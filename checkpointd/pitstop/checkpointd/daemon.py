"""One checkpoint daemon, wired together: slots, the shard store, the pipeline behind
every sealed snapshot (checksum, replicate, report, flush), restores and the server.

The rank path (AcquireSlot, SealSlot) only keeps books and, for a new slot, allocates
shared memory; everything else happens after SealSlot has answered. A SealSlot may
also lease the rank's next slot, so that a snapshot costs the rank one call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc

from pitstop.checkpointd.catalog import CatalogClient
from pitstop.checkpointd.config import CheckpointdSettings
from pitstop.checkpointd.errors import CheckpointdError, InvalidArgument, Unavailable
from pitstop.checkpointd.flusher import DurableFlusher, durable_info
from pitstop.checkpointd.instances import remove_stale_segments, segment_prefix
from pitstop.checkpointd.interceptors import ErrorInterceptor, TokenInterceptor
from pitstop.checkpointd.replication import (
    CHANNEL_OPTIONS,
    Replicator,
    receive_chunks,
    shard_chunks,
)
from pitstop.checkpointd.restore import RestoreSources, ShardNotFound
from pitstop.checkpointd.service import CheckpointServicer
from pitstop.checkpointd.slots import MemoryBudgetFull, Segment, SlotPool
from pitstop.checkpointd.store import ShardRecord, ShardStore, Tier
from pitstop.common.heap import trim
from pitstop.common.tls import NodeIdentity, node_server_credentials
from pitstop.rankside.durable import DurableStore
from pitstop.rankside.format import ShardFormatError, read_layout
from pitstop.rankside.shards import ShardId, shard_checksum
from pitstop.rankside.shm import SHM_DIR
from pitstop.v1 import checkpoint_pb2

log = logging.getLogger(__name__)

MEMBERS_FRESH_SECONDS = 10.0
"""How long a daemon trusts the scheduler's answer that a node runs a job's rank."""

_INLINE_CHECKSUM_BYTES = 4 << 20
"""Shards up to this size are checksummed on the event loop (under 0.5 ms of hashing):
handing them to a thread costs more CPU than the hash, on every snapshot."""

HEAP_TRIM_SECONDS = 60.0
"""How often the daemon gives its threads' freed heap pages back (common/heap.py): its
worker threads' transient buffers would otherwise keep its RSS at their high-water mark."""


class CheckpointDaemon:
    """Every part of one checkpointd. `start` serves; `stop` unlinks every segment."""

    def __init__(self, settings: CheckpointdSettings, shm_dir: Path = SHM_DIR) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.prefix = segment_prefix(settings.node_id)
        self.shm_dir = shm_dir
        self.pool = SlotPool(self.prefix, settings.budget_bytes(shm_dir), shm_dir)
        self.store = ShardStore(settings.keep_in_memory)
        self.identity = (
            NodeIdentity(settings.tls_dir, settings.node_id) if settings.tls_dir else None
        )
        self.catalog = CatalogClient(
            settings.scheduler,
            settings.node_id,
            token=settings.token,
            identity=self.identity,
            static_buddy=settings.buddy,
            retry_max_seconds=settings.retry_max_seconds,
            idle_report_seconds=settings.idle_report_seconds,
        )
        self.replicator = Replicator(
            self.catalog,
            self.pool,
            token=settings.token,
            identity=self.identity,
            retry_max_seconds=settings.retry_max_seconds,
        )
        self.durable = DurableStore(settings.durable_url, settings.node_id)
        self.flusher = DurableFlusher(
            self.durable,
            self.pool,
            self.catalog,
            every_steps=settings.flush_every_steps,
            keep_durable=settings.keep_durable,
            failures_per_hour=settings.failures_per_hour,
            max_every_steps=settings.max_flush_every_steps,
            retry_max_seconds=settings.retry_max_seconds,
            hold_at_step=settings.fault_hold_flush_at_step,
            min_free_bytes=settings.durable_min_free_bytes,
        )
        self.sources = RestoreSources(
            self.node_id,
            self.store,
            self.pool,
            self.catalog,
            self.replicator,
            self.durable,
            self._keep_replica,
        )
        self.catalog.held_jobs = lambda: {r.shard.job_id for r in self.store.records()}
        self.catalog.on_ended = lambda ended: forget_jobs(self, ended)
        self.skipped_snapshots = 0
        self.members: dict[str, tuple[set[str], float]] = {}
        """Job -> the nodes that ran its ranks when the scheduler was last asked, and when."""
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._sealed: asyncio.Queue[ShardRecord] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def address(self) -> str:
        """host:port this daemon serves on (the port it got, when asked for 0)."""
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "") else self.settings.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Remove segments that killed predecessors left (never those of a live daemon
        with this node id), then serve."""
        stale = remove_stale_segments(self.prefix, self.shm_dir)
        if stale:
            log.warning("removed %d shared-memory segments left by a dead daemon", len(stale))
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
        if self.settings.token:
            interceptors.append(TokenInterceptor(self.settings.token))
        server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
        CheckpointServicer(self).attach(server)
        where = f"{self.settings.host}:{self.settings.port}"
        if self.identity is not None:
            if not self.identity.enrolled:
                raise RuntimeError(
                    f"tls_dir {self.identity.directory} holds no valid certificate for node "
                    f"{self.node_id}: give a join token (--join-token or "
                    "PITSTOP_CHECKPOINTD_JOIN_TOKEN; `pitstop token create --node-id ...`), "
                    "start the node's agent with one first, or leave tls_dir unset"
                )
            self.port = server.add_secure_port(where, node_server_credentials(self.identity))
        else:
            self.port = server.add_insecure_port(where)
        await server.start()
        self._server = server
        for work in (
            self.catalog.run(self._stop),
            self.replicator.run(),
            self.flusher.run(),
            self._checksum_sealed(),
            self._trim_heap(),
        ):
            self._tasks.append(asyncio.create_task(work))

    async def stop(self, grace: float = 2.0) -> None:
        """Stop serving and background work; unlink every segment."""
        self._stop.set()
        if self._server is not None:
            await self._server.stop(grace)
        self.flusher.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.replicator.close()
        await self.catalog.close()
        self.pool.close()

    # The rank path.

    async def acquire_slot(self, shard: ShardId, size_bytes: int) -> Segment:
        """A slot for the rank's snapshot. MemoryBudgetFull when there is no room (the
        rank skips the snapshot); Unavailable while the daemon stops."""
        try:
            return await self._begin_write(shard, size_bytes)
        except MemoryBudgetFull as exc:
            self.skipped_snapshots += 1
            log.warning(
                "slot for job %s rank %d refused, its snapshot is skipped: %s",
                shard.job_id,
                shard.rank,
                exc,
            )
            raise

    async def lease_next(self, sealed: ShardId, size_bytes: int) -> Segment | None:
        """The slot for the next snapshot of `sealed`'s rank, leased as part of its seal
        (SealSlot's `next_size_bytes`), or None when none can be had. `sealed` is sealed
        already, so no refusal here may fail that seal: the rank, given no slot, asks
        AcquireSlot, whose status says why (as a lease taken on its own would)."""
        try:
            return await self._begin_write(sealed, size_bytes)
        except CheckpointdError as exc:
            log.debug("no slot leased with the seal of %s: %s", sealed, exc)
        except Exception:
            log.exception("leasing a slot with the seal of %s failed", sealed)
        return None

    async def _begin_write(self, shard: ShardId, size_bytes: int) -> Segment:
        if self._stop.is_set():
            raise Unavailable(f"checkpointd {self.node_id} is stopping; the snapshot is skipped")
        owner = (shard.job_id, shard.rank)
        # A free segment is the steady state: taken without leaving the event loop.
        segment = self.pool.begin_write(owner, size_bytes, may_create=False)
        if segment is None:
            segment = await asyncio.to_thread(self.pool.begin_write, owner, size_bytes)
        assert segment is not None
        return segment

    def seal_slot(self, shard: ShardId, generation: int, shm_name: str, size_bytes: int) -> None:
        """The rank wrote its slot: hold it as the newest local snapshot; checksum,
        replicate, report and flush it in the background."""
        owner = (shard.job_id, shard.rank)
        segment = self.pool.finish_write(owner, shm_name, size_bytes)
        try:
            read_layout(segment.view, size_bytes)
        except ShardFormatError as exc:
            self.pool.unref(segment)
            raise InvalidArgument(
                f"sealed slot {shm_name} holds no valid shard: {exc}; write the whole "
                "shard before sealing"
            ) from None
        record = ShardRecord(shard, generation, Tier.LOCAL, segment, size_bytes, self.node_id)
        self._hold(record)
        self.flusher.observe_seal(shard.job_id, shard.step)
        self._sealed.put_nowait(record)

    def other_sources(self) -> tuple[str, str]:
        """(catalog, buddy) host:port, each "" when unknown: where a rank of this node can
        still find its state should this daemon be gone."""
        buddy = self.catalog.known_buddy()
        return self.settings.scheduler, buddy.address if buddy else ""

    async def _trim_heap(self) -> None:
        while True:
            await asyncio.sleep(HEAP_TRIM_SECONDS)
            await asyncio.to_thread(trim)

    async def _checksum_sealed(self) -> None:
        while True:
            record = await self._sealed.get()
            if not self.store.holds(record):
                continue
            with self.pool.pinned(record.segment):
                if record.size <= _INLINE_CHECKSUM_BYTES:
                    checksum = shard_checksum(record.data())
                else:
                    checksum = await asyncio.to_thread(shard_checksum, record.data())
            if not self.store.holds(record):
                continue
            record.checksum = record.checksum or checksum
            self.catalog.shard_added(record.info(), Tier.LOCAL)
            self.replicator.submit(record)
            self.flusher.submit(record)

    # The buddy path.

    async def receive_replica(
        self,
        chunks: AsyncIterator[checkpoint_pb2.ShardChunk],
        admitted: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """Hold a shard a buddy pushes, once its checksum verifies. MemoryBudgetFull when
        there is no room; InvalidArgument when the stream or the checksum is wrong.
        `admitted(job_id)` raises when the pusher may not push that job's shards."""

        async def allocate(header: checkpoint_pb2.ShardHeader) -> Segment:
            if admitted is not None:
                await admitted(header.key.job_id)
            owner = (header.key.job_id, header.key.rank)
            return await asyncio.to_thread(self.pool.allocate, header.size_bytes, owner)

        header, segment = await receive_chunks(chunks, allocate, self.pool.unref)
        key = header.key
        record = ShardRecord(
            ShardId(key.job_id, key.rank, key.step),
            key.generation,
            Tier.REPLICA,
            segment,
            header.size_bytes,
            header.origin_node_id,
            checksum=header.checksum,
        )
        actual = await asyncio.to_thread(shard_checksum, record.data())
        if actual != header.checksum:
            self.pool.unref(segment)
            error = f"checksum {actual} of {record.shard} does not match {header.checksum}"
            log.warning("pushed shard refused: %s", error)
            raise InvalidArgument(f"{error}: the bytes changed on the way; push it again")
        self._keep_replica(record)

    async def is_member(self, job_id: str, node_id: str) -> bool:
        """Whether `node_id` runs a rank of the job now, per the scheduler: asked again
        when it was not (a replacement placed a moment ago) and when the answer is older
        than MEMBERS_FRESH_SECONDS (a node moved off the job loses access)."""
        known, asked_at = self.members.get(job_id, (set(), 0.0))
        if node_id in known and time.monotonic() - asked_at < MEMBERS_FRESH_SECONDS:
            return True
        members = await self.catalog.members(job_id)
        if members is None:
            raise Unavailable(
                f"cannot ask the scheduler whether node {node_id} runs job {job_id}; retry"
            )
        self.members[job_id] = (members, time.monotonic())
        return node_id in members

    async def pull_chunks(self, shard: ShardId) -> AsyncIterator[checkpoint_pb2.ShardChunk]:
        """The chunks of a shard held in memory (step 0: the newest); the puller
        verifies the checksum."""
        records = self.store.find(shard.job_id, shard.rank, shard.step)
        if not records:
            raise ShardNotFound(f"{shard} is not in the memory of node {self.node_id}")
        record = records[0]
        with self.pool.pinned(record.segment):
            if record.checksum is None:
                record.checksum = await asyncio.to_thread(shard_checksum, record.data())
            for chunk in shard_chunks(record.header(), record.data()):
                yield chunk

    # Restore and listing.

    async def restore(self, shard: ShardId) -> tuple[ShardRecord, Tier]:
        """A verified copy of the shard in this node's memory, and its source."""
        return await self.sources.restore(shard.job_id, shard.rank, shard.step)

    async def list_shards(self, job_id: str) -> list[checkpoint_pb2.ShardInfo]:
        """What this daemon holds in memory, and what the durable store offers."""
        infos = [r.info() for r in self.store.records(job_id)]
        try:
            jobs = [job_id] if job_id else await asyncio.to_thread(self.durable.job_ids)
            for job in jobs:
                entries = await asyncio.to_thread(self.durable.entries, job)
                infos += [durable_info(e) for e in entries]
        except (OSError, ValueError) as exc:
            log.warning("durable store %s not listed: %s", self.durable.url, exc)
        return infos

    def _keep_replica(self, record: ShardRecord) -> None:
        self._hold(record)
        self.catalog.shard_added(record.info(), Tier.REPLICA)

    def _hold(self, record: ShardRecord) -> None:
        # Without a scheduler no step is ever committed: keeping the snapshots that
        # await a commit would hold keep_in_memory + PENDING_COMMIT of them per rank
        # and take a fresh segment for every snapshot instead of reusing one.
        committed = self.catalog.last_committed(record.shard.job_id)
        for old in self.store.put(record, committed):
            if old.checksum is not None:
                self.catalog.shard_removed(old.shard, old.generation, old.tier)
            self.pool.unref(old.segment)


def forget_jobs(daemon: CheckpointDaemon, job_ids: list[str]) -> None:
    """The jobs ended (the scheduler says so): their snapshots and replicas here
    restore nothing any more, so their memory goes back to /dev/shm. Durable copies stay
    (the durable store prunes its own). Nothing else of them stays either (their step
    times, their members), however many jobs a fleet runs."""
    store, pool, catalog = daemon.store, daemon.pool, daemon.catalog
    for job_id in job_ids:
        daemon.flusher.forget(job_id)
        daemon.members.pop(job_id, None)
        records = store.records(job_id)
        for record in records:
            if store.remove(record):
                if record.checksum is not None:
                    catalog.shard_removed(record.shard, record.generation, record.tier)
                pool.unref(record.segment)
        freed = pool.forget_job(job_id)
        if records or freed:
            log.info(
                "job %s ended: dropped its %d snapshots and replicas, %d bytes freed",
                job_id,
                len(records),
                freed,
            )
