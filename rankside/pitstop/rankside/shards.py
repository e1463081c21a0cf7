"""What names a shard (one rank's state at one step of one job) and what checks it whole
(its checksum), for the checkpoint daemon, its durable store and the ranks that read it."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"


def shard_checksum(data: bytes | memoryview) -> str:
    """The checksum of a whole shard: xxh3_64, hex. Releases the GIL while it hashes."""
    return xxhash.xxh3_64(data).hexdigest()


@dataclass(frozen=True, order=True)
class ShardId:
    """One rank's state at one step of one job."""

    job_id: str
    rank: int
    step: int

    def __str__(self) -> str:
        return f"job {self.job_id} rank {self.rank} step {self.step}"
