"""The in-memory shard store: which shards this daemon holds, in which segment, with
which checksum, in two tiers (LOCAL: written by a rank on this node; REPLICA: pushed by
a buddy or pulled for a restore), keeping the newest K per (job, rank, tier).

The store only keeps books; the daemon owns the segments and gives back the ones an
eviction returns. All of it runs on the daemon's event loop.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pitstop.checkpointd.slots import Segment
from pitstop.rankside.shards import CHECKSUM_ALGORITHM, ShardId, shard_checksum
from pitstop.v1 import checkpoint_pb2


class Tier(enum.IntEnum):
    """Where a shard sits; the values are the wire's ShardTier."""

    LOCAL = checkpoint_pb2.SHARD_TIER_LOCAL
    REPLICA = checkpoint_pb2.SHARD_TIER_REPLICA
    DURABLE = checkpoint_pb2.SHARD_TIER_DURABLE


@dataclass(eq=False)
class ShardRecord:
    """One shard held in memory. `checksum` is None until computed after the seal."""

    shard: ShardId
    generation: int
    tier: Tier
    segment: Segment
    size: int
    origin_node_id: str
    checksum: str | None = None
    created: float = field(default_factory=time.time)

    def data(self) -> memoryview:
        """The shard's bytes, in place."""
        return self.segment.view[: self.size]

    def verify(self) -> bool:
        """Whether the bytes still match the checksum (computing it if there is none)."""
        actual = shard_checksum(self.data())
        if self.checksum is None:
            self.checksum = actual
        return actual == self.checksum

    def header(self) -> checkpoint_pb2.ShardHeader:
        """The wire header of this shard."""
        return checkpoint_pb2.ShardHeader(
            key=checkpoint_pb2.ShardKey(
                job_id=self.shard.job_id,
                rank=self.shard.rank,
                step=self.shard.step,
                generation=self.generation,
            ),
            size_bytes=self.size,
            checksum=self.checksum or "",
            checksum_algorithm=CHECKSUM_ALGORITHM,
            origin_node_id=self.origin_node_id,
        )

    def info(self) -> checkpoint_pb2.ShardInfo:
        """The wire description of this shard."""
        info = checkpoint_pb2.ShardInfo(header=self.header(), tier=self.tier.value)
        info.time.FromNanoseconds(int(self.created * 1e9))
        return info


PENDING_COMMIT = 16
"""Snapshots newer than the committed step kept beyond `keep` while they await commit."""


class ShardStore:
    """The shards in memory, newest `keep` per (job, rank, tier)."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep_in_memory {keep}: must be at least 1")
        self.keep = keep
        self._records: dict[tuple[ShardId, Tier], ShardRecord] = {}

    def put(self, record: ShardRecord, committed: int | None = None) -> list[ShardRecord]:
        """Hold `record`; return what it displaced (the same shard and tier held before,
        and anything beyond the newest `keep`). A record older than the `keep` newest is
        itself returned.

        Beyond the `keep` newest, the newest record at or below `committed` (the job's
        committed step as last heard: what a recovery restores) is kept, and so is
        every record above it, up to `keep + PENDING_COMMIT` in all: the committed step
        trails the newest by the time replication and reporting take, and one of those
        steps is what the scheduler will have committed by the time a node fails.
        `committed` None (no scheduler to commit steps): just the `keep` newest."""
        evicted = []
        previous = self._records.pop((record.shard, record.tier), None)
        if previous is not None:
            evicted.append(previous)
        self._records[(record.shard, record.tier)] = record
        same = sorted(
            (
                r
                for r in self._records.values()
                if r.tier == record.tier
                and (r.shard.job_id, r.shard.rank) == (record.shard.job_id, record.shard.rank)
            ),
            key=lambda r: r.shard.step,
            reverse=True,
        )
        # A newer generation rolled back: what an older one wrote past its step is a
        # timeline that no longer exists.
        stale = [
            r for r in same if r.generation < record.generation and r.shard.step > record.shard.step
        ]
        same = [r for r in same if r not in stale]
        restore_point, pending = None, []
        if committed is not None:
            restore_point = next((r for r in same if r.shard.step <= committed), None)
            pending = [r for r in same if r.shard.step > committed][: self.keep + PENDING_COMMIT]
        wanted = {id(r) for r in [*same[: self.keep], *pending, restore_point] if r is not None}
        for old in stale + [r for r in same if id(r) not in wanted]:
            del self._records[(old.shard, old.tier)]
            evicted.append(old)
        return evicted

    def remove(self, record: ShardRecord) -> bool:
        """Stop holding `record`; whether it was held."""
        if self._records.get((record.shard, record.tier)) is record:
            del self._records[(record.shard, record.tier)]
            return True
        return False

    def holds(self, record: ShardRecord) -> bool:
        """Whether `record` is still held (not evicted or replaced)."""
        return self._records.get((record.shard, record.tier)) is record

    def find(self, job_id: str, rank: int, step: int = 0) -> list[ShardRecord]:
        """Records of (job, rank) at `step` (0: the newest step held), LOCAL first."""
        candidates = [
            r for r in self._records.values() if (r.shard.job_id, r.shard.rank) == (job_id, rank)
        ]
        if step == 0 and candidates:
            step = max(r.shard.step for r in candidates)
        return sorted((r for r in candidates if r.shard.step == step), key=lambda r: r.tier)

    def records(self, job_id: str = "") -> list[ShardRecord]:
        """Every record, or `job_id`'s, in (job, rank, step, tier) order."""
        return sorted(
            (r for r in self._records.values() if not job_id or r.shard.job_id == job_id),
            key=lambda r: (r.shard, r.tier),
        )

    def newest_step(self, job_id: str, rank: int) -> int:
        """The newest step held for (job, rank); 0 if none."""
        return max((r.shard.step for r in self.find(job_id, rank)), default=0)
