"""Recovery benchmark: the same failures for pitstop, plain torchrun, torchft and NVIDIA's
resiliency extension (NVRx), each under one long run of the example GPT job.

Every system meets, in turn, --failures of each of two kinds (bench/peers.py says how
each peer is set up and how it is failed):

* ``rank_kill``: kill -9 of one rank's process;
* ``node_silent``: a host that dies silently: every process of one node frozen
  (SIGSTOP: no connection reset, its peers blocked on it wait). pitstop's own scheduler
  declares it lost after its liveness deadline (--liveness-seconds) and moves its ranks
  to a spare; for the peers the benchmark plays the cluster manager they rely on, with
  the same deadline, and starts their replacement then.

pitstop also meets --own-failures of each of its own kinds, reported apart: kill -9 of
a whole node (agent, checkpoint daemon, ranks: the connection resets at once), a fatal
Xid (79), a hung agent (SIGSTOP of the agent alone: heartbeats stop, the stream stays
open) and an application Xid (13: the rank dies, the GPU stays).

Per failure, every system: ``to_progress`` (the failure -> any training step committed
again), ``to_full`` (-> the job trains at full strength again: every replica, the whole
world) and ``lost_gpu`` (GPU-seconds of the job's own GPUs not doing kept work because of
the failure: idle, waiting or computing steps again; a spare's GPU, idle anyway, is not
counted); p50, p95 and max per kind, and whether the final weights equal a fault-free
run's. pitstop stops every rank and resumes at full strength, so its to_progress is its
to_full; torchft's survivors go on without the failed replica, so its to_progress comes
first.

pitstop: a local cluster (`pitstop.client.localcluster`, embedded PostgreSQL and Redis,
simulated GPUs) of --workers worker nodes and --spares hot spares runs the example job
(dp = --workers, an in-memory snapshot every step). Warm by default: standby processes
(torch imported) on 2 spares and beside each node's ranks, and a failure waits until the
previous one's recovery was decided and the standby it will need is ready
(`WarmGate`: this run fails the job every few seconds; one failing every few hours
meets each failure that way; the wait is printed). --cold-too runs it again with no
standby processes, for the two shared kinds. Failed nodes come back as spares once the
job has left them. Each pitstop recovery is also split into its phases, from the
benchmark's clock for the failure, the scheduler's goodput incident and the rank logs:

* detect: failure -> the scheduler marks the node (lost or unhealthy) or sees the exit;
* abort: failure -> the last survivor out of its collective (overlaps the others);
* decide: -> the new rank map is committed (spare chosen, restore step picked);
* restore: -> the last rank has loaded the restore step (rank logs);
* re-form: -> the process group is formed again and every rank has taken a step (the
  ranks' own step lines, timed as the peers' are); the scheduler hears of it one step
  report later (`reported`: how much later).

pitstop also trains the 3D example (``pitstop_3d``: tp = pp = dp = 2, a TP pair on
each of four 2-GPU nodes, one block a stage, 1F1B over two microbatches a replica; unpaced, its
steps CPU-bound) through --failures-3d of each shared kind, warm, on a cluster of its
own; a failed node's TP pair moves to a spare together, and every other rank rebuilds
the mesh, its process groups and the parallelized model in place. Its lost GPU-seconds
count its 8 GPUs at the pace its ranks kept.

Each pitstop failure is matched to the incident that ended it: of those the scheduler
noticed between it and the next failure, the one after which the job stepped again
(earlier ones it superseded count in its detect). A failure with none is listed under
`unrecovered`, with why, and the benchmark exits 1 after printing its JSON. A peer that
breaks down (a process exits, a step never comes) is recorded with its error and the
failures it completed, and the benchmark goes on.

    .venv/bin/python bench/recovery.py [--failures 20] [--own-failures 5] [--workers 4]
        [--spares 4] [--liveness-seconds 2] [--failures-3d 20] [--cold-too]
        [--skip torchrun|torchft|nvrx|pitstop] [--insecure-too] [--load [2]]

Run from the repository root (about 50 minutes on 2 cores with every peer, and about an
hour more for the 3D job's 40 failures, each waiting up to a minute for a standby to
import torch beside its 8 busy ranks: --failures-3d 0 leaves it out; the peers
need `pip install -e '.[bench]'`, else they are reported skipped). Progress goes to
stderr; the last line of stdout is one JSON object, with the targets and whether each is
met. A pitstop job that makes no step for 90 s, or a wait that passes its deadline, ends
the benchmark with a message and exit code 1; on any end (Ctrl-C, SIGTERM and SIGHUP
included) the cluster, the peers' processes, the reference runs and the load are
stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pitstop.client.cpuload import DEFAULT_PROCS, MAX_SECONDS, cpu_load
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import DEFAULT_LIVENESS_TIMEOUT, ClusterError
from pitstop.client.scenario import Fault, FaultKind, JobStuck, ReferenceRun
from pitstop.client.signals import Terminated, exit_code, orderly_exit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench import peers
from bench._recovery_pitstop import (
    KINDS,
    REFERENCE_3D_TIMEOUT,
    REPORTED,
    SHARED,
    SILENT_HOST_SECONDS,
    RankTimes,
    Workload,
    run_pitstop,
    say,
    split,
)

__all__ = [  # what tests/unit/test_bench_recovery_split.py reads of the benchmark
    "REPORTED",
    "SHARED",
    "RankTimes",
    "peers",
    "ratios",
    "schedule",
    "split",
    "targets_met",
]


def peer_summary(peer: dict[str, Any], expected: str) -> dict[str, Any]:
    """A peer's run (bench/peers.py) as the JSON reports it: per failure kind, to
    progress, to full strength and the GPU-seconds lost; its hash compared; its config."""
    if "skipped" in peer:
        return {"skipped": peer["skipped"]}
    rows = peer["failures"]
    out: dict[str, Any] = {"failures": len(rows), **peers.by_kind(rows, peers.KINDS)}
    out["wall_seconds"] = round(peer["seconds"], 1)
    if "error" in peer:  # it broke down: what it completed, and why it stopped
        out["error"] = peer["error"]
        out["final_hash_equal"] = False
    else:
        out["final_hash_equal"] = peer["hash"] == expected
        out["hash_note"] = peer.get("hash_note", "")
    out["config"] = peer.get("config", {})
    return out


def pitstop_summary(run: dict[str, Any], expected: str) -> dict[str, Any]:
    """What one pitstop run measured, for the JSON line: the kinds every system meets
    (rank_kill, node_silent) with the same keys as the peers', pitstop's own kinds apart,
    and each kind's recovery split into its phases (medians)."""
    rows = run["failures"]
    own = sorted({r["kind"] for r in rows} - set(peers.KINDS))
    phases = ("detect", "abort", "decide", "restore", "reform", "reported")
    return {
        "failures": run["injected"],
        "recovered": len(rows),
        "unrecovered": run["unrecovered"],
        **peers.by_kind(rows, peers.KINDS),
        "own_kinds": peers.by_kind(rows, own),
        "phases_p50_by_kind": {
            kind: {
                phase: round(statistics.median(r[phase] for r in rows if r["kind"] == kind), 3)
                for phase in phases
            }
            for kind in (*peers.KINDS, *own)
            if any(r["kind"] == kind for r in rows)
        },
        "detect_to_resume_seconds": peers.summary([r["total"] for r in rows]),
        "p50_by_kind": {
            k: round(statistics.median(r["total"] for r in rows if r["kind"] == k), 3)
            for k in (*peers.KINDS, *own)
            if any(r["kind"] == k for r in rows)
        },
        "steps_lost_per_failure": round(run["steps_lost_per_failure"], 2),
        # Recoveries whose deadline passed: a full restart of every rank instead.
        "fallbacks": sum(1 for r in rows if r["fallback"]),
        "goodput": round(run["goodput"], 4),
        "wall_seconds": round(run["seconds"], 1),
        "final_hash_equal": run["job"].result.get("final_weights_sha256") == expected,
        "config": run["config"],
    }


