"""A training session outlives its checkpoint daemon: real Sessions in this process (no
agent, no process group) against real pitstop-checkpointd processes that are killed,
restarted at the same address, or have their memory removed from /dev/shm under them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit.checkpointd import REPLICA, DaemonProcess, FakeCatalog, added, node_segments
from kit.ports import free_port
from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.rankside.writer import SnapshotWriter

torch = pytest.importorskip("torch")

from pitstop.trainer import Session, TrainState  # noqa: E402 (needs torch)
from pitstop.trainer.config import RankConfig  # noqa: E402


def make_state() -> TrainState:
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(16, 4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return TrainState(model, optimizer, cursor={"index": 0})


def train_step(state: TrainState) -> None:
    assert state.optimizer is not None
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(state.cursor["index"]))
    loss = state.model(batch).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.cursor["index"] += 8


def assert_same(restored: TrainState, live: TrainState) -> None:
    assert (restored.step, restored.cursor) == (live.step, live.cursor)
    for name, tensor in live.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[name], tensor), name
    assert restored.optimizer is not None
    assert live.optimizer is not None
    ours = restored.optimizer.state_dict()["state"]
    for index, entries in live.optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(ours[index][key], value), (index, key)


def session_on(address: str, job: str) -> Session:
    config = RankConfig(job_id=job, checkpointd=address)
    return Session(config, writer=SnapshotWriter(address, job, 0, timeout_s=5))


@pytest.fixture
def node_ids() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for node_id in ids:
        remove_stale_segments(segment_prefix(node_id))


def test_training_goes_on_while_its_daemon_loses_memory_dies_and_comes_back(
    tmp_path: Path, node_ids: list[str]
) -> None:
    node_id = f"t-{uuid.uuid4().hex[:6]}"
    node_ids.append(node_id)
    port = free_port()
    daemon = DaemonProcess(node_id, tmp_path / "a", port=port)
    session = session_on(daemon.address, "job-outlive")
    saved: dict[int, bool] = {}
    try:
        state = session.restore(default=make_state)
        for step in session.steps(state, until=12):
            train_step(state)
            session.commit(state)
            assert session.last_snapshot is not None
            saved[step] = session.last_snapshot.step == step
            if step == 2:
                assert session.writer is not None
                session.writer.wait()  # sealed, and the slot for step 3 taken ahead
                for path in node_segments(node_id):
                    path.unlink()  # the daemon's memory is removed from under it
            elif step == 5:
                daemon.kill()
            elif step == 8:  # it comes back at the same address, empty
                daemon = DaemonProcess(node_id, tmp_path / "a", port=port)
        assert session.finished
        assert state.step == 12
        assert not saved[3]  # its slot vanished
        assert [saved[7], saved[8]] == [False, False]  # the daemon was gone
        assert all(saved[step] for step in (9, 10, 11, 12))  # and back
        assert session.snapshot_failures >= 3
        fresh = make_state()
        session.load(fresh, 12)
        assert_same(fresh, state)
    finally:
        session.close()
        daemon.stop()


def test_a_rank_restores_from_a_holder_the_catalog_names_when_its_daemon_is_gone(
    tmp_path: Path, node_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = "job-elsewhere"
    catalog = FakeCatalog()
    a_id, b_id = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    node_ids += [a_id, b_id]
    buddy = DaemonProcess(b_id, tmp_path / "b", scheduler=catalog.address)
    node = DaemonProcess(a_id, tmp_path / "a", "--buddy", buddy.address, scheduler=catalog.address)
    catalog.addresses = {a_id: node.address, b_id: buddy.address}
    session = session_on(node.address, job)
    try:
        state = session.restore(default=make_state)
        for _ in session.steps(state, until=5):
            train_step(state)
            session.commit(state)
        assert session.writer is not None
        session.writer.wait()
        catalog.wait_for(added(b_id, job, 5, REPLICA, {0}))
        node.kill()
        # The rank that ran on rolls back: its daemon is gone, the buddy serves.
        rolled_back = make_state()
        session.load(rolled_back, 5)
        assert_same(rolled_back, state)
        # A rank started afresh to restore step 5 on this node (what the chaos run saw
        # fail three times): it asks the catalog, named by PITSTOP_SCHEDULER.
        for name in ("RANK", "WORLD_SIZE", "PITSTOP_AGENT_SOCKET", "PITSTOP_STANDBY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("PITSTOP_CHECKPOINTD", node.address)
        monkeypatch.setenv("PITSTOP_JOB_ID", job)
        monkeypatch.setenv("PITSTOP_RESTORE_STEP", "5")
        monkeypatch.setenv("PITSTOP_SCHEDULER", catalog.address)
        with Session.from_env() as restarted:
            assert_same(restarted.restore(default=make_state), state)
        # And training goes on without the daemon: snapshots are skipped, not fatal.
        for _ in session.steps(state, until=8):
            train_step(state)
            session.commit(state)
        assert session.finished
        assert session.snapshot_failures >= 3
    finally:
        session.close()
        node.stop()
        buddy.stop()
        catalog.server.stop(None)
