"""The fleet as placement sees it, and the rank maps placement produces.

Pure data: the caller reads nodes, GPUs and live rank assignments from PostgreSQL,
builds a Topology for one decision and writes the resulting Placement back as
rank_assignments rows. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pitstop.scheduler.domain import NodeRole, NodeState

RackKey = tuple[str, str, str]
"""(zone, block, rack): rack labels are only unique inside their block."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node's labels, role, state and the GPU indexes it has."""

    node_id: str
    zone: str
    block: str
    rack: str
    role: str
    state: str
    gpu_indexes: tuple[int, ...]
    nvlink_domain: str = ""

    @property
    def rack_key(self) -> RackKey:
        return (self.zone, self.block, self.rack)


@dataclass(frozen=True, slots=True)
class RankSlot:
    """Where one rank runs and its (dp, pp, tp) coordinates; one rank_assignments row."""

    rank: int
    node_id: str
    gpu_index: int
    local_rank: int
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Placement:
    """A job's whole rank map. ``ranks[i].rank == i``: ordered by rank, dense from 0.

    Immutable; its index by node, its shape and its digest are worked out once, on first
    use (a map is 100,000 ranks on 12,500 nodes at full scale: a scan per node asked
    about is quadratic)."""

    ranks: tuple[RankSlot, ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @cached_property
    def _by_node(self) -> dict[str, tuple[RankSlot, ...]]:
        grouped: dict[str, list[RankSlot]] = {}
        for slot in self.ranks:
            grouped.setdefault(slot.node_id, []).append(slot)
        return {node_id: tuple(slots) for node_id, slots in grouped.items()}

    @cached_property
    def _nodes(self) -> tuple[str, ...]:
        return tuple(self._by_node)

    def nodes(self) -> tuple[str, ...]:
        """The nodes used, in rank order (the first rank on each decides its position)."""
        return self._nodes

    def hosts(self, node_id: str) -> bool:
        """Whether ``node_id`` runs a rank of this map."""
        return node_id in self._by_node

    def first_rank(self, node_id: str) -> int:
        """The lowest rank on ``node_id`` (a sort key: the nodes in rank order)."""
        return self._by_node[node_id][0].rank

    def ranks_on(self, node_id: str) -> tuple[RankSlot, ...]:
        """The ranks on ``node_id``, in rank order; empty if it hosts none."""
        return self._by_node.get(node_id, ())

    @cached_property
    def shape(self) -> tuple[int, int, int]:
        """(dp, pp, tp) sizes (see `shape_of`)."""
        return shape_of(self.ranks)

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the whole map (every rank's node, GPU, local rank and coordinates,
        in rank order): what a node's share of it is checked against."""
        h = hashlib.sha256()
        for s in self.ranks:
            h.update(
                f"{s.rank},{s.node_id},{s.gpu_index},{s.local_rank},{s.dp},{s.pp},{s.tp};".encode()
            )
        return h.hexdigest()


def shape_of(ranks: Sequence[Any]) -> tuple[int, int, int]:
    """(dp, pp, tp) sizes of a whole map (anything with the rank fields); (0, 0, 0) when
    the coordinates do not span it (a map written before coordinates: pure data
    parallel to the trainer)."""
    if not ranks:
        return (0, 0, 0)
    sizes = (
        1 + max(r.dp for r in ranks),
        1 + max(r.pp for r in ranks),
        1 + max(r.tp for r in ranks),
    )
    return sizes if sizes[0] * sizes[1] * sizes[2] == len(ranks) else (0, 0, 0)


def rank_coordinates(rank: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(dp, pp, tp) of ``rank``, tp varying fastest: rank = (dp * pp + pp_i) * tp + tp_i."""
    rest, tp_i = divmod(rank, tp)
    dp_i, pp_i = divmod(rest, pp)
    return dp_i, pp_i, tp_i


def rank_of(dp_i: int, pp_i: int, tp_i: int, tp: int, pp: int) -> int:
    """The rank at coordinates (dp_i, pp_i, tp_i): the inverse of rank_coordinates."""
    return (dp_i * pp + pp_i) * tp + tp_i


class Topology:
    """Nodes and their free GPUs for one placement decision.

    Built once per decision; ``book`` takes GPUs as gangs are placed, so several gangs
    placed in one pass never share a GPU.
    """

    def __init__(
        self,
        nodes: Mapping[str, NodeInfo],
        free: dict[str, list[int]],
        racks: dict[RackKey, list[str]],
        spares: list[str],
    ) -> None:
        # Use Topology.build: these structures must agree with each other.
        self._nodes = nodes
        self._free = free
        self._racks = racks
        self._spares = spares

    @classmethod
    def build(cls, nodes: Iterable[NodeInfo], booked: Iterable[tuple[str, int]]) -> Topology:
        """Index ``nodes``; ``booked`` are the (node_id, gpu_index) pairs live jobs hold.

        Booked pairs on unknown nodes or GPUs are ignored: a node or GPU that is gone
        cannot be placed on anyway.
        """
        by_id: dict[str, NodeInfo] = {}
        for node in nodes:
            if node.node_id in by_id:
                raise ValueError(f"node {node.node_id!r} is listed twice; pass each node once")
            by_id[node.node_id] = node
        taken: defaultdict[str, set[int]] = defaultdict(set)
        for node_id, gpu_index in booked:
            taken[node_id].add(gpu_index)
        free: dict[str, list[int]] = {}
        racks: defaultdict[RackKey, list[NodeInfo]] = defaultdict(list)
        spares: list[str] = []
        for node in by_id.values():
            held = taken.get(node.node_id)
            gpus = sorted(set(node.gpu_indexes))
            free[node.node_id] = [g for g in gpus if g not in held] if held else gpus
            if node.state != NodeState.READY:
                continue
            if node.role == NodeRole.WORKER:
                racks[node.rack_key].append(node)
            elif node.role == NodeRole.SPARE:
                spares.append(node.node_id)
        # Nodes sharing an NVLink domain sit next to each other, so a pipeline's
        # consecutive stages land in one domain when it has room.
        ordered = {
            key: [n.node_id for n in sorted(members, key=lambda n: (n.nvlink_domain, n.node_id))]
            for key, members in sorted(racks.items())
        }
        return cls(by_id, free, ordered, sorted(spares))

    def node(self, node_id: str) -> NodeInfo:
        """The node named ``node_id``; KeyError if the topology does not have it."""
        return self._nodes[node_id]

    @property
    def nodes(self) -> Mapping[str, NodeInfo]:
        """Every node, by id."""
        return self._nodes

    def free_gpus(self, node_id: str) -> tuple[int, ...]:
        """The node's GPU indexes that nothing has booked, ascending."""
        return tuple(self._free[node_id])

    def worker_racks(self) -> Mapping[RackKey, list[str]]:
        """READY worker nodes by rack, in the order placement takes them. Do not mutate."""
        return self._racks

    def ready_spares(self) -> list[str]:
        """READY spare node ids, sorted. Do not mutate."""
        return self._spares

    def free_count(self, node_id: str) -> int:
        return len(self._free[node_id])

    def book(self, placement: Placement) -> None:
        """Take the placement's GPUs. All or nothing: raises ValueError, booking nothing,
        if any GPU is unknown, already booked, or used twice by the placement."""
        wanted: defaultdict[str, set[int]] = defaultdict(set)
        for slot in placement.ranks:
            gpus = wanted[slot.node_id]
            if slot.gpu_index in gpus:
                raise ValueError(
                    f"rank {slot.rank}: GPU {slot.gpu_index} of node {slot.node_id!r} is used "
                    "twice in this placement"
                )
            gpus.add(slot.gpu_index)
        for node_id, gpus in wanted.items():
            free = self._free.get(node_id)
            if free is None:
                raise ValueError(f"node {node_id!r} is not in the topology; rebuild it")
            missing = gpus.difference(free)
            if missing:
                raise ValueError(
                    f"GPUs {sorted(missing)} of node {node_id!r} are already booked or do not "
                    "exist; place again on a fresh topology"
                )
        for node_id, gpus in wanted.items():
            self._free[node_id] = [g for g in self._free[node_id] if g not in gpus]
