"""A stateful data loader is part of the state: a restored rank gets the very next batch.

Its shuffling draws from torch's global generator, which the state keeps too. (A
loader given its own `generator=` resumes the epoch it is in, but torchdata 0.11 does
not restore that generator for the epochs after: measured, the next epoch differs.)
"""

from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from pitstop.trainer.state import StateFormatError, TrainState, apply, capture


def make_state() -> TrainState:
    torch.manual_seed(7)
    data = torch.arange(40, dtype=torch.float32).view(20, 2)
    loader = StatefulDataLoader(data, batch_size=3, shuffle=True)
    return TrainState(model=torch.nn.Linear(2, 1), loaders={"train": loader})


def test_a_restored_loader_gives_the_batch_after_the_restored_step_across_epochs() -> None:
    straight = make_state()
    for _ in range(9):  # 7 batches an epoch: into the second epoch
        straight.next_batch()
    flat, metadata = capture(straight)
    expected = [straight.next_batch() for _ in range(12)]  # into the third epoch

    restored = make_state()
    restored.next_batch()  # an iterator already taken: the restore must replace it
    apply(restored, flat, metadata)
    got = [restored.next_batch() for _ in range(12)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_state_without_the_loader_it_needs_is_refused_by_name() -> None:
    flat, metadata = capture(TrainState(model=torch.nn.Linear(2, 1)))
    with pytest.raises(StateFormatError, match="no data loader 'train'"):
        apply(make_state(), flat, metadata)
