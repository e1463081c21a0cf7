"""The leader hands the straggler detector each job's step samples in step order: held
until every rank reached their step, or until they waited `hold` seconds. StepOrder does
it in time that follows the samples, not the ranks times the samples held; it must
release exactly what the plain rule releases, in the same order, whatever the arrivals."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.scheduler.reconcile.steps import StepOrder
from pitstop.v1 import agent_pb2

HOLD = 5.0


class PlainRule:
    """The rule as first written: a pass over every held sample and every rank."""

    def __init__(self) -> None:
        self.rank_max: dict[int, int] = {}
        self.held: list[tuple[float, agent_pb2.StepSample]] = []

    def release(
        self, fresh: list[agent_pb2.StepSample], world_size: int, now: float, hold: float
    ) -> list[agent_pb2.StepSample]:
        for sample in fresh:
            self.rank_max[sample.rank] = max(self.rank_max.get(sample.rank, 0), sample.step)
        self.held.extend((now, sample) for sample in fresh)
        everyone = min(self.rank_max.values()) if len(self.rank_max) >= world_size else 0
        overdue = max((s.step for t, s in self.held if t + hold <= now), default=0)
        frontier = max(everyone, overdue)
        ready = sorted((s for _, s in self.held if s.step <= frontier), key=lambda x: x.step)
        self.held = [(t, s) for t, s in self.held if s.step > frontier]
        return ready


def sample(rank: int, step: int) -> agent_pb2.StepSample:
    return agent_pb2.StepSample(rank=rank, step=step, step_seconds=1.0)


# A read of the streams: how long after the previous one, and the (rank, step) samples
# it brings, in the order the node batches came.
reads = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=4.0),
        st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), max_size=12),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(reads=reads, world_size=st.integers(1, 6))
def test_step_order_releases_what_the_plain_rule_releases(
    reads: list[tuple[float, list[tuple[int, int]]]], world_size: int
) -> None:
    fast, plain = StepOrder(), PlainRule()
    now = 0.0
    for gap, batch in reads:
        now += gap
        fresh = [sample(rank, step) for rank, step in batch]
        got = fast.release(fresh, world_size, now, HOLD)
        want = plain.release(fresh, world_size, now, HOLD)
        # The same sample objects, in the same order.
        assert [id(s) for s in got] == [id(s) for s in want]
    assert fast.rank_max == plain.rank_max


def test_a_silent_rank_holds_the_others_back_only_for_the_hold() -> None:
    order = StepOrder()
    ahead = [sample(0, 1), sample(0, 2)]
    assert order.release(ahead, world_size=2, now=0.0, hold=HOLD) == []
    assert order.release([], world_size=2, now=HOLD - 0.1, hold=HOLD) == []
    assert order.release([], world_size=2, now=HOLD, hold=HOLD) == ahead
    # The silent rank catches up: everyone reached step 3, so step 3 goes at once.
    caught_up = [sample(1, 3), sample(0, 3)]
    assert order.release(caught_up, world_size=2, now=HOLD + 1, hold=HOLD) == caught_up
