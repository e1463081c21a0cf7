"""Abandoning a collective: no rank waits out a timeout for a peer that is gone.

Four real processes in a real gloo group (pitstop's `group.form`, collective timeout
60 s) all-reduce in a loop. Killed: the last rank dies with SIGKILL inside its loop;
every other rank must be out of its collective. Reconfigured: every rank is told of a
new generation from another thread, as its command reader is when a Reconfigure arrives
(the last rank first, the others 0.1 s apart), and stays alive; each must be out once
told, or earlier, when a peer that left before it ends its collective. Without
`group.abandon` such ranks wait out the 60 s: the bound here (10 s) tells abandoning
from waiting on any machine; how fast ranks get out is part of every recovery's re-form
time, which bench/recovery.py measures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
from abandon_harness import run_ranks

from pitstop.trainer import group

WORLD = 4
# Seconds from the fault, or from being told, to out of the collective: far below the
# 60 s a rank that does not abandon waits, far above the tenths of a second it takes.
OUT_WITHIN = 10.0
WAIT = 60.0  # for the processes to start, form the group and report
SEEN_WITHIN = 10.0  # beyond the grace: for the exit of a stuck rank to be seen


def test_every_survivor_is_out_of_its_collective_long_before_its_timeout_after_a_kill(
    tmp_path: Path,
) -> None:
    reports, stuck = run_ranks("kill", tmp_path, WORLD, WAIT)
    assert not stuck, stuck  # nobody abandons before its collective fails: none is watched
    killed_at = json.loads((tmp_path / "left.json").read_text())["at"]
    took = {rank: float(str(r["at"])) - killed_at for rank, r in reports.items()}
    assert max(took.values()) < OUT_WITHIN, (took, reports)


def test_every_rank_told_of_a_new_generation_is_out_of_its_collective(
    tmp_path: Path,
) -> None:
    reports, stuck = run_ranks("reconfigure", tmp_path, WORLD, WAIT)
    for rank, seen in stuck.items():  # gloo's partly written send: left, not waiting
        told = json.loads((tmp_path / f"told-{rank}.json").read_text())["at"]
        assert seen - told < group.ABANDON_GRACE + SEEN_WITHIN, (rank, seen - told)
    assert len(stuck) < WORLD, stuck
    if WORLD - 1 in reports:
        assert reports[WORLD - 1]["told"] is not None, reports  # told first: nobody left before
    took = {}
    for rank, report in reports.items():
        assert report["same_generation_shut"] in (0, -1), report  # its own generation: no-op
        if report["told"] is not None:
            took[rank] = float(str(report["at"])) - float(str(report["told"]))
        # else: out before it was told, a peer's abandon having ended its collective
    assert max(took.values(), default=0.0) < OUT_WITHIN, (took, reports)
