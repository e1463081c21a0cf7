"""`group.abandon()` on NCCL: two real ranks, one GPU each, in pitstop's NCCL group
(collective timeout 60 s), all-reduce in a loop. Each is told of a new generation from
another thread (the second 0.1 s after the first), as its command reader is when a
Reconfigure arrives; abandoning aborts the NCCL communicator. The first told leaves its
all-reduce, which leaves its peer blocked in one that cannot complete until it is told
in turn. Both must be out, alive, long before the 60 s timeout; how long it took is
printed. (The gloo twin is tests/integration/test_abandon.py.) NCCL refuses two ranks on
one GPU, so this needs two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.abandon import run_ranks
from kit.gpu import cuda, machine, needs_two_gpus, report
from kit.hardware import NO_HARDWARE

pytestmark = [pytest.mark.gpu, needs_two_gpus, pytest.mark.timeout(180)]

WORLD = 2
# Seconds from being told to out of the collective: far below the 60 s a rank that does
# not abandon waits, far above what it takes. A hang guard, not a speed bound.
OUT_WITHIN = 10.0
WAIT = 90.0  # for the processes to start, form the group (NCCL's first init) and report


def test_both_nccl_ranks_leave_a_blocked_collective_once_told(tmp_path: Path) -> None:
    torch = cuda()
    if torch.cuda.device_count() < WORLD:
        pytest.skip(
            f"{NO_HARDWARE}NCCL refuses two ranks on one GPU: {WORLD} ranks need {WORLD} "
            f"GPUs visible to CUDA, and {torch.cuda.device_count()} are"
        )
    reports, stuck = run_ranks("reconfigure", tmp_path, WORLD, WAIT, cuda=True)
    told = {
        rank: float(json.loads((tmp_path / f"told-{rank}.json").read_text())["at"])
        for rank in range(WORLD)
        if (tmp_path / f"told-{rank}.json").exists()
    }
    first_told = min(told.values())
    out_at = {rank: float(str(r["at"])) for rank, r in reports.items()}
    numbers = {
        **machine(),
        "ranks": WORLD,
        "backend": sorted({str(r["backend"]) for r in reports.values()}),
        "out_after_told_s": {r: round(out_at[r] - told[r], 4) for r in out_at if r in told},
        "both_out_after_first_told_s": round(max(out_at.values(), default=0.0) - first_told, 4),
        "stuck_exit_seen_after_told_s": {r: round(at - told[r], 4) for r, at in stuck.items()},
        "errors": {r: str(rep["error"]) for r, rep in reports.items()},
    }
    report("nccl_abandon", numbers)
    # The communicator's abort ends a blocked NCCL collective: no rank is left to exit
    # stuck (gloo's partly written send, which only a process exit ends, has no twin here).
    assert not stuck, numbers
    assert set(reports) == set(range(WORLD)), numbers
    assert all(rep["backend"] == "nccl" for rep in reports.values()), numbers
    for rank, at in out_at.items():
        if rank in told and told[rank] <= at:  # else out before told: its peer's abort
            assert at - told[rank] < OUT_WITHIN, (rank, numbers)
    assert max(out_at.values()) - first_told < OUT_WITHIN, numbers
