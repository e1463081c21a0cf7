"""bench/peers.py's torchft run: replica groups under torchft's lighthouse, each failure
and the quorum that goes on without it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench._peers_costs import (
    bury,
    freeze,
    kinds_in_turn,
    lost_gpu_survivors_go_on,
    silent_host_config,
    victim_index,
)
from bench._peers_procs import (
    BIN,
    HEARTBEAT_TIMEOUT_MS,
    JOIN_TIMEOUT_MS,
    LIGHTHOUSE_SOURCE,
    QUORUM_TICK_MS,
    STOP_SECONDS,
    TORCHFT_TRAIN,
    WAIT_SECONDS,
    Processes,
    broke_down,
    final_hashes,
    finished,
    hash_note,
    processes,
    step_line,
)

# torchft -------------------------------------------------------------------------------


def run_torchft(
    *,
    workers: int,
    steps: int,
    step_seconds: float,
    failures: int,
    every: int,
    silent_after: float,
    root: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The example under torchft, `workers` replica groups of one process, `failures` of
    each kind (KINDS) in turn, one every `every` steps. {"failures": [rows], "seconds",
    "hash", "hash_note", "config"}; {"skipped": why} without torchft."""
    lighthouse_bin = BIN / "torchft_lighthouse"
    if not lighthouse_bin.exists():
        return {"skipped": f"no {lighthouse_bin}: pip install torchft==0.2.0 (pitstop[bench])"}
    root.mkdir(parents=True, exist_ok=True)
    say(f"torchft: {workers} replica groups, {failures} failures of each kind")
    started = time.monotonic()
    with processes() as procs:
        address = start_lighthouse(procs, lighthouse_bin, root / "torchft-lighthouse.log")
        barrier = root / "torchft-barrier"
        shutil.rmtree(barrier, ignore_errors=True)
        command = ["--steps", str(steps), "--step-seconds", str(step_seconds), "--log-every", "1"]

        def start(replica: int, generation: int) -> int:
            together = ["--barrier", str(barrier), "--replicas", str(workers)]
            argv = [sys.executable, str(TORCHFT_TRAIN), "--replica", str(replica)]
            argv += ["--lighthouse", address, *(together if generation == 0 else []), *command]
            return procs.start(argv, root / f"torchft-{replica}-{generation}.log")

        current = {replica: start(replica, 0) for replica in range(workers)}
        rows: list[dict[str, Any]] = []
        config: dict[str, Any] = {
            "replica_groups": workers,
            "processes_per_group": 1,
            "lighthouse": {
                "min_replicas": 1,
                "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                "join_timeout_ms": JOIN_TIMEOUT_MS,
                "quorum_tick_ms": QUORUM_TICK_MS,
                "source": LIGHTHOUSE_SOURCE,
            },
            "restart": "rank_kill: the killed replica's process started again at once "
            "(torchx, SLURM); it heals from a peer while the survivors go on",
            "silent_host": silent_host_config(silent_after),
            "replacement": "cold: a new process (Python, torch import, Manager)",
        }
        try:
            first = procs.wait(lambda line: "torchft_config" in line.fields, "torchft's config")
            config["replica"] = first.fields["torchft_config"]
            for index, kind in enumerate(kinds_in_turn(failures)):
                rows.append(
                    torchft_failure(
                        procs, current, start, index, kind, every, step_seconds, silent_after
                    )
                )
                row = rows[-1]
                say(
                    f"torchft: {kind} {index + 1} (replica {row['victim']}): training again "
                    f"after {row['to_progress']:.1f} s, whole again after {row['to_full']:.1f} "
                    f"s, {row['lost_gpu']:.1f} GPU-s lost, {row['lost_steps']:.0f} steps run twice"
                )
            finished(procs, list(current.values()), "a torchft replica")
        except (RuntimeError, subprocess.TimeoutExpired, psutil.Error) as exc:  # recorded
            return broke_down("torchft", exc, rows, 2 * failures, started, config, say)
        hashes = final_hashes(procs, current)
    return {
        "failures": rows,
        "seconds": time.monotonic() - started,
        "hash": hashes.get(0, ""),
        "hash_note": hash_note(hashes, workers)
        + "; the gradient exchange keeps the example's shards (an allreduce of per-shard "
        "rows), so a quorum of fewer replicas computes the same global batch",
        "config": config,
    }


def torchft_failure(
    procs: Processes,
    current: dict[int, int],
    start: Callable[[int, int], int],
    index: int,
    kind: str,
    every: int,
    step_seconds: float,
    silent_after: float,
) -> dict[str, Any]:
    """Fail one replica at step `every * (index + 1)` and follow it until the job is
    whole again: its row."""
    workers = len(current)
    target = every * (index + 1)
    procs.wait(step_line(above=target - 1), f"torchft: step {target}")
    # Half a step on: the replicas are computing. Failed as the step line comes, the
    # victim would go before asking for its next quorum, torchft's best case (the
    # survivors wait for the quorum, no step fails).
    time.sleep(step_seconds / 2)
    victim = victim_index(index, workers)
    old = procs.started[current[victim]]
    failed_at = time.time()
    frozen: list[int] = []
    if kind == "rank_kill":
        os.kill(old.pid, signal.SIGKILL)
        old.wait(timeout=STOP_SECONDS)
    else:
        frozen = freeze(old.pid)
        # The cluster manager's deadline for a silent host: a timer, not a wait on torchft.
        time.sleep(max(0.0, failed_at + silent_after - time.time()))
    current[victim] = start(victim, index + 1)
    survivors = {s for r, s in current.items() if r != victim}
    what = f"torchft {kind} {index + 1}"
    again = procs.wait(
        step_line(sources=survivors, quorum_after=failed_at),
        f"{what}: a survivor's step in a quorum formed after the failure",
    )
    back = procs.wait(
        step_line(sources={current[victim]}), f"{what}: the replacement of replica {victim}"
    )
    if frozen:
        bury(frozen)
        old.wait(timeout=STOP_SECONDS)
    redone = {
        line.fields["redo_step"]
        for line in procs.between(failed_at, max(again.at, back.at))
        if "redo_step" in line.fields
    }
    to_progress, to_full = again.at - failed_at, back.at - failed_at
    return {
        "kind": kind,
        "victim": victim,
        "to_progress": to_progress,
        "to_full": to_full,
        "lost_gpu": lost_gpu_survivors_go_on(workers, to_progress, to_full),
        "lost_steps": float(len(redone)),
    }


def start_lighthouse(procs: Processes, binary: Path, log: Path) -> str:
    """Start torchft's lighthouse on a free port; its address."""
    argv = [str(binary), "--bind", "[::]:0", "--min_replicas", "1"]
    argv += [
        f"--heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_MS}",
        f"--join_timeout_ms={JOIN_TIMEOUT_MS}",
        f"--quorum_tick_ms={QUORUM_TICK_MS}",
    ]
    procs.start(argv, log, follow=False)
    deadline = time.monotonic() + WAIT_SECONDS
    marker = "Lighthouse listening on: "
    while time.monotonic() < deadline:
        for text in log.read_text(errors="replace").splitlines():
            if marker in text:
                return text.split(marker, 1)[1].strip()
        if procs.started[-1].poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"torchft's lighthouse never said its address; see {log}")
