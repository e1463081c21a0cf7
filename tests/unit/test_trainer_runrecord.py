"""Rank 0's run record (pitstop.trainer.runrecord): sent once per generation as its first
step begins, with the code of the working directory, the environment and the data
digest the script stated before the loop; a failure to send never ends the run."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from pitstop.trainer import Session, TrainState
from pitstop.trainer.config import RankConfig
from pitstop.v1 import agent_pb2


class FakeControl:
    """The rank client, as far as a session without commands or snapshots uses it."""

    def __init__(self, rank: int = 0, fail: bool = False) -> None:
        self.rank, self.generation, self.fail = rank, 0, fail
        self.slow_multiplier = 1.0
        self.records: list[agent_pb2.RunRecord] = []

    def take_rank_fault(self) -> int:
        return 0

    def report_run_record(self, record: agent_pb2.RunRecord) -> None:
        if self.fail:
            raise grpc.RpcError("the agent is away")
        self.records.append(record)

    def close(self) -> None:
        pass


def run(session: Session, state: TrainState, until: int) -> None:
    for _ in session.steps(state, until=until):
        session.commit(state, loss=1.0)


def session_of(control: FakeControl, rank: int = 0, generation: int = 3) -> Session:
    config = RankConfig(rank=rank, world_size=2, job_id="j-record", generation=generation)
    return Session(config, control)  # type: ignore[arg-type]


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A committed git tree as the working directory; its HEAD."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
            cwd=tmp_path,
            check=True,
        )
    monkeypatch.chdir(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True)
    return head.stdout.decode().strip()


def test_rank_0_reports_each_generation_once_with_code_environment_and_data(
    repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PITSTOP_IMAGE", "registry.example.com/train:7")
    control = FakeControl()
    session = session_of(control)
    session.record_data("d" * 64, source="s3://bucket/manifest.json")
    state = TrainState(torch.nn.Linear(1, 1))
    run(session, state, until=3)
    (first,) = control.records
    assert (first.generation, first.start_step) == (3, 0)
    assert first.code.git_commit == repo
    assert not first.code.dirty
    assert first.code.working_dir == str(Path.cwd())
    assert first.environment.torch == torch.__version__
    assert first.environment.python
    assert first.environment.pitstop
    assert first.environment.image == "registry.example.com/train:7"
    assert (first.data_digest, first.data_source) == ("d" * 64, "s3://bucket/manifest.json")

    session.generation = 4  # an in-place recovery moved it on, from step 3
    session.record_data("e" * 64)
    run(session, state, until=5)
    assert [(r.generation, r.start_step, r.data_digest) for r in control.records] == [
        (3, 0, "d" * 64),
        (4, 3, "e" * 64),
    ]


def test_other_ranks_and_off_cluster_sessions_report_nothing(repo: str) -> None:
    control = FakeControl(rank=1)
    run(session_of(control, rank=1), TrainState(torch.nn.Linear(1, 1)), until=2)
    assert control.records == []
    off = Session(RankConfig())
    off.record_data("abc")
    run(off, TrainState(torch.nn.Linear(1, 1)), until=2)  # nothing to send it to


def test_a_report_that_fails_is_logged_and_training_goes_on(
    repo: str, caplog: pytest.LogCaptureFixture
) -> None:
    control = FakeControl(fail=True)
    state = TrainState(torch.nn.Linear(1, 1))
    with caplog.at_level(logging.WARNING):
        run(session_of(control), state, until=3)
    assert state.step == 3
    assert "run record of generation 3 was not reported" in caplog.text


@pytest.mark.parametrize(
    ("digest", "source", "error"),
    [("a\x00b", "", ValueError), ("x" * 4097, "", ValueError), ("ok", 7, TypeError)],
)
def test_a_data_version_that_cannot_be_kept_is_refused(
    digest: str, source: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match=r"Session\.record_data"):
        Session(RankConfig()).record_data(digest, source)
