"""A restore's other half: the shard decoded into tensors, and, when the local checkpoint
daemon cannot serve it (unreachable, or its segment vanished), the shard pulled from
another holder: the local daemon itself when it still answers (it has the bytes
mapped), those the catalog names, the buddy (peers.py does the pulling).

`SnapshotWriter.restore` (writer.py) is the way in; this module holds what it returns
and what it raises.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from pitstop.common.tls import NodeIdentity
from pitstop.rankside.format import ShardLayout, read_layout
from pitstop.rankside.peers import Metadata, PulledShardError, catalog_holders, pull_shard
from pitstop.rankside.tensorcopy import read_tensor
from pitstop.v1 import checkpoint_pb2

log = logging.getLogger(__name__)

SOURCES = {
    checkpoint_pb2.SHARD_TIER_LOCAL: "local",
    checkpoint_pb2.SHARD_TIER_REPLICA: "replica",
    checkpoint_pb2.SHARD_TIER_DURABLE: "durable",
}
"""The words a RestoredState's `source` uses for the daemon's tiers."""


class ShardUnavailable(Exception):
    """Neither the local daemon nor any other holder could give the shard back."""


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


@dataclass(frozen=True)
class Holders:
    """Where a restore that the local daemon cannot serve looks, and how it calls."""

    job_id: str
    address: str
    """The local daemon's host:port."""
    local_answers: bool
    """Whether the local daemon answers (it may still serve the bytes by PullShard)."""
    catalog_address: str
    buddy_address: str
    timeout: float
    metadata: Metadata
    identity: NodeIdentity | None


def restore_elsewhere(
    holders: Holders,
    step: int,
    into: Mapping[str, Any] | None,
    reason: str,
    rank: int,
) -> RestoredState:
    """Pull the shard from another holder: the local daemon itself when it answers
    (it still has the bytes mapped), those the catalog names, the buddy."""
    log.warning("rank %d: %s; restoring step %d from another holder", rank, reason, step)
    candidates = [holders.address] if holders.local_answers else []
    if holders.catalog_address:
        try:
            step, named = catalog_holders(
                holders.catalog_address,
                holders.job_id,
                rank,
                step,
                timeout=holders.timeout,
                metadata=holders.metadata,
                identity=holders.identity,
            )
            candidates += named
        except grpc.RpcError as exc:
            log.warning("catalog %s unreachable: %s", holders.catalog_address, said(exc))
    candidates.append(holders.buddy_address)
    key = checkpoint_pb2.ShardKey(job_id=holders.job_id, rank=rank, step=step)
    tried = []
    for address in dict.fromkeys(candidates):
        if not address or (address == holders.address and not holders.local_answers):
            continue
        try:
            header, data = pull_shard(
                address, key, metadata=holders.metadata, identity=holders.identity
            )
        except (grpc.RpcError, PulledShardError) as exc:
            log.warning(
                "rank %d: pull of step %d from %s failed: %s",
                rank,
                step,
                address,
                said(exc),
            )
            tried.append(address)
            continue
        source = "local" if address == holders.address else "replica"
        log.info("rank %d: step %d pulled from %s", rank, header.key.step, address)
        return decoded(header, memoryview(data), source, into)
    raise ShardUnavailable(
        f"rank {rank} of job {holders.job_id} cannot restore step {step}: {reason}, and "
        f"no other holder served it (tried: {', '.join(tried) or 'none known'}; catalog: "
        f"{holders.catalog_address or 'unknown'}). Restart this node's checkpointd, or set "
        "PITSTOP_SCHEDULER so the rank can ask the catalog who holds it"
    )


def decoded(
    header: checkpoint_pb2.ShardHeader,
    view: memoryview,
    source: str,
    into: Mapping[str, Any] | None,
) -> RestoredState:
    """The shard in `view` as tensors (copied into `into`'s where the shapes agree)."""
    layout: ShardLayout = read_layout(view, header.size_bytes)
    tensors = {e.name: read_tensor(view, layout, e.name, into) for e in layout.entries}
    return RestoredState(
        header.key.step,
        header.key.generation,
        tensors,
        dict(layout.metadata),
        source,
        header.checksum,
    )


def said(exc: BaseException) -> str:
    """What went wrong, in a few words, for the log."""
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name} {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
