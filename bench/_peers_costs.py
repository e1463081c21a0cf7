"""bench/peers.py's failures and what they cost: the kinds every system meets in turn,
how a failure is injected (a rank killed, a host frozen), and the costs summarized per
kind (bench/recovery.py reads these too)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Collection
from typing import Any

import psutil

# Failures and what they cost -----------------------------------------------------------

KINDS = ("rank_kill", "node_silent")
"""The failures every system meets, in turn."""


def kinds_in_turn(failures: int) -> list[str]:
    """`failures` of each kind, alternating."""
    return [KINDS[i % len(KINDS)] for i in range(len(KINDS) * failures)]


def victim_index(failure: int, workers: int) -> int:
    """Which rank or replica the `failure`-th one hits: each kind meets every one in turn."""
    return (failure // len(KINDS)) % workers


def run_steps(failures: int, every: int) -> int:
    """The steps a peer's run needs for `failures` of each kind every `every` steps,
    with room after the last (a reload may go back up to --save-every steps)."""
    return every * (len(KINDS) * failures + 1) + 60


def freeze(pid: int) -> list[int]:
    """A host dying silently: SIGSTOP `pid` (first, so it starts nothing more) and every
    process under it. The pids stopped."""
    root = psutil.Process(pid)
    root.send_signal(signal.SIGSTOP)
    stopped = [pid]
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGSTOP)
            stopped.append(child.pid)
    return stopped


def bury(pids: list[int]) -> None:
    """The dead host powered off: kill its frozen processes (SIGKILL ends a stopped one)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def lost_gpu_all_restart(
    workers: int, to_full: float, lost_steps: float, step_seconds: float
) -> float:
    """GPU-seconds lost when every worker stops and restarts: every GPU of the job from
    the failure until it trains again, then the steps since the restore point run again
    on every one."""
    return workers * (to_full + lost_steps * step_seconds)


def lost_gpu_survivors_go_on(workers: int, to_progress: float, to_full: float) -> float:
    """GPU-seconds lost when the survivors go on without the failed replica (torchft):
    theirs until their new quorum commits a step, the failed slot's until its
    replacement commits one. Committed steps are never run again."""
    return (workers - 1) * to_progress + to_full


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 0.5), 3),
        "p95": round(percentile(values, 0.95), 3),
        "max": round(max(values), 3) if values else float("nan"),
    }


def by_kind(rows: list[dict[str, Any]], kinds: Collection[str]) -> dict[str, dict[str, Any]]:
    """Per failure kind: how many, and the p50/p95/max of to_progress_s, to_full_s and
    lost_gpu_s, with the mean steps run again."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        mine = [row for row in rows if row["kind"] == kind]
        if not mine:
            continue
        out[kind] = {
            "failures": len(mine),
            "to_progress_s": summary([row["to_progress"] for row in mine]),
            "to_full_s": summary([row["to_full"] for row in mine]),
            "lost_gpu_s": summary([row["lost_gpu"] for row in mine]),
            "steps_lost_per_failure": round(sum(row["lost_steps"] for row in mine) / len(mine), 2),
        }
    return out


def silent_host_config(silent_after: float) -> str:
    return (
        f"node_silent: the node's processes frozen (SIGSTOP); the benchmark, as the "
        f"cluster manager, starts a replacement after {silent_after:g} s (when "
        f"pitstop's scheduler has lost a silent host, at the latest) and kills the "
        f"frozen processes once the job is whole again"
    )
