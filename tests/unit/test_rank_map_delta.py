"""The rank-map delta a new generation writes (lifecycle.map_delta): what changed, whether
the side-by-side pass or the by-rank one finds it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.scheduler.services.lifecycle import map_delta
from pitstop.scheduler.topology import Placement, RankSlot


def spread(nodes: list[str], per_node: int = 4) -> Placement:
    return Placement(
        tuple(
            RankSlot(i * per_node + g, node, g, g, i, 0, g)
            for i, node in enumerate(nodes)
            for g in range(per_node)
        )
    )


def by_rank(before: Placement, after: Placement) -> tuple[set[int], set[RankSlot]]:
    old = {s.rank: s for s in before.ranks}
    new = {s.rank: s for s in after.ranks}
    return (
        {r for r, s in old.items() if new.get(r) != s},
        {s for r, s in new.items() if old.get(r) != s},
    )


def test_a_replacement_is_the_moved_node_only() -> None:
    before = spread(["a", "b", "c"])
    ranks = list(before.ranks)
    for slot in before.ranks_on("b"):
        ranks[slot.rank] = RankSlot(slot.rank, "spare", slot.gpu_index, slot.local_rank, 1, 0, 0)
    gone, added = map_delta(before, Placement(tuple(ranks)))
    assert gone == [4, 5, 6, 7]
    assert [(s.rank, s.node_id) for s in added] == [(r, "spare") for r in range(4, 8)]


@given(
    nodes=st.integers(1, 6),
    moved=st.sets(st.integers(0, 5)),
    copy=st.booleans(),
    reverse=st.booleans(),
    keep=st.integers(0, 24),
)
def test_the_delta_is_what_a_by_rank_comparison_finds(
    nodes: int, moved: set[int], copy: bool, reverse: bool, keep: int
) -> None:
    # Slots moved to a spare, equal slots that are new objects, a map in another order,
    # a shrink: the delta is always the by-rank one.
    before = spread([f"n{i}" for i in range(nodes)])
    ranks = [
        RankSlot(s.rank, "spare", s.gpu_index, s.local_rank, s.dp, s.pp, s.tp)
        if s.rank // 4 in moved
        else RankSlot(*(getattr(s, f) for f in RankSlot.__slots__))
        if copy
        else s
        for s in before.ranks
    ][: keep or None]
    after = Placement(tuple(reversed(ranks) if reverse else ranks))
    gone, added = map_delta(before, after)
    assert (set(gone), set(added)) == by_rank(before, after)
    assert len(gone) == len(set(gone))
    assert len(added) == len(set(added))
