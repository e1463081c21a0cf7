"""A rank's way to its state when its own checkpointd cannot serve it: ask the catalog
(the scheduler's GetRestorePoint) which nodes hold the shard, and pull it from one of
them over PullShard, checksum verified, into the rank's own memory.

The rank's side, so synchronous gRPC and nothing the daemon needs (no event loop, no
torch, xxhash only when a shard is verified).
"""

from __future__ import annotations

import hashlib

from pitstop.common.tls import NodeIdentity, open_channel
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

PULL_TIMEOUT_SECONDS = 600.0
"""Longest a pull of one shard may take: tens of GB at LAN speed, and a hung holder is
given up on."""
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 << 20)]
"""A chunk is 4 MiB of data plus its header: above gRPC's default 4 MiB limit."""

Metadata = tuple[tuple[str, str], ...] | None


class PulledShardError(Exception):
    """A holder's copy did not arrive whole, or fails its checksum."""


def catalog_holders(
    catalog_address: str,
    job_id: str,
    rank: int,
    step: int,
    *,
    timeout: float,
    metadata: Metadata = None,
    identity: NodeIdentity | None = None,
) -> tuple[int, list[str]]:
    """The step (`step`, or the committed one for 0) and host:port of the checkpoint
    daemons the catalog says hold the rank's shard of it. Raises grpc.RpcError."""
    with open_channel(catalog_address, identity, to_scheduler=True) as channel:
        response = checkpoint_pb2_grpc.CheckpointCatalogServiceStub(channel).GetRestorePoint(
            checkpoint_pb2.GetRestorePointRequest(job_id=job_id, step=step),
            timeout=timeout,
            metadata=metadata,
        )
    if rank not in response.locations:
        return step or int(response.committed_step), []
    addresses = [a for a in response.locations[rank].addresses if a]
    return step or int(response.committed_step), addresses


def pull_shard(
    address: str,
    key: checkpoint_pb2.ShardKey,
    *,
    timeout: float = PULL_TIMEOUT_SECONDS,
    metadata: Metadata = None,
    identity: NodeIdentity | None = None,
) -> tuple[checkpoint_pb2.ShardHeader, bytearray]:
    """The shard `key` (step 0: the newest the daemon holds) from the daemon at
    `address`, its checksum verified. Raises grpc.RpcError or PulledShardError."""
    header: checkpoint_pb2.ShardHeader | None = None
    data = bytearray()
    received = 0
    with open_channel(address, identity, options=CHANNEL_OPTIONS) as channel:
        chunks = checkpoint_pb2_grpc.CheckpointServiceStub(channel).PullShard(
            checkpoint_pb2.PullShardRequest(key=key), timeout=timeout, metadata=metadata
        )
        for chunk in chunks:
            if header is None:
                if not chunk.HasField("header"):
                    raise PulledShardError(f"{address}: the first chunk carries no header")
                header = chunk.header
                data = bytearray(header.size_bytes)
            end = chunk.offset + len(chunk.data)
            if chunk.offset != received or end > header.size_bytes:
                raise PulledShardError(
                    f"{address}: chunk at {chunk.offset}+{len(chunk.data)} does not follow "
                    f"byte {received} of a {header.size_bytes}-byte shard"
                )
            data[chunk.offset : end] = chunk.data
            received = end
    if header is None or received != header.size_bytes:
        size = header.size_bytes if header is not None else "?"
        raise PulledShardError(f"{address}: the stream ended at byte {received} of {size}")
    actual = _checksum(header.checksum_algorithm, data)
    if actual != header.checksum:
        raise PulledShardError(
            f"{address}: the copy's checksum {actual} does not match {header.checksum}"
        )
    return header, data


def _checksum(algorithm: str, data: bytearray) -> str:
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    import xxhash  # the checkpointd extra; only a rank that pulls needs it

    return xxhash.xxh3_64(data).hexdigest()
