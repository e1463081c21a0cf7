"""Restore: serve (job, rank, step) from local memory, else the buddy's memory, else the
memory of another node the scheduler says holds it, else the durable store, every copy's
checksum verified before it is offered. A copy that fails its checksum is reported,
dropped, and the next source is tried."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pitstop.checkpointd.catalog import CatalogClient
from pitstop.checkpointd.errors import NotFound
from pitstop.checkpointd.replication import Replicator, ShardStreamError, receive_chunks
from pitstop.checkpointd.slots import Segment, SlotPool
from pitstop.checkpointd.store import ShardRecord, ShardStore, Tier
from pitstop.rankside.durable import DurableStore
from pitstop.rankside.shards import ShardId, shard_checksum
from pitstop.v1 import checkpoint_pb2

log = logging.getLogger(__name__)


class ShardNotFound(NotFound):
    """No source holds a good copy of the shard."""


class RestoreSources:
    """The three sources of a restore, in order."""

    def __init__(
        self,
        node_id: str,
        store: ShardStore,
        pool: SlotPool,
        catalog: CatalogClient,
        replicator: Replicator,
        durable: DurableStore,
        keep: Callable[[ShardRecord], None],
    ) -> None:
        self.node_id = node_id
        self._store = store
        self._pool = pool
        self._catalog = catalog
        self._replicator = replicator
        self._durable = durable
        self._keep = keep
        self.corrupted_shards = 0

    async def restore(self, job_id: str, rank: int, step: int) -> tuple[ShardRecord, Tier]:
        """A verified in-memory copy of the shard on this node and where it came from.
        Step 0: the job's committed step per the scheduler, else the newest anywhere."""
        if step == 0:
            step = await self._newest_step(job_id, rank)
            if step == 0:
                raise ShardNotFound(f"no shard of job {job_id} rank {rank} anywhere")
        for record in self._store.find(job_id, rank, step):
            if await self._verified(record):
                return record, record.tier
        buddy = await self._catalog.buddy()
        if buddy is not None:
            pulled = await self._from_peer(buddy.address, job_id, rank, step)
            if pulled is not None:
                return pulled, Tier.REPLICA
        # A replacement node's buddy need not be the lost node's: ask the scheduler
        # which nodes hold this shard and pull from them.
        for address in await self._catalog.holders(job_id, rank, step):
            if buddy is not None and address == buddy.address:
                continue
            pulled = await self._from_peer(address, job_id, rank, step)
            if pulled is not None:
                return pulled, Tier.REPLICA
        read = await self._from_durable(job_id, rank, step)
        if read is not None:
            return read, Tier.DURABLE
        where = f"the buddy {buddy.address}" if buddy else "no buddy"
        raise ShardNotFound(
            f"no good copy of job {job_id} rank {rank} step {step}: not in this node's "
            f"memory, {where}, nor {self._durable.url}"
        )

    async def _verified(self, record: ShardRecord) -> bool:
        with self._pool.pinned(record.segment):
            if await asyncio.to_thread(record.verify):
                return True
        self.corrupted_shards += 1
        log.error(
            "shard %s (%s) fails its checksum: dropped, trying the next source",
            record.shard,
            record.tier.name,
        )
        if self._store.remove(record):
            self._catalog.shard_removed(record.shard, record.generation, record.tier)
            self._pool.unref(record.segment)
        return False

    async def _from_peer(
        self, address: str, job_id: str, rank: int, step: int
    ) -> ShardRecord | None:
        stub = self._replicator.stub(address)
        key = checkpoint_pb2.ShardKey(job_id=job_id, rank=rank, step=step)

        async def allocate(header: checkpoint_pb2.ShardHeader) -> Segment:
            return await asyncio.to_thread(self._pool.allocate, header.size_bytes, (job_id, rank))

        call = stub.PullShard(
            checkpoint_pb2.PullShardRequest(key=key), metadata=self._replicator.metadata
        )
        try:
            header, segment = await receive_chunks(call, allocate, self._pool.unref)
        except (grpc.aio.AioRpcError, ShardStreamError) as exc:
            log.info(
                "pull of %s rank %d step %d from %s failed: %s",
                job_id,
                rank,
                step,
                address,
                _describe(exc),
            )
            return None
        finally:
            call.cancel()
        record = ShardRecord(
            ShardId(job_id, rank, header.key.step),
            header.key.generation,
            Tier.REPLICA,
            segment,
            header.size_bytes,
            header.origin_node_id,
            checksum=header.checksum,
        )
        return await self._adopt(record, f"the buddy {address}")

    async def _from_durable(self, job_id: str, rank: int, step: int) -> ShardRecord | None:
        try:
            entry = await asyncio.to_thread(self._durable.find, job_id, rank, step)
            if entry is None:
                return None
            segment = await asyncio.to_thread(self._pool.allocate, entry.size, (job_id, rank))
        except OSError as exc:
            log.warning("durable store %s unreadable: %s", self._durable.url, exc)
            return None
        try:
            await asyncio.to_thread(self._durable.read_into, entry, segment.view)
        except OSError as exc:
            log.warning("durable shard %s unreadable: %s", entry.path, exc)
            self._pool.unref(segment)
            return None
        record = ShardRecord(
            entry.shard,
            entry.generation,
            Tier.REPLICA,
            segment,
            entry.size,
            entry.node_id,
            checksum=entry.checksum,
        )
        return await self._adopt(record, f"durable {entry.path}")

    async def _adopt(self, record: ShardRecord, source: str) -> ShardRecord | None:
        actual = await asyncio.to_thread(shard_checksum, record.data())
        if actual != record.checksum:
            self.corrupted_shards += 1
            log.error(
                "copy of %s from %s fails its checksum (%s, expected %s): skipped",
                record.shard,
                source,
                actual,
                record.checksum,
            )
            self._pool.unref(record.segment)
            return None
        self._keep(record)
        return record

    async def _newest_step(self, job_id: str, rank: int) -> int:
        committed = await self._catalog.committed_step(job_id)
        if committed:
            return committed
        steps = [self._store.newest_step(job_id, rank)]
        buddy = await self._catalog.buddy()
        if buddy is not None:
            try:
                listed = await self._replicator.stub(buddy.address).ListShards(
                    checkpoint_pb2.ListShardsRequest(job_id=job_id),
                    metadata=self._replicator.metadata,
                    timeout=10.0,
                )
                steps += [
                    s.header.key.step
                    for s in listed.shards
                    if s.header.key.rank == rank and s.tier != checkpoint_pb2.SHARD_TIER_DURABLE
                ]
            except grpc.aio.AioRpcError as exc:
                log.info("buddy %s unreachable for ListShards: %s", buddy.address, exc.code().name)
        try:
            entry = await asyncio.to_thread(self._durable.find, job_id, rank, 0)
            steps.append(entry.shard.step if entry else 0)
        except OSError as exc:
            log.warning("durable store %s unreadable: %s", self._durable.url, exc)
        return max(steps)


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details()}"
    return str(exc)
