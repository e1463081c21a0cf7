"""The load shedder of a process holding agent streams: it sheds from a lag sample at its
threshold on, until a second has passed with every sample under half of it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from pitstop.scheduler.api.shedding import LoadShedder


def shedder() -> tuple[LoadShedder, Counter]:
    counter = Counter("shed_total", "shed", ["kind"], registry=CollectorRegistry())
    return LoadShedder(0.25, counter, calm_seconds=1.0), counter


def test_it_sheds_from_a_late_sample_until_a_calm_second() -> None:
    load, _ = shedder()
    timeline = [
        (0.00, 0.01, False),
        (0.05, 0.30, True),  # the loop ran 300 ms late
        (0.10, 0.01, True),
        (0.60, 0.20, True),  # not calm yet: at least half the threshold
        (1.55, 0.01, True),  # 0.95 s after that
        (1.61, 0.01, False),  # a second after the last uneasy sample
        (1.70, 0.24, False),  # under the threshold: no shedding starts
    ]
    for now, lag, shedding in timeline:
        load.observe(now, lag)
        assert load.shedding is shedding, (now, lag)


def test_what_is_dropped_is_counted_by_kind_and_nothing_while_calm() -> None:
    load, counter = shedder()
    assert not load.drop("step_summary")
    load.observe(0.0, 1.0)
    assert load.drop("step_summary")
    assert load.drop("step_summary")
    assert load.drop("heartbeat")
    assert counter.labels("step_summary")._value.get() == 2
    assert counter.labels("heartbeat")._value.get() == 1
