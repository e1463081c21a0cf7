"""WindowOrder: straggler windows reach the detector in order, each once every rank has
summarized it or once it has waited long enough."""

from __future__ import annotations

from pitstop.scheduler.reconcile.steps import WindowOrder
from pitstop.v1 import agent_pb2


def windows(index: int, ranks: range) -> list[agent_pb2.RankWindow]:
    return [agent_pb2.RankWindow(rank=r, window=index, steps=20, timed=20) for r in ranks]


def released(found: list[agent_pb2.RankWindow]) -> list[tuple[int, int]]:
    return [(w.window, w.rank) for w in found]


def test_a_slow_rank_holds_the_later_windows_back_until_it_comes() -> None:
    order = WindowOrder()
    # The fast ranks have summarized windows 0 and 1; the slow one, nothing yet.
    assert order.release(windows(0, range(3)) + windows(1, range(3)), 4, 0.0, 5.0) == []
    found = order.release(windows(0, range(3, 4)), 4, 1.0, 5.0)
    assert released(found) == [(0, 0), (0, 1), (0, 2), (0, 3)]  # window 1 still waits
    found = order.release(windows(1, range(3, 4)), 4, 2.0, 5.0)
    assert released(found) == [(1, 0), (1, 1), (1, 2), (1, 3)]


def test_a_dead_rank_holds_a_window_only_as_long_as_the_hold() -> None:
    order = WindowOrder()
    assert order.release(windows(0, range(3)), 4, 0.0, 5.0) == []
    assert order.release(windows(1, range(3)), 4, 4.9, 5.0) == []
    found = order.release([], 4, 5.0, 5.0)
    assert released(found) == [(0, 0), (0, 1), (0, 2)]  # window 1 has its own 5 s
    assert released(order.release([], 4, 9.9, 5.0)) == [(1, 0), (1, 1), (1, 2)]
    # A summary of a window already let through goes at once: the detector decides.
    assert released(order.release(windows(0, range(3, 4)), 4, 10.0, 5.0)) == [(0, 3)]
