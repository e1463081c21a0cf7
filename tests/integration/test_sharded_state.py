"""Sharded state (FSDP2 over dp, tensor parallel over tp) is kept as each rank's local
shards with their placements, and restored into a model built afresh, bitwise.

Four real gloo processes on pitstop's ("dp", "pp", "tp") mesh, dp = tp = 2, run
`sharded_rank.py`: train, capture, train on; rebuild, restore, train the same steps.
Then two processes, dp = 1 (the job shrunk by a replica), reshard those snapshots.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.forking import ForkClient, run_mesh_ranks

pytest.importorskip("torch")

RANK = Path(__file__).with_name("sharded_rank.py")
WORLD = 4
WAIT = 120.0  # four interpreters importing torch on two cores, then a few tiny steps


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory, mesh_forks: ForkClient) -> Path:
    """The dp = tp = 2 run's directory: its ranks' reports and step-3 snapshots."""
    out = tmp_path_factory.mktemp("dp2")
    run_mesh_ranks([str(RANK), "--out", str(out)], dp=2, tp=2, timeout=WAIT, fork=mesh_forks)
    return out


def test_sharded_state_restores_bitwise_into_a_rebuilt_model(dp2: Path) -> None:
    reports = [json.loads((dp2 / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    # tp fastest: ranks 0,1 are dp replica 0's two TP halves, ranks 2,3 replica 1's.
    assert [r["coordinates"] for r in reports] == [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]
    for report in reports:
        assert report["restored_at"] == 3
        assert report["restored"] == report["straight"], report
        assert len(report["placed_right"]) == 4, report  # up and down, weight and bias
        assert all(report["placed_right"].values()), report
    assert len({r["straight"] for r in reports}) == WORLD  # each rank holds its own shards
    assert len({(r["whole_at_3"], r["whole_at_5"]) for r in reports}) == 1


def test_a_shrunk_job_reshards_the_old_ranks_snapshots_exactly(
    dp2: Path, tmp_path: Path, mesh_forks: ForkClient
) -> None:
    """dp 2 -> 1, the second replica surviving (its ranks become the first): every
    parameter and Adam moment, whole, is bitwise the one snapshotted. Every rank of the
    test trains on the same batch, so one replica's gradient is the two replicas' mean,
    and two more steps stay equal."""
    before, after = dp2, tmp_path
    run_mesh_ranks(
        [
            str(RANK),
            "--out",
            str(after),
            "--reshard-from",
            str(before),
            "--survivor",
            "1",
        ],
        dp=1,
        tp=2,
        timeout=WAIT,
        fork=mesh_forks,
    )
    original = json.loads((before / "rank-0.json").read_text())
    for rank in range(2):
        shrunk = json.loads((after / f"rank-{rank}.json").read_text())
        assert shrunk["restored_at"] == 3
        assert shrunk["whole_at_3"] == original["whole_at_3"], (rank, shrunk)
        assert shrunk["whole_at_5"] == original["whole_at_5"], (rank, shrunk)
