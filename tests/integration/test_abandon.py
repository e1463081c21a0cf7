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
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

pytest.importorskip("torch")
from pitstop.trainer import group

RANK = Path(__file__).with_name("abandon_rank.py")
WORLD = 4
# Seconds from the fault, or from being told, to out of the collective: far below the
# 60 s a rank that does not abandon waits, far above the tenths of a second it takes.
OUT_WITHIN = 10.0
WAIT = 60.0  # for the processes to start, form the group and report
SEEN_WITHIN = 10.0  # beyond the grace: for the exit of a stuck rank to be seen


def run_ranks(fault: str, out: Path) -> tuple[dict[int, dict[str, object]], dict[int, float]]:
    """Start the ranks, wait for every rank that was not killed to report, or to exit
    stuck. Returns the reports, and when each stuck rank's exit was seen."""
    common = ["--world", str(WORLD), "--rendezvous", f"127.0.0.1:{free_port()}"]
    common += ["--out", str(out), "--fault", fault]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK), "--rank", str(rank), *common],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(WORLD)
    ]
    reporting = range(WORLD - 1) if fault == "kill" else range(WORLD)
    stuck: dict[int, float] = {}
    try:
        deadline = time.monotonic() + WAIT
        while not all((out / f"rank-{r}.json").exists() or r in stuck for r in reporting):
            for r in reporting:
                if r not in stuck and ranks[r].poll() == group.STUCK_EXIT_CODE:
                    stuck[r] = time.time()
            failed = [r for r in reporting if ranks[r].poll() not in (None, 0) and r not in stuck]
            if failed or time.monotonic() > deadline:
                pytest.fail(f"ranks never all reported: {_outputs(ranks)}")
            time.sleep(0.05)
        for rank in ranks:
            rank.wait(WAIT)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    left = [r for r in reporting if r not in stuck]
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in left}, stuck


def test_every_survivor_is_out_of_its_collective_long_before_its_timeout_after_a_kill(
    tmp_path: Path,
) -> None:
    reports, stuck = run_ranks("kill", tmp_path)
    assert not stuck, stuck  # nobody abandons before its collective fails: none is watched
    killed_at = json.loads((tmp_path / "left.json").read_text())["at"]
    took = {rank: float(str(r["at"])) - killed_at for rank, r in reports.items()}
    assert max(took.values()) < OUT_WITHIN, (took, reports)


def test_every_rank_told_of_a_new_generation_is_out_of_its_collective(
    tmp_path: Path,
) -> None:
    reports, stuck = run_ranks("reconfigure", tmp_path)
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


def _outputs(ranks: list[subprocess.Popen[bytes]]) -> str:
    texts = []
    for number, rank in enumerate(ranks):
        if rank.poll() is None:
            rank.kill()
        output = rank.communicate()[0].decode(errors="replace")
        texts.append(f"rank {number} (exit {rank.returncode}):\n{output[-2000:]}")
    return "\n".join(texts)