TO_FULL_TARGETS: dict[str, dict[str, float]] = {
    "rank_kill": {"to_full_p50_s": 1.0, "to_full_p95_s": 2.0},
    "node_silent": {"to_full_p50_s": 2.0, "to_full_p95_s": 3.0},
}
TO_FULL_3D_P50 = 3.0
"""The 3D job's to_full p50, per shared kind, at most this many seconds."""
LOST_GPU_OF_BEST_PEER = 1 / 3
"""pitstop's lost GPU-seconds p50, per kind, at most this share of the best peer's."""
TARGETS: dict[str, Any] = {
    **TO_FULL_TARGETS,
    "lost_gpu_p50_of_best_peer": round(LOST_GPU_OF_BEST_PEER, 3),
    "pitstop_3d": {kind: {"to_full_p50_s": TO_FULL_3D_P50} for kind in peers.KINDS},
}


def targets_met(result: dict[str, Any]) -> dict[str, Any]:
    """Each target of the JSON's `targets`, met or not, with the measured number; those
    of a system the run left out are not there."""
    met: dict[str, Any] = {}
    if "pitstop_3d" in result:
        three_d = result["pitstop_3d"]
        met["pitstop_3d"] = {"final_hash_equal": three_d["final_hash_equal"]}
        for kind in peers.KINDS:
            if kind in three_d:
                p50 = three_d[kind]["to_full_s"]["p50"]
                met["pitstop_3d"][f"{kind}_to_full_p50"] = p50 <= TO_FULL_3D_P50
    if "pitstop" not in result:
        return met
    mine = result["pitstop"]
    met["final_hash_equal"] = mine["final_hash_equal"]
    for kind in peers.KINDS:
        if kind not in mine:
            continue
        full = mine[kind]["to_full_s"]
        want = TO_FULL_TARGETS[kind]
        met[f"{kind}_to_full_p50"] = full["p50"] <= want["to_full_p50_s"]
        met[f"{kind}_to_full_p95"] = full["p95"] <= want["to_full_p95_s"]
        theirs = {
            name: result[name][kind]["lost_gpu_s"]["p50"]
            for name in peers.RUNS
            if kind in result.get(name, {})
        }
        if theirs:
            best = min(theirs, key=lambda name: theirs[name])
            ratio = mine[kind]["lost_gpu_s"]["p50"] / theirs[best]
            met[f"{kind}_lost_gpu_p50_over_best_peer"] = {
                "best_peer": best,
                "ratio": round(ratio, 3),
                "met": ratio <= LOST_GPU_OF_BEST_PEER,
            }
    return met


def ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each peer's p50 over pitstop's, per kind, for to_full_s and lost_gpu_s."""
    out: dict[str, dict[str, float]] = {}
    for name in peers.RUNS:
        for kind in peers.KINDS:
            theirs, mine = result.get(name, {}).get(kind), result.get("pitstop", {}).get(kind)
            if theirs is None or mine is None:
                continue
            out[f"{name}_over_pitstop_{kind}"] = {
                key: round(theirs[key]["p50"] / mine[key]["p50"], 2)
                for key in ("to_full_s", "lost_gpu_s")
                if mine[key]["p50"] > 0
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--failures",
        type=int,
        default=20,
        help="failures of each kind every system meets (rank_kill, node_silent)",
    )
    parser.add_argument(
        "--own-failures",
        type=int,
        default=5,
        help="failures of each of pitstop's own kinds (node kill, fatal and application "
        "Xid, hung agent)",
    )
    parser.add_argument("--every", type=int, default=20, help="steps between failures")
    parser.add_argument(
        "--slack-steps",
        type=int,
        default=100,
        help="pitstop's job runs this many steps more per failure: room for the waits for "
        "warm standbys and the recoveries (48 failures took 65 steps each on this 2-core "
        "machine, the 20 between them included; steps left over run after the last one)",
    )
    parser.add_argument(
        "--failures-3d",
        type=int,
        default=20,
        help="failures of each kind every system meets for the 3D job (pitstop_3d: tp = pp "
        "= dp = 2, a TP pair on each of 4 two-GPU nodes); 0 leaves it out",
    )
    parser.add_argument(
        "--every-3d", type=int, default=5, help="the 3D job's steps between failures"
    )
    parser.add_argument(
        "--slack-steps-3d",
        type=int,
        default=80,
        help="the 3D job runs this many steps more per failure: room for its waits for warm "
        "standbys (here its steps take 0.7 s, and a standby imports torch for up to a "
        "minute beside 8 busy ranks)",
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--spares", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--save-every", type=int, default=25, help="torchrun's torch.save")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=(*peers.RUNS, "pitstop"),
        help="leave a system out (repeat for more; pitstop: its data-parallel run, not the "
        "3D one); a peer whose package is missing is reported skipped (pip install -e "
        "'.[bench]')",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (logs, rank logs)"
    )
    parser.add_argument(
        "--liveness-seconds",
        type=float,
        default=DEFAULT_LIVENESS_TIMEOUT,
        help="pitstop's heartbeat deadline: an agent hung this long (its connection still "
        "answering) is lost; a host gone silent is lost sooner, by the connection's "
        "keepalive (the local cluster's, 1 s, which the peers' cluster manager uses too)",
    )
    parser.add_argument(
        "--cold-too",
        action="store_true",
        help="also run pitstop with no standby processes (every replacement starts cold), "
        "for the kinds every system meets",
    )
    parser.add_argument(
        "--insecure-too",
        action="store_true",
        help="also run pitstop insecure (plaintext, open API) after the secure default, "
        "and report what TLS and enrollment cost",
    )
    parser.add_argument(
        "--load",
        type=int,
        nargs="?",
        const=DEFAULT_PROCS,
        default=0,
        metavar="PROCS",
        help=f"run PROCS busy processes beside the benchmark (default {DEFAULT_PROCS})",
    )
    args = parser.parse_args()
    with orderly_exit(notice=say):
        try:
            return measure(args)
        except (KeyboardInterrupt, Terminated) as stop:
            say(f"{'Ctrl-C' if isinstance(stop, KeyboardInterrupt) else stop}: stopped")
            return exit_code(stop)
        except (
            JobStuck,
            ClusterError,
            PitstopError,
            RuntimeError,
            subprocess.TimeoutExpired,
        ) as exc:
            say(f"error: {exc}")
            return 1


def measure(args: argparse.Namespace) -> int:
    faults = schedule(args.failures, args.own_failures, args.every)
    cold_faults = schedule(args.failures, 0, args.every)
    # Room for each failure's wait for a warm standby and its recovery.
    steps = (args.every + args.slack_steps) * (len(faults) + 1)
    cold_steps = (args.every + args.slack_steps) * (len(cold_faults) + 1)
    peer_steps = peers.run_steps(args.failures, args.every)
    faults_3d = schedule(args.failures_3d, 0, args.every_3d)
    steps_3d = (args.every_3d + args.slack_steps_3d) * (len(faults_3d) + 1)
    data_parallel = "pitstop" not in args.skip
    root = Path(tempfile.mkdtemp(prefix="pitstop-recovery-"))
    try:
        with contextlib.ExitStack() as stack:
            if args.load:
                stack.enter_context(cpu_load(args.load, MAX_SECONDS))
                say(f"CPU load: {args.load} busy processes beside the benchmark")
            lengths = (
                ({steps} if data_parallel else set())
                | ({peer_steps} if set(peers.RUNS) - set(args.skip) else set())
                | ({cold_steps} if args.cold_too and data_parallel else set())
            )
            expected, expected_3d = reference_hashes(lengths, steps_3d if faults_3d else 0)
            peer_runs: dict[str, dict[str, Any]] = {}
            # The peers first, on a quiet machine: torchrun run after the local cluster
            # once hung forming its group (not understood; see the README).
            for name, run in peers.RUNS.items():
                if name in args.skip:
                    continue
                began = time.monotonic()
                try:
                    peer_runs[name] = run(
                        workers=args.workers,
                        steps=peer_steps,
                        step_seconds=args.step_seconds,
                        failures=args.failures,
                        every=args.every,
                        silent_after=SILENT_HOST_SECONDS,
                        root=root / name,
                        say=say,
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # set-up broke
                    say(f"{name}: {exc}; the benchmark goes on without it")
                    seconds = time.monotonic() - began
                    peer_runs[name] = {"failures": [], "seconds": seconds, "error": str(exc)}
            pitstop = run_pitstop(args, faults, steps, root) if data_parallel else None
            cold = (
                run_pitstop(args, cold_faults, cold_steps, root, cold=True)
                if args.cold_too and data_parallel
                else None
            )
            insecure = (
                run_pitstop(args, faults, steps, root, insecure=True)
                if args.insecure_too and data_parallel
                else None
            )
            three_d = (
                run_pitstop(args, faults_3d, steps_3d, root, workload=Workload.three_d(args))
                if faults_3d
                else None
            )
    finally:
        if args.keep:
            say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "recovery",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpus": os.cpu_count()},
        "command": " ".join(sys.argv),
        "workers": args.workers,
        "spares": args.spares,
        "steps": {
            "pitstop": steps,
            "peers": peer_steps,
            **({"pitstop_3d": steps_3d} if faults_3d else {}),
        },
        "step_seconds": args.step_seconds,
        "liveness_timeout_seconds": args.liveness_seconds,
        "silent_host_timeout_seconds": SILENT_HOST_SECONDS,
        "cpu_load_procs": args.load,
    }
    if pitstop is not None:
        result["pitstop"] = pitstop_summary(pitstop, expected[steps])
    if three_d is not None:
        result["pitstop_3d"] = pitstop_summary(three_d, expected_3d)
    if cold is not None:
        result["pitstop_cold"] = pitstop_summary(cold, expected[cold_steps])
    if insecure is not None:
        result["pitstop_insecure"] = pitstop_summary(insecure, expected[steps])
        result["secure_over_insecure_p50"] = round(
            result["pitstop"]["detect_to_resume_seconds"]["p50"]
            / result["pitstop_insecure"]["detect_to_resume_seconds"]["p50"],
            3,
        )
    for name, peer in peer_runs.items():
        result[name] = peer_summary(peer, expected[peer_steps])
    result["ratios"] = ratios(result)
    result["targets"] = TARGETS
    result["met"] = targets_met(result)
    print(json.dumps(result))
    unrecovered = [
        f
        for r in ("pitstop", "pitstop_cold", "pitstop_insecure", "pitstop_3d")
        for f in result.get(r, {}).get("unrecovered", [])
    ]
    if unrecovered:
        say(f"error: {len(unrecovered)} failure(s) not recovered from (see the JSON)")
        return 1
    return 0


def reference_hashes(step_counts: set[int], steps_3d: int) -> tuple[dict[int, str], str]:
    """The fault-free final hash for each run length of the example, and for `steps_3d`
    steps of the 3D one (0: none, ""), the runs side by side."""
    with contextlib.ExitStack() as stack:
        runs = {steps: stack.enter_context(ReferenceRun(steps)) for steps in step_counts}
        run_3d = stack.enter_context(ReferenceRun(steps_3d, three_d=True)) if steps_3d else None
        hashes = {steps: run.final_hash() for steps, run in runs.items()}
        return hashes, run_3d.final_hash(timeout=REFERENCE_3D_TIMEOUT) if run_3d else ""


def schedule(failures: int, own: int, every: int) -> list[Fault]:
    """`failures` of each kind every system meets and `own` of each of pitstop's own,
    interleaved, one due every `every` steps."""
    counts = {kind: failures if kind in SHARED else own for kind in KINDS}
    kinds: list[FaultKind] = []
    while any(counts.values()):
        for kind in KINDS:
            if counts[kind]:
                kinds.append(kind)
                counts[kind] -= 1
    return [Fault(every * (i + 1), kind) for i, kind in enumerate(kinds)]


if __name__ == "__main__":
    sys.exit(main())
