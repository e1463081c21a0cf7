"""Runs the ranks of tests/integration/abandon_rank.py for the abandon tests: the gloo one
(tests/integration/test_abandon.py) and the NCCL one (tests/gpu/test_gpu_nccl_abandon.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit.ports import free_port
from pitstop.trainer import group

RANK = Path(__file__).resolve().parents[1] / "integration" / "abandon_rank.py"


def run_ranks(
    fault: str, out: Path, world: int, wait: float, cuda: bool = False
) -> tuple[dict[int, dict[str, object]], dict[int, float]]:
    """Start `world` ranks, wait (up to `wait` seconds) for every rank that was not
    killed to report, or to exit stuck. Returns the reports, and when each stuck rank's
    exit was seen."""
    common = ["--world", str(world), "--rendezvous", f"127.0.0.1:{free_port()}"]
    common += ["--out", str(out), "--fault", fault, *(["--cuda"] if cuda else [])]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK), "--rank", str(rank), *common],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    reporting = range(world - 1) if fault == "kill" else range(world)
    stuck: dict[int, float] = {}
    try:
        deadline = time.monotonic() + wait
        while not all((out / f"rank-{r}.json").exists() or r in stuck for r in reporting):
            for r in reporting:
                if r not in stuck and ranks[r].poll() == group.STUCK_EXIT_CODE:
                    stuck[r] = time.time()
            failed = [r for r in reporting if ranks[r].poll() not in (None, 0) and r not in stuck]
            if failed or time.monotonic() > deadline:
                pytest.fail(f"ranks never all reported: {_outputs(ranks)}")
            time.sleep(0.05)  # a poll of the ranks' reports, bounded by the deadline
        for rank in ranks:
            rank.wait(wait)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    left = [r for r in reporting if r not in stuck]
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in left}, stuck


def _outputs(ranks: list[subprocess.Popen[bytes]]) -> str:
    texts = []
    for number, rank in enumerate(ranks):
        if rank.poll() is None:
            rank.kill()
        output = rank.communicate()[0].decode(errors="replace")
        texts.append(f"rank {number} (exit {rank.returncode}):\n{output[-3000:]}")
    return "\n".join(texts)
