"""Gang placement, hot-spare choice and elastic shrink: pure functions over a Topology.

Ranks fill nodes in rank order, ``gpus_per_node`` at a time, so a TP group (tp divides
gpus_per_node) never spans nodes and a pipeline's consecutive stages share a node
when tp < gpus_per_node. Nodes are chosen a *group* at a time: the fewest consecutive
nodes that hold whole pipelines (one dp replica, or several when a node holds more
than one). Each group packs into as few racks as it can; successive groups go to
different racks round-robin, so a replica and the next one (its snapshot buddy)
rarely share a rack.

Everything is node-granular: a 100,000-rank gang costs one pass over the racks plus
one RankSlot per rank.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from pitstop.scheduler.topology import (
    NodeInfo,
    Placement,
    RackKey,
    RankSlot,
    Topology,
    rank_coordinates,
    rank_of,
)

__all__ = [
    "GangRequest",
    "NodeInfo",
    "Placement",
    "RankSlot",
    "Topology",
    "choose_replacement",
    "place_gang",
    "place_pending",
    "rank_coordinates",
    "rank_of",
    "replace_node",
    "shrink_by_one_replica",
]


@dataclass(frozen=True)
class GangRequest:
    """One job asking for all its ranks at once. Higher ``priority`` places first;
    among equals the lower ``sequence`` (the older request) does."""

    job_id: str
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    priority: int = 0
    sequence: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"job {self.job_id}: {name} = {getattr(self, name)}; use >= 1")
        if self.gpus_per_node % self.tp:
            raise ValueError(
                f"job {self.job_id}: tp = {self.tp} does not divide gpus_per_node = "
                f"{self.gpus_per_node}; a TP group must stay inside one node"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def node_count(self) -> int:
        """Nodes the gang uses; the last holds the remainder when the world size is
        not a multiple of gpus_per_node (still whole TP groups: tp divides both)."""
        return -(-self.world_size // self.gpus_per_node)

    @property
    def gpus_needed(self) -> int:
        """Free GPUs a node must have to take part (less than a node for a tiny gang)."""
        return min(self.gpus_per_node, self.world_size)


class _Rack:
    """A rack's eligible nodes for one placement, consumed front to back."""

    __slots__ = ("key", "nodes", "remaining")

    def __init__(self, key: RackKey, nodes: list[str]) -> None:
        self.key = key
        self.nodes = nodes
        self.remaining = len(nodes)

    def take(self, count: int) -> list[str]:
        start = len(self.nodes) - self.remaining
        self.remaining -= count
        return self.nodes[start : start + count]


class _Pool:
    """Racks of one domain bucketed by how many eligible nodes they have left, so taking
    a group costs O(log racks) however many racks the domain has."""

    __slots__ = ("buckets", "sizes", "total")

    def __init__(self, racks: Iterable[_Rack]) -> None:
        self.buckets: defaultdict[int, deque[_Rack]] = defaultdict(deque)
        for rack in racks:  # in interleaved order, so equal racks are taken in that order
            if rack.remaining:
                self.buckets[rack.remaining].append(rack)
        self.sizes = sorted(self.buckets)
        self.total = sum(size * len(racks) for size, racks in self.buckets.items())

    def take(self, count: int) -> list[str]:
        """``count`` nodes from as few racks as a greedy pass finds: the smallest rack
        that covers what is left (keeping bigger racks whole for later groups), else
        the largest rack entirely. The caller checks ``total`` first."""
        chosen: list[str] = []
        self.total -= count
        while count:
            at = bisect.bisect_left(self.sizes, count)
            size = self.sizes[min(at, len(self.sizes) - 1)]
            bucket = self.buckets[size]
            rack = bucket.popleft()
            if not bucket:
                self.sizes.remove(size)
            part = min(size, count)
            chosen += rack.take(part)
            count -= part
            if rack.remaining:
                if not self.buckets[rack.remaining]:
                    bisect.insort(self.sizes, rack.remaining)
                self.buckets[rack.remaining].append(rack)
        return chosen


