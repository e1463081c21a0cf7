"""The snapshot off the loop's path: the parameters and the optimizer's state are copied
while the next step's forward and backward run, and only the optimizer's step waits for
the copy. What each snapshot holds must still be exactly its step's state: a real
Session in this process against a real checkpoint daemon (in a thread), each snapshot
restored and compared bitwise with a copy of the state taken with the loop stopped."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit.checkpointd import DaemonThread, daemon_settings
from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.rankside.tensorcopy import Copier
from pitstop.rankside.writer import SnapshotWriter

torch = pytest.importorskip("torch")

from pitstop.trainer import Session, TrainState  # noqa: E402 (needs torch)
from pitstop.trainer.config import RankConfig  # noqa: E402
from pitstop.trainer.state import Capturer, capture  # noqa: E402

WIDTH = 1024
SLOW_COPY_SECONDS = 0.3
"""How long a copy behind waits for the next optimizer step before it copies: a copy
that outlasts the step, which the step must wait for."""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonThread]:
    node = f"behind-{uuid.uuid4().hex[:6]}"
    started = DaemonThread(daemon_settings(node, tmp_path, memory_budget_bytes=512 << 20))
    yield started
    started.stop()
    remove_stale_segments(segment_prefix(node))


def make_state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return TrainState(model, optimizer, cursor={"index": 0})


def train_step(state: TrainState) -> None:
    assert state.optimizer is not None
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(state.cursor["index"]))
    loss = state.model(batch).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()  # straight after the backward: the copy may still run
    state.cursor["index"] += 4


def test_each_snapshot_is_its_step_bitwise_while_the_next_step_runs_beside_its_copy(
    daemon: DaemonThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each copy behind is slowed to outlast the next optimizer step: it starts once
    that step has run (or SLOW_COPY_SECONDS have passed). Only a step that waits for
    the copy leaves the snapshot its own step's state; one that does not overwrites
    the tensors before they are copied."""
    stepped = threading.Event()
    move = Copier.move

    def slow(self: Copier, moves: list[tuple[int, int, int]]) -> None:
        if threading.current_thread().name.startswith("pitstop-copy-behind"):
            stepped.wait(SLOW_COPY_SECONDS)
        move(self, moves)

    monkeypatch.setattr(Copier, "move", slow)
    writer = SnapshotWriter(daemon.address, "job-behind", 0, timeout_s=10)
    session = Session(RankConfig(job_id="job-behind", checkpointd=daemon.address), writer=writer)
    stopped: dict[int, dict[str, torch.Tensor]] = {}  # step -> the state, copied stopped
    compared = []
    try:
        state = session.restore(default=make_state)
        assert state.optimizer is not None
        state.optimizer.register_step_post_hook(lambda *_: stepped.set())
        for step in session.steps(state, until=12):
            train_step(state)
            if step - 1 in stopped:
                # After the next step's optimizer step: its snapshot, sealed, restored.
                writer.wait()
                restored = writer.restore(step - 1).tensors
                for name, tensor in stopped.pop(step - 1).items():
                    assert torch.equal(restored[name], tensor), (step - 1, name)
                compared.append(step - 1)
            stepped.clear()  # the copy of this step's snapshot waits for the next one
            session.commit(state)
            assert session.last_snapshot is not None
            assert session.last_snapshot.step == step
            tensors, _ = capture(state)
            stopped[step] = {k: v.detach().clone() for k, v in tensors.items()}
        behind = session.snapshots.capture.behind
        assert {"model.0.weight", "optim.state.0.exp_avg", "optim.state.0.step"} <= behind
        assert compared == list(range(1, 12))
        assert session.snapshot_failures == 0
    finally:
        session.close()


def test_only_what_the_optimizer_alone_changes_is_copied_behind() -> None:
    """A buffer (changed by the forward), a frozen parameter (no optimizer step waits
    for it) and the RNG and cursor are copied before the snapshot returns."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[0].bias.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=0.1)
    state = TrainState(model, optimizer, cursor={"index": 0})
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    capturer = Capturer()
    tensors, _ = capturer(state)
    assert capturer.behind == {
        "model.0.weight",
        "model.1.weight",
        "model.1.bias",
        *(f"optim.state.{i}.{k}" for i in range(3) for k in ("step", "exp_avg", "exp_avg_sq")),
    }
    assert {"model.0.bias", "model.1.running_mean", "rng.torch", "cursor.index"} <= set(tensors)
    capturer(TrainState(model))
    assert not capturer.behind  # no optimizer: nothing waits for a copy behind
