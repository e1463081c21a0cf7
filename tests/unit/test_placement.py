"""Placement: tables for the rules, hypothesis for the invariants over random fleets."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import astuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pitstop.scheduler.placement import (
    GangRequest,
    NodeInfo,
    Placement,
    RankSlot,
    Topology,
    choose_replacement,
    place_gang,
    place_pending,
    rank_coordinates,
    rank_of,
    replace_node,
    shrink_by_one_replica,
    standby_spares,
)

ALL_GPUS = tuple(range(8))


def node(
    node_id: str,
    rack: str = "r0",
    block: str = "b0",
    zone: str = "z0",
    *,
    role: str = "worker",
    state: str = "ready",
    gpus: Sequence[int] = ALL_GPUS,
) -> NodeInfo:
    return NodeInfo(node_id, zone, block, rack, role, state, tuple(gpus))


def rack_of(n: NodeInfo) -> tuple[str, str, str]:
    return (n.zone, n.block, n.rack)


def fleet(layout: dict[tuple[str, str, str], int]) -> list[NodeInfo]:
    """``layout`` maps (zone, block, rack) to its number of ready 8-GPU workers."""
    return [
        node(f"{z}-{b}-{r}-n{i}", r, b, z)
        for (z, b, r), count in layout.items()
        for i in range(count)
    ]


def replica_racks(topology: Topology, placement: Placement) -> list[set[tuple[str, str, str]]]:
    racks: dict[int, set[tuple[str, str, str]]] = {}
    for slot in placement.ranks:
        racks.setdefault(slot.dp, set()).add(rack_of(topology.node(slot.node_id)))
    return [racks[dp] for dp in sorted(racks)]


# --- tables ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "tp", "pp", "coords"),
    [
        (0, 1, 1, (0, 0, 0)),
        (5, 1, 1, (5, 0, 0)),
        (1, 2, 3, (0, 0, 1)),
        (2, 2, 3, (0, 1, 0)),
        (5, 2, 3, (0, 2, 1)),
        (6, 2, 3, (1, 0, 0)),
        (99_967, 8, 16, (780, 15, 7)),
    ],
)
def test_rank_coordinates_tp_varies_fastest(
    rank: int, tp: int, pp: int, coords: tuple[int, int, int]
) -> None:
    assert rank_coordinates(rank, tp, pp) == coords
    assert rank_of(*coords, tp=tp, pp=pp) == rank


def test_nodes_take_chunks_of_gpus_per_node_in_rank_order() -> None:
    topology = Topology.build([node("a", gpus=range(4)), node("b", gpus=range(4))], [])
    placement = place_gang(topology, GangRequest("j", tp=2, pp=2, dp=2, gpus_per_node=4))
    assert placement is not None
    rows = [(s.rank, s.local_rank, s.gpu_index, s.dp, s.pp, s.tp) for s in placement.ranks]
    assert rows == [(r, r % 4, r % 4, *rank_coordinates(r, 2, 2)) for r in range(8)]
    # One replica per node: the pipeline's two stages share the node.
    assert [s.node_id for s in placement.ranks[:4]] == [placement.ranks[0].node_id] * 4
    assert len(placement.nodes()) == 2


def test_ranks_use_the_lowest_free_gpus() -> None:
    topology = Topology.build([node("a")], [("a", 0), ("a", 2), ("a", 5)])
    placement = place_gang(topology, GangRequest("j", tp=1, pp=1, dp=4, gpus_per_node=4))
    assert placement is not None
    assert [s.gpu_index for s in placement.ranks] == [1, 3, 4, 6]
    assert [s.local_rank for s in placement.ranks] == [0, 1, 2, 3]


def test_a_gang_smaller_than_a_node_needs_only_its_own_gpus() -> None:
    topology = Topology.build([node("a")], [("a", g) for g in range(4)])
    placement = place_gang(topology, GangRequest("j", tp=1, pp=1, dp=4, gpus_per_node=8))
    assert placement is not None
    assert [s.gpu_index for s in placement.ranks] == [4, 5, 6, 7]


def test_a_pipeline_takes_the_rack_it_fits_whole() -> None:
    # Two nodes per pipeline: the rack with exactly two is used whole (best fit) and
    # neither pipeline is split although rack r1 alone has room for only one.
    topology = Topology.build(fleet({("z0", "b0", "r0"): 2, ("z0", "b0", "r1"): 3}), [])
    placement = place_gang(topology, GangRequest("j", tp=8, pp=2, dp=2, gpus_per_node=8))
    assert placement is not None
    assert replica_racks(topology, placement) == [{("z0", "b0", "r0")}, {("z0", "b0", "r1")}]


def test_a_pipeline_longer_than_a_rack_spans_the_fewest_racks() -> None:
    layout = {("z0", "b0", f"r{i}"): 2 for i in range(3)} | {("z0", "b0", "r9"): 1}
    topology = Topology.build(fleet(layout), [])
    placement = place_gang(topology, GangRequest("j", tp=8, pp=4, dp=1, gpus_per_node=8))
    assert placement is not None
    assert len(replica_racks(topology, placement)[0]) == 2


def test_replicas_spread_over_racks_inside_the_tightest_block() -> None:
    layout = {("z0", b, f"r{i}"): 2 for b in ("b0", "b1") for i in range(4)}
    layout[("z0", "b1", "r4")] = 2  # b1 has more room: b0 is the best fit
    topology = Topology.build(fleet(layout), [])
    placement = place_gang(topology, GangRequest("j", tp=8, pp=1, dp=4, gpus_per_node=8))
    assert placement is not None
    racks = replica_racks(topology, placement)
    assert {rack[1] for replica in racks for rack in replica} == {"b0"}
    assert len({frozenset(r) for r in racks}) == 4


def test_a_gang_spanning_zones_alternates_zones_between_replicas() -> None:
    layout = {(z, "b0", r): 1 for z in ("z0", "z1") for r in ("r0", "r1")}
    topology = Topology.build(fleet(layout), [])
    placement = place_gang(topology, GangRequest("j", tp=8, pp=1, dp=4, gpus_per_node=8))
    assert placement is not None
    zones = [next(iter(r))[0] for r in replica_racks(topology, placement)]
    assert all(a != b for a, b in itertools.pairwise(zones))


@pytest.mark.parametrize(
    ("kwargs", "usable"),
    [
        ({"state": "cordoned"}, False),
        ({"state": "draining"}, False),
        ({"state": "unhealthy"}, False),
        ({"state": "lost"}, False),
        ({"role": "spare"}, False),
        ({"gpus": range(7)}, False),
        ({}, True),
    ],
)
def test_only_ready_workers_with_room_take_ranks(kwargs: dict[str, object], usable: bool) -> None:
    topology = Topology.build([node("x", **kwargs)], [])  # type: ignore[arg-type]
    placement = place_gang(topology, GangRequest("j", tp=8, pp=1, dp=1, gpus_per_node=8))
    assert (placement is not None) is usable


def test_place_pending_goes_by_priority_then_age_and_backfills() -> None:
    topology = Topology.build(fleet({("z0", "b0", "r0"): 2}), [])
    requests = [
        GangRequest("old-low", 8, 1, 2, 8, priority=0, sequence=1),
        GangRequest("new-high", 8, 1, 1, 8, priority=5, sequence=9),
        GangRequest("old-high", 8, 1, 1, 8, priority=5, sequence=3),
        GangRequest("small", 4, 1, 1, 4, priority=-1, sequence=0),
    ]
    placed = place_pending(topology, requests)
    assert set(placed) == {"old-high", "new-high"}
    assert place_gang(topology, GangRequest("more", 1, 1, 1, 1)) is None


def test_book_refuses_a_booked_gpu_and_books_nothing() -> None:
    topology = Topology.build([node("a"), node("b")], [("b", 3)])
    placement = place_gang(topology, GangRequest("j", 8, 1, 1, 8))
    assert placement is not None
    topology.book(placement)
    with pytest.raises(ValueError, match="already booked"):
        topology.book(placement)
    taken = placement.ranks[0]
    both = Placement((RankSlot(0, "b", 0, 0, 0, 0, 0), RankSlot(1, *astuple(taken)[1:])))
    with pytest.raises(ValueError, match="already booked"):
        topology.book(both)
    assert topology.free_gpus("b") == (0, 1, 2, 4, 5, 6, 7)
    with pytest.raises(ValueError, match="twice"):
        topology.book(Placement((both.ranks[0], both.ranks[0])))


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"tp": 3, "gpus_per_node": 8}, "does not divide"),
        ({"tp": 16, "gpus_per_node": 8}, "does not divide"),
        ({"dp": 0}, "dp = 0"),
    ],
)
def test_gang_request_rejects_shapes_placement_cannot_honour(
    request_kwargs: dict[str, int], message: str
) -> None:
    args = {"tp": 1, "pp": 1, "dp": 1, "gpus_per_node": 8} | request_kwargs
    with pytest.raises(ValueError, match=message):
        GangRequest("j", **args)


SPARES = [
    node("s-rack", "r0", "b0", "z0", role="spare"),
    node("s-block", "r1", "b0", "z0", role="spare"),
    node("s-zone", "r0", "b1", "z0", role="spare"),
    node("s-any", "r0", "b0", "z1", role="spare"),
]


@pytest.mark.parametrize("drop", range(len(SPARES) + 1))
def test_choose_replacement_nearest_first(drop: int) -> None:
    failed = node("f", "r0", "b0", "z0", state="lost")
    skipped = [
        node("s-busy", "r0", "b0", "z0", role="spare", gpus=range(4)),
        node("s-cordoned", "r0", "b0", "z0", role="spare", state="cordoned"),
        node("w-ready", "r0", "b0", "z0"),
    ]
    topology = Topology.build([failed, *skipped, *SPARES[drop:]], [])
    expected = SPARES[drop].node_id if drop < len(SPARES) else None
    assert choose_replacement(topology, failed, 8) == expected
    # A spare holding the job's standby processes comes first, however far; one that does
    # not qualify is passed over still.
    preferred = "s-any" if drop < len(SPARES) else None  # s-any is the last one dropped
    assert choose_replacement(topology, failed, 8, prefer={"s-any"}) == preferred
    assert choose_replacement(topology, failed, 8, prefer={"s-busy"}) == expected
    # Of two spares holding standbys, the one whose standby already waits for a rank
    # comes first, however far; the nearer one's standby is still importing.
    if drop < len(SPARES) - 1:
        held = {SPARES[drop].node_id, "s-any"}
        assert choose_replacement(topology, failed, 8, prefer=held) == SPARES[drop].node_id
        assert choose_replacement(topology, failed, 8, prefer=held, ready={"s-any"}) == "s-any"


def test_replace_node_moves_only_the_failed_nodes_ranks() -> None:
    spare = node("s", role="spare", gpus=range(10))
    topology = Topology.build([node("a"), node("b"), spare], [("s", 0), ("s", 3)])
    placement = place_gang(topology, GangRequest("j", 4, 2, 2, 8))
    assert placement is not None
    failed = placement.ranks[8].node_id
    replaced = replace_node(placement, failed, "s", topology)
    assert replaced.ranks[:8] == placement.ranks[:8]
    assert [(s.rank, s.node_id, s.gpu_index, s.local_rank) for s in replaced.ranks[8:]] == [
        (8 + i, "s", gpu, i) for i, gpu in enumerate([1, 2, 4, 5, 6, 7, 8, 9])
    ]
    assert [(s.dp, s.pp, s.tp) for s in replaced.ranks] == [
        (s.dp, s.pp, s.tp) for s in placement.ranks
    ]
    with pytest.raises(ValueError, match="free GPUs"):
        replace_node(
            placement, failed, "s", Topology.build([spare], [("s", 0), ("s", 1), ("s", 2)])
        )


def test_standby_spares_are_the_ones_the_jobs_nodes_would_be_replaced_by() -> None:
    workers = [node("a", "r0", gpus=range(4)), node("b", "r0", gpus=range(4)), node("c", "r1")]
    spares = [
        node("s-r1", "r1", role="spare", gpus=range(4)),  # nearest to c only
        node("s-r0", "r0", role="spare", gpus=range(4)),  # nearest to a and b
        node("s-far", "r9", "b9", "z9", role="spare", gpus=range(4)),
        node("s-small", "r0", role="spare", gpus=range(1)),  # too few GPUs for a node
    ]
    topology = Topology.build([*workers, *spares], [("s-r0", 0)])
    placement = place_gang(topology, GangRequest("j", 2, 1, 3, 2))
    assert placement is not None
    assert {n: len(placement.ranks_on(n)) for n in placement.nodes()} == {"a": 2, "b": 2, "c": 2}
    # The most-chosen spare first, each with the lowest free GPUs a replacement takes.
    assert standby_spares(topology, placement, 1) == {"s-r0": (1, 2)}
    assert standby_spares(topology, placement, 2) == {"s-r0": (1, 2), "s-r1": (0, 1)}
    # More than the nodes ever choose: the other ready spares with room, by id.
    assert standby_spares(topology, placement, 9) == {
        "s-r0": (1, 2),
        "s-r1": (0, 1),
        "s-far": (0, 1),
    }
    assert standby_spares(topology, placement, 0) == {}


def test_shrink_drops_the_replica_and_renumbers_densely() -> None:
    topology = Topology.build([node(n, gpus=range(4)) for n in "abc"], [])
    placement = place_gang(topology, GangRequest("j", tp=2, pp=2, dp=3, gpus_per_node=4))
    assert placement is not None
    on = {s.dp: s.node_id for s in placement.ranks}
    shrunk = shrink_by_one_replica(placement, on[1], tp=2, pp=2)
    assert shrunk is not None
    assert [(s.rank, s.dp, s.pp, s.tp) for s in shrunk.ranks] == [
        (r, *rank_coordinates(r, 2, 2)) for r in range(8)
    ]
    assert [s.node_id for s in shrunk.ranks] == [on[0]] * 4 + [on[2]] * 4
    assert shrunk.ranks[4:] == tuple(
        RankSlot(s.rank - 4, s.node_id, s.gpu_index, s.local_rank, 1, s.pp, s.tp)
        for s in placement.ranks[8:]
    )


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        ((1, 1, 4, 2), "a node holds two replicas"),
        ((2, 3, 4, 4), "a replica shares its edge nodes"),
        ((2, 2, 1, 4), "the only replica"),
    ],
)
def test_shrink_refuses_when_one_replica_is_not_enough(
    shape: tuple[int, int, int, int], why: str
) -> None:
    tp, pp, dp, per_node = shape
    topology = Topology.build([node(f"n{i}") for i in range(8)], [])
    placement = place_gang(topology, GangRequest("j", tp, pp, dp, per_node))
    assert placement is not None
    assert shrink_by_one_replica(placement, placement.ranks[-1].node_id, tp, pp) is None, why


# --- properties over random fleets -----------------------------------------------------

STATES = ["ready"] * 4 + ["cordoned", "draining", "unhealthy", "lost"]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[NodeInfo], list[tuple[str, int]]]:
    """Random zones/blocks/racks of nodes with random roles, states, GPUs and bookings."""
    nodes: list[NodeInfo] = []
    booked: list[tuple[str, int]] = []
    for z, b, r in itertools.product(range(draw(st.integers(1, 2))), range(2), range(3)):
        for i in range(draw(st.integers(0, 3))):
            node_id = f"z{z}b{b}r{r}n{i}"
            full = draw(st.booleans())
            gpus = ALL_GPUS if full else sorted(draw(st.sets(st.integers(0, 7), max_size=8)))
            nodes.append(
                NodeInfo(
                    node_id,
                    f"z{z}",
                    f"b{b}",
                    f"r{r}",
                    draw(st.sampled_from(["worker"] * 3 + ["spare"])),
                    draw(st.sampled_from(STATES)),
                    tuple(gpus),
                )
            )
            if not draw(st.integers(0, 3)):
                booked += [(node_id, g) for g in draw(st.sets(st.sampled_from(ALL_GPUS)))]
    return nodes, booked


@st.composite
def gangs(draw: st.DrawFn, job_id: str = "j") -> GangRequest:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    per_node = tp * draw(st.sampled_from([n for n in (1, 2, 4, 8) if tp * n <= 8]))
    return GangRequest(
        job_id,
        tp=tp,
        pp=draw(st.integers(1, 4)),
        dp=draw(st.integers(1, 5)),
        gpus_per_node=per_node,
        priority=draw(st.integers(0, 2)),
        sequence=draw(st.integers(0, 100)),
    )


def batched(slots: Sequence[RankSlot], size: int) -> list[Sequence[RankSlot]]:
    return [slots[i : i + size] for i in range(0, len(slots), size)]


def eligible(topology: Topology, request: GangRequest) -> list[str]:
    return [
        n.node_id
        for n in topology.nodes.values()
        if n.role == "worker"
        and n.state == "ready"
        and len(topology.free_gpus(n.node_id)) >= request.gpus_needed
    ]


def assert_rank_map(placement: Placement, tp: int, pp: int, dp: int, per_node: int) -> None:
    """Dense ranks with matching coordinates; nodes take consecutive chunks of
    ``per_node`` ranks (the last may hold fewer), distinct GPUs and local ranks 0..k-1."""
    world = tp * pp * dp
    assert [s.rank for s in placement.ranks] == list(range(world))
    assert all((s.dp, s.pp, s.tp) == rank_coordinates(s.rank, tp, pp) for s in placement.ranks)
    for i, chunk in enumerate(batched(placement.ranks, per_node)):
        assert {s.node_id for s in chunk} == {chunk[0].node_id}
        assert [s.local_rank for s in chunk] == list(range(len(chunk)))
        assert len({s.gpu_index for s in chunk}) == len(chunk)
        assert len(chunk) == per_node or i == (world - 1) // per_node
    assert len(placement.nodes()) == -(-world // per_node)  # no node comes back later
    # TP groups never span nodes.
    for group in batched(placement.ranks, tp):
        assert len({s.node_id for s in group}) == 1


def assert_placed_on_free(topology: Topology, request: GangRequest, placement: Placement) -> None:
    usable = set(eligible(topology, request))
    for s in placement.ranks:
        assert s.node_id in usable
        assert s.gpu_index in topology.free_gpus(s.node_id)


def pairs(placements: Iterable[Placement]) -> Counter[tuple[str, int]]:
    return Counter((s.node_id, s.gpu_index) for p in placements for s in p.ranks)


PROPERTY = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(fleets(), gangs())
def test_a_gang_is_placed_whole_on_usable_free_gpus_or_not_at_all(
    world: tuple[list[NodeInfo], list[tuple[str, int]]], request: GangRequest
) -> None:
    topology = Topology.build(*world)
    placement = place_gang(topology, request)
    # Complete: it fails only when there are too few usable nodes.
    assert (placement is None) == (len(eligible(topology, request)) < request.node_count)
    if placement is not None:
        assert_rank_map(placement, request.tp, request.pp, request.dp, request.gpus_per_node)
        assert_placed_on_free(topology, request, placement)


@PROPERTY
@given(fleets(), st.lists(gangs(), min_size=1, max_size=4))
def test_place_pending_never_books_a_gpu_twice(
    world: tuple[list[NodeInfo], list[tuple[str, int]]], drawn: list[GangRequest]
) -> None:
    requests = [
        GangRequest(f"j{i}", r.tp, r.pp, r.dp, r.gpus_per_node, r.priority, r.sequence)
        for i, r in enumerate(drawn)
    ]
    topology = Topology.build(*world)
    placed = place_pending(topology, requests)
    used = pairs(placed.values())
    assert all(count == 1 for count in used.values())
    assert not set(used) & set(world[1])
    for request in requests:
        if request.job_id in placed:
            p = placed[request.job_id]
            assert_rank_map(p, request.tp, request.pp, request.dp, request.gpus_per_node)
    for (node_id, gpu), _ in used.items():
        assert gpu not in topology.free_gpus(node_id)  # booked as it went


@PROPERTY
@given(fleets(), gangs(), st.integers(0, 10_000))
def test_replacement_is_the_nearest_ready_spare_and_moves_one_nodes_ranks(
    world: tuple[list[NodeInfo], list[tuple[str, int]]], request: GangRequest, pick: int
) -> None:
    topology = Topology.build(*world)
    placement = place_gang(topology, request)
    if placement is None:
        return
    topology.book(placement)
    failed_id = placement.nodes()[pick % len(placement.nodes())]
    failed = topology.node(failed_id)
    moved = placement.ranks_on(failed_id)
    spare_id = choose_replacement(topology, failed, len(moved))
    candidates = [
        n
        for n in topology.nodes.values()
        if n.role == "spare"
        and n.state == "ready"
        and len(topology.free_gpus(n.node_id)) >= len(moved)
    ]
    if spare_id is None:
        assert not candidates
        return
    spare = topology.node(spare_id)
    assert spare in candidates

    def distance(n: NodeInfo) -> int:
        return next(
            i
            for i, same in enumerate(
                [
                    rack_of(n) == rack_of(failed),
                    rack_of(n)[:2] == rack_of(failed)[:2],
                    n.zone == failed.zone,
                    True,
                ]
            )
            if same
        )

    assert distance(spare) == min(distance(n) for n in candidates)
    replaced = replace_node(placement, failed_id, spare_id, topology)
    assert_rank_map(replaced, request.tp, request.pp, request.dp, request.gpus_per_node)
    for old, new in zip(placement.ranks, replaced.ranks, strict=True):
        if old.node_id == failed_id:
            assert (new.node_id, new.rank, new.local_rank) == (spare_id, old.rank, old.local_rank)
            assert new.gpu_index in topology.free_gpus(spare_id)
        else:
            assert new == old


@PROPERTY
@given(fleets(), gangs(), st.integers(0, 10_000))
def test_shrink_drops_exactly_the_failed_replica(
    world: tuple[list[NodeInfo], list[tuple[str, int]]], request: GangRequest, pick: int
) -> None:
    topology = Topology.build(*world)
    placement = place_gang(topology, request)
    if placement is None:
        return
    failed_id = placement.nodes()[pick % len(placement.nodes())]
    replicas = {s.dp for s in placement.ranks_on(failed_id)}
    shrunk = shrink_by_one_replica(placement, failed_id, request.tp, request.pp)
    if shrunk is None:
        (dropped,) = replicas if len(replicas) == 1 else (None,)
        shared = dropped is not None and any(
            {s.dp for s in placement.ranks_on(n)} != {dropped}
            for n in {s.node_id for s in placement.ranks if s.dp == dropped}
        )
        assert len(replicas) > 1 or request.dp == 1 or shared
        return
    (dropped,) = replicas
    assert_rank_map(shrunk, request.tp, request.pp, request.dp - 1, request.gpus_per_node)
    kept = [s for s in placement.ranks if s.dp != dropped]
    assert [(s.node_id, s.gpu_index, s.local_rank, s.pp, s.tp) for s in shrunk.ranks] == [
        (s.node_id, s.gpu_index, s.local_rank, s.pp, s.tp) for s in kept
    ]
    assert failed_id not in shrunk.nodes()