def _rounds(pools: Iterable[_Pool], sizes: list[int], groups: list[list[str]]) -> None:
    """Round-robin over ``pools``, one group from each pool with room per turn, until
    every size in ``sizes`` is placed or no pool has room for the next one."""
    live = list(pools)
    while len(groups) < len(sizes):
        progressed = False
        for pool in live:
            if len(groups) == len(sizes):
                return
            size = sizes[len(groups)]
            if pool.total >= size:
                groups.append(pool.take(size))
                progressed = True
        if not progressed:
            return


def _positions(racks: Sequence[_Rack]) -> dict[RackKey, tuple[int, int, int]]:
    """Each rack's (place in its block, block's place in its zone, zone's place), each
    counted fewest free nodes first (best fit: fill fragments, keep roomy domains whole).

    Sorting racks by this key interleaves them: consecutive racks sit in different
    zones, then different blocks, which is what spreads replicas over failure domains.
    """
    rack_free = {r.key: r.remaining for r in racks}
    block_free: defaultdict[tuple[str, str], int] = defaultdict(int)
    zone_free: defaultdict[str, int] = defaultdict(int)
    for (zone, block, _), free in rack_free.items():
        block_free[(zone, block)] += free
        zone_free[zone] += free
    zone_pos = {z: i for i, z in enumerate(sorted(zone_free, key=lambda z: (zone_free[z], z)))}
    block_pos: dict[tuple[str, str], int] = {}
    for zone in zone_free:
        blocks = sorted((b for b in block_free if b[0] == zone), key=lambda b: (block_free[b], b))
        block_pos.update((b, i) for i, b in enumerate(blocks))
    by_block: defaultdict[tuple[str, str], list[RackKey]] = defaultdict(list)
    for key in sorted(rack_free, key=lambda k: (rack_free[k], k)):
        by_block[key[:2]].append(key)
    return {
        key: (i, block_pos[block], zone_pos[block[0]])
        for block, keys in by_block.items()
        for i, key in enumerate(keys)
    }


