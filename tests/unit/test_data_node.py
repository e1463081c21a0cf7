"""The torchdata node (pitstop.data.node): a Loader over a replica's microbatches whose
state_dict is the data cursor, so a checkpointed loader resumes at any dp."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from torchdata.nodes import Loader

from pitstop.data import (
    Manifest,
    Microbatch,
    ReplicaBatches,
    ReplicaNode,
    SampleOrder,
    SampleReader,
    Windows,
)

CONTEXT = 3


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[SampleReader]:
    (np.arange(40 * (CONTEXT + 1)) % 65536).astype(np.uint16).tofile(tmp_path / "0.bin")
    windows = Windows(Manifest.build([str(tmp_path / "0.bin")], "nanogpt"), CONTEXT)
    with SampleReader(windows) as opened:
        yield opened


def order() -> SampleOrder:
    return SampleOrder(samples=40, global_batch=12, microbatch_size=2, seed=4)  # M=6, 3/epoch


def node(reader: SampleReader, dp: int, replica: int, end_step: int = 7) -> ReplicaNode:
    return ReplicaNode(ReplicaBatches(order(), reader, dp, replica), end_step=end_step)


def steps_read(microbatches: list[Microbatch]) -> dict[int, dict[int, tuple[int, ...]]]:
    """step -> microbatch index -> its samples."""
    read: dict[int, dict[int, tuple[int, ...]]] = {}
    for microbatch in microbatches:
        assert microbatch.index not in read.setdefault(microbatch.step, {})
        read[microbatch.step][microbatch.index] = microbatch.samples
    return read


def test_a_replica_yields_its_share_of_each_step_until_the_end(reader: SampleReader) -> None:
    microbatches = list(Loader(node(reader, dp=4, replica=1, end_step=5)))
    assert [(mb.step, mb.index, mb.last) for mb in microbatches] == [
        (step, index, index == 5) for step in range(5) for index in (1, 5)
    ]
    for microbatch in microbatches:
        assert list(microbatch.samples) == order().microbatch_samples(
            microbatch.step, microbatch.index
        )
        assert microbatch.x.shape == (2, CONTEXT)


@pytest.mark.parametrize("new_dp", [1, 2, 3, 4, 6])
def test_a_loader_state_at_a_step_boundary_resumes_at_any_dp(
    reader: SampleReader, new_dp: int
) -> None:
    before: list[Microbatch] = []
    for replica in range(4):
        loader = Loader(node(reader, 4, replica))
        iterator = iter(loader)
        share = len(order().replica_microbatches(4, replica))
        before.extend(next(iterator) for _ in range(3 * share))  # steps 0, 1 and 2
        if replica == 0:
            saved = loader.state_dict()
    assert (saved["root"]["step"], saved["root"]["position"]) == (3, 0)
    resumed = []
    for replica in range(new_dp):
        loader = Loader(node(reader, new_dp, replica))
        loader.load_state_dict(saved)
        resumed.extend(loader)
    uninterrupted = [mb for r in range(4) for mb in Loader(node(reader, 4, r))]
    assert steps_read(before + resumed) == steps_read(uninterrupted)
    assert sorted(steps_read(resumed)) == [3, 4, 5, 6]


def test_a_mid_step_state_resumes_at_the_same_dp_with_the_next_microbatch(
    reader: SampleReader,
) -> None:
    loader = Loader(node(reader, 2, 0))
    iterator = iter(loader)
    first = [next(iterator) for _ in range(4)]  # step 0 (0, 2, 4), step 1 (0)
    saved = loader.state_dict()
    rest = list(iterator)
    again = Loader(node(reader, 2, 0))
    again.load_state_dict(saved)
    resumed = list(again)
    assert [(mb.step, mb.index) for mb in resumed] == [(mb.step, mb.index) for mb in rest]
    assert (first[-1].step, first[-1].index, resumed[0].index) == (1, 0, 2)
    state = loader.state_dict()
    assert all(type(value) is int for value in state["root"].values())


def test_a_mid_step_state_is_refused_at_another_dp(reader: SampleReader) -> None:
    source = node(reader, 2, 0)
    next(source)
    state = source.state_dict()
    assert state["position"] == 1
    with pytest.raises(ValueError, match="taken mid-step at dp 2, loaded at dp 3"):
        node(reader, 3, 0).reset(state)


def test_reset_without_state_starts_over(reader: SampleReader) -> None:
    replica = node(reader, 6, 5, end_step=2)
    first = [(mb.step, mb.index) for mb in replica]
    replica.reset()
    assert [(mb.step, mb.index) for mb in replica] == first == [(0, 5), (1, 5)]