def _choose_scope(racks: list[_Rack], nodes: int, group: int, groups: int) -> list[_Rack] | None:
    """The racks of the tightest domain that holds the gang: first one where every group
    fits inside a rack, then a block before a zone before the fleet, then the fullest
    (best fit). Staying inside a block or zone keeps data-parallel traffic off the
    spine and leaves big domains whole for big gangs; spreading over racks inside it
    is enough to keep a replica apart from its buddy."""
    domains: defaultdict[tuple[int, str, str], list[_Rack]] = defaultdict(list)
    for rack in racks:
        zone, block, _ = rack.key
        domains[(0, zone, block)].append(rack)
        domains[(1, zone, "")].append(rack)
        domains[(2, "", "")].append(rack)
    best: tuple[bool, int, int, str, str] | None = None
    chosen: list[_Rack] | None = None
    for (level, zone, block), members in domains.items():
        free = sum(r.remaining for r in members)
        if free < nodes:
            continue
        whole = sum(r.remaining // group for r in members) >= groups
        rank = (not whole, level, free, zone, block)
        if best is None or rank < best:
            best, chosen = rank, members
    return chosen


def place_gang(topology: Topology, request: GangRequest) -> Placement | None:
    """Place every rank of ``request`` or nothing; books nothing (see ``Topology.book``).

    Only READY worker nodes with at least ``request.gpus_needed`` free GPUs take part;
    each gets one chunk of ``gpus_per_node`` consecutive ranks on its lowest free GPUs.
    Returns None when fewer such nodes exist than the gang needs.
    """
    need = request.gpus_needed
    racks = [
        _Rack(key, eligible)
        for key, ids in topology.worker_racks().items()
        if (eligible := [n for n in ids if topology.free_count(n) >= need])
    ]
    node_count = request.node_count
    # The fewest consecutive nodes that hold whole pipelines: one replica's nodes when a
    # replica fills whole nodes, one node holding several replicas, or in between.
    group = math.lcm(request.pp * request.tp, request.gpus_per_node) // request.gpus_per_node
    count = -(-node_count // group)
    sizes = [group] * (count - 1) + [node_count - (count - 1) * group]
    scope = _choose_scope(racks, node_count, group, count)
    if scope is None:
        return None
    position = _positions(scope)
    scope.sort(key=lambda r: position[r.key])
    groups: list[list[str]] = []
    # Each group inside one rack if it can, else one block, else one zone, else anywhere;
    # at every level the groups go round-robin over the domains.
    _rounds((_Pool([r]) for r in scope if r.remaining >= group), sizes, groups)
    for level in (2, 1):
        domains: dict[tuple[str, ...], list[_Rack]] = {}
        for rack in scope:  # already interleaved, so the domains come out interleaved too
            domains.setdefault(rack.key[:level], []).append(rack)
        _rounds(map(_Pool, domains.values()), sizes, groups)
    _rounds([_Pool(scope)], sizes, groups)
    if len(groups) != len(sizes):
        raise AssertionError("placement: the chosen scope had the nodes but they were not used")
    return Placement(_rank_slots(topology, itertools.chain.from_iterable(groups), request))


def _rank_slots(
    topology: Topology, nodes: Iterable[str], request: GangRequest
) -> tuple[RankSlot, ...]:
    world = request.world_size
    per_node = request.gpus_per_node
    coords = itertools.product(range(request.dp), range(request.pp), range(request.tp))
    slots: list[RankSlot] = []
    rank = 0
    for node_id in nodes:
        gpus = topology.free_gpus(node_id)
        for local, (dp_i, pp_i, tp_i) in zip(
            range(min(per_node, world - rank)), coords, strict=False
        ):
            slots.append(RankSlot(rank + local, node_id, gpus[local], local, dp_i, pp_i, tp_i))
        rank += per_node
    return tuple(slots)


def place_pending(topology: Topology, requests: Sequence[GangRequest]) -> dict[str, Placement]:
    """Place ``requests`` highest priority first (ties: lowest sequence), booking each
    placed gang before the next. A gang that does not fit is skipped whole and smaller
    ones behind it may still fit. Returns the placed gangs by job id."""
    seen: set[str] = set()
    for request in requests:
        if request.job_id in seen:
            raise ValueError(f"job {request.job_id} is requested twice; pass each job once")
        seen.add(request.job_id)
    placed: dict[str, Placement] = {}
    for request in sorted(requests, key=lambda r: (-r.priority, r.sequence, r.job_id)):
        placement = place_gang(topology, request)
        if placement is not None:
            topology.book(placement)
            placed[request.job_id] = placement
    return placed


def _distance(failed: NodeInfo, spare: NodeInfo) -> int:
    if spare.zone != failed.zone:
        return 3
    if spare.block != failed.block:
        return 2
    return 0 if spare.rack == failed.rack else 1


def choose_replacement(
    topology: Topology,
    failed: NodeInfo,
    gpus_needed: int,
    prefer: Collection[str] = (),
    ready: Collection[str] = (),
) -> str | None:
    """The nearest READY spare with ``gpus_needed`` free GPUs: same rack, then same block,
    then same zone, then any; ties by node id. A spare in ``prefer`` (one holding the
    job's standby processes: it resumes in a fraction of a cold start) comes before any
    other, and one in ``ready`` (its standby done importing, waiting for a rank: it
    resumes at once) before those. None when no spare qualifies."""
    best: tuple[bool, bool, int, str] | None = None
    for node_id in topology.ready_spares():
        if node_id == failed.node_id or topology.free_count(node_id) < gpus_needed:
            continue
        candidate = (
            node_id not in ready,
            node_id not in prefer,
            _distance(failed, topology.node(node_id)),
            node_id,
        )
        if best is None or candidate < best:
            best = candidate
    return None if best is None else best[3]


def standby_spares(
    topology: Topology, placement: Placement, count: int
) -> dict[str, tuple[int, ...]]:
    """Where a job's standby processes wait: the spares its nodes would be replaced by
    (`choose_replacement`), the most often chosen first, then the other READY spares by
    id; at most `count` of them, each with the GPUs a replacement would take there."""
    needed = max((len(placement.ranks_on(n)) for n in placement.nodes()), default=0)
    if count <= 0 or needed == 0:
        return {}
    votes: dict[str, int] = {}
    for node_id in placement.nodes():
        if node_id not in topology.nodes:
            continue
        spare = choose_replacement(topology, topology.node(node_id), needed)
        if spare is not None:
            votes[spare] = votes.get(spare, 0) + 1
    chosen = sorted(votes, key=lambda n: (-votes[n], n))
    chosen += [
        n
        for n in topology.ready_spares()
        if n not in votes and not placement.hosts(n) and topology.free_count(n) >= needed
    ]
    return {n: topology.free_gpus(n)[:needed] for n in chosen[:count]}


def replace_node(
    placement: Placement, failed_node_id: str, spare_node_id: str, topology: Topology
) -> Placement:
    """Move exactly the ranks on ``failed_node_id`` to ``spare_node_id``: same ranks,
    local ranks and coordinates, on the spare's lowest free GPUs. Books nothing."""
    moved = placement.ranks_on(failed_node_id)
    if not moved:
        raise ValueError(f"node {failed_node_id!r} hosts no rank of this placement")
    if placement.hosts(spare_node_id):
        raise ValueError(f"spare {spare_node_id!r} already hosts ranks of this placement")
    gpus = topology.free_gpus(spare_node_id)
    if len(gpus) < len(moved):
        raise ValueError(
            f"spare {spare_node_id!r} has {len(gpus)} free GPUs, {len(moved)} are needed; "
            "choose another spare"
        )
    ranks = list(placement.ranks)
    for slot in moved:
        ranks[slot.rank] = RankSlot(
            slot.rank,
            spare_node_id,
            gpus[slot.local_rank],
            slot.local_rank,
            slot.dp,
            slot.pp,
            slot.tp,
        )
    return Placement(tuple(ranks))


def shrink_by_one_replica(
    placement: Placement, failed_node_id: str, tp: int, pp: int
) -> Placement | None:
    """Drop the data-parallel replica that lost ``failed_node_id`` and renumber densely:
    replicas after it move down one dp index, so the world becomes tp*pp*(dp-1).

    Every other rank keeps its node, GPU and local rank. Returns None when one replica
    is not enough or would leave the rest broken: the failed node hosts ranks of more
    than one replica, a node of the dropped replica also hosts another one, or it is
    the only replica. The caller checks the job's min_dp.
    """
    lost = placement.ranks_on(failed_node_id)
    if not lost:
        raise ValueError(f"node {failed_node_id!r} hosts no rank of this placement")
    per_replica = tp * pp
    if placement.world_size % per_replica:
        raise ValueError(
            f"world size {placement.world_size} is not a multiple of tp*pp = {per_replica}"
        )
    replicas = {slot.dp for slot in lost}
    if len(replicas) > 1 or placement.world_size == per_replica:
        return None
    (dropped,) = replicas
    start, end = dropped * per_replica, (dropped + 1) * per_replica
    nodes = {slot.node_id for slot in placement.ranks[start:end]}
    before = placement.ranks[start - 1] if start else None
    after = placement.ranks[end] if end < placement.world_size else None
    # Ranks fill nodes in order, so only the neighbours at the edges can share a node.
    if (before and before.node_id in nodes) or (after and after.node_id in nodes):
        return None
    survivors = list(placement.ranks[:start])
    for slot in placement.ranks[end:]:
        survivors.append(
            RankSlot(
                slot.rank - per_replica,
                slot.node_id,
                slot.gpu_index,
                slot.local_rank,
                slot.dp - 1,
                slot.pp,
                slot.tp,
            )
        )
    return Placement(tuple(survivors))
