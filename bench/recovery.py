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
each of four 2-GPU nodes, one block a stage, 1F1B over two microbatches; unpaced, its
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
import bisect
import contextlib
import datetime as dt
import importlib
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.client.cpuload import DEFAULT_PROCS, MAX_SECONDS, cpu_load
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import (
    DEFAULT_LIVENESS_TIMEOUT,
    SCHEDULER_ENV,
    ClusterError,
    running_cluster,
    silent_host_of,
)
from pitstop.client.scenario import (
    Driver,
    Fault,
    FaultKind,
    Injected,
    JobStuck,
    ReferenceRun,
    example3d_spec,
    example_spec,
)
from pitstop.client.signals import Terminated, exit_code, orderly_exit
from pitstop.v1 import common_pb2, jobs_pb2

# bench/peers.py, the torchft and NVRx runs: a script's own directory is first on sys.path.
peers = importlib.import_module("peers")

REFERENCE_3D_TIMEOUT = 3600.0
"""Seconds the 3D job's fault-free run may take (its steps are CPU-bound: 0.4 s here)."""
SILENT_HOST_SECONDS = silent_host_of({**SCHEDULER_ENV, **os.environ})
"""When the local cluster's scheduler has lost a host gone silent, at the latest (its
keepalive interval plus the ping's timeout): the peers' cluster manager waits as long."""
RESTORED = re.compile(r"^(\S+ \S+) pitstop\.trainer\.session rank (\d+) restored step (\d+)")
LEFT = re.compile(
    r"^(\S+ \S+) pitstop\.trainer\."
    r"(?:group abandoned the process group|recovery rank \d+ lost a peer)"
)
STEP_LINE = re.compile(r'^\{"rank": (\d+), "step": (\d+), ')
JOINED = re.compile(r"^(\S+ \S+) pitstop\.trainer\.recovery rank (\d+) joined generation ")
KINDS: tuple[FaultKind, ...] = (
    "node_kill",
    "xid",
    "agent_hang",
    "rank_kill",
    "app_xid",
    "node_freeze",
)
ON_A_SPARE: tuple[FaultKind, ...] = ("node_kill", "xid", "agent_hang", "node_freeze")
"""The kinds that move the node's ranks to a spare (the others restart them in place)."""
REPORTED: dict[FaultKind, str] = {"node_freeze": "node_silent"}
"""The scenario's kinds under the names every system's results share (bench/peers.py)."""
SHARED: tuple[FaultKind, ...] = ("rank_kill", "node_freeze")
"""The kinds every system meets; the others are pitstop's own."""


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def log_time(text: str) -> float:
    """A rank log's timestamp (the ranks log in the machine's local time)."""
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


# pitstop -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The job a pitstop run trains: its nodes, their GPUs, its ranks, and its spec."""

    name: str  # in the output
    nodes: int
    gpus_per_node: int
    ranks: int
    every: int  # steps between failures
    step_seconds: float | None  # the pace; None: unpaced, measured from its step lines
    spec: Callable[[int], jobs_pb2.JobSpec]  # steps -> spec

    @classmethod
    def data_parallel(cls, args: argparse.Namespace) -> Workload:
        """The example GPT job, one rank on each of --workers nodes."""
        return cls(
            "pitstop",
            args.workers,
            1,
            args.workers,
            args.every,
            args.step_seconds,
            lambda steps: example_spec(
                "bench-recovery",
                dp=args.workers,
                steps=steps,
                step_seconds=args.step_seconds,
                # Two spares hold standby processes: the one a failure takes is started
                # again while the other waits, ready for the next.
                spares=2,
            ),
        )

    @classmethod
    def three_d(cls, args: argparse.Namespace) -> Workload:
        """The 3D example (tp = pp = dp = 2): a TP pair on each of four 2-GPU nodes,
        unpaced (its steps are CPU-bound here)."""
        return cls(
            "pitstop_3d",
            4,
            2,
            8,
            args.every_3d,
            None,
            lambda steps: example3d_spec(
                "bench-recovery-3d", steps=steps, step_seconds=0.0, spares=2
            ),
        )


def run_pitstop(
    args: argparse.Namespace,
    faults: list[Fault],
    steps: int,
    root: Path,
    insecure: bool = False,
    cold: bool = False,
    workload: Workload | None = None,
) -> dict[str, Any]:
    work = workload or Workload.data_parallel(args)
    label = work.name + (" (insecure)" if insecure else "") + (" (cold)" if cold else "")
    say(
        f"{label}: {work.nodes} workers of {work.gpus_per_node} GPU(s) + {args.spares} "
        f"spares, {len(faults)} failures, a host gone silent lost within "
        f"{SILENT_HOST_SECONDS:g} s, a hung agent after {args.liveness_seconds:g} s"
    )
    with running_cluster(
        root / f"cluster-{work.name}{'-insecure' if insecure else ''}{'-cold' if cold else ''}",
        nodes=work.nodes,
        spares=args.spares,
        gpus_per_node=work.gpus_per_node,
        port=0,
        liveness_timeout=args.liveness_seconds,
        insecure=insecure,
    ) as cluster:
        spec = work.spec(steps)
        spec.standby_processes = not cold

        client = cluster.client(timeout=10.0)
        gate = WarmGate(client, cold=cold)

        def on_fault(injected: Injected) -> None:
            waited = gate.waited
            say(
                f"{label}: {injected.fault.kind} on {injected.node_id} at step {injected.step}"
                + (f" (waited {waited:.1f} s for warm standbys)" if waited > 0.5 else "")
            )

        # The job's account keeps only its newest incidents (50): each is gathered as it
        # comes, the newest version of each (its outcome is settled later).
        incidents: dict[tuple[str, float], jobs_pb2.GoodputIncident] = {}

        def on_step(job: jobs_pb2.Job) -> None:
            for incident in job.goodput.incidents:
                kept = jobs_pb2.GoodputIncident()
                kept.CopyFrom(incident)
                incidents[(incident.cause, incident.detected_at)] = kept

        try:
            with Driver(
                cluster,
                on_step=on_step,
                on_fault=on_fault,
                on_problem=say,
                seed=args.seed,
                spacing=work.every,
                ready=gate.ready,
            ) as driver:
                run = driver.run(spec, faults)
        finally:
            client.close()
        job = run.job
        logs = sorted((cluster.state_dir / "nodes").glob(f"*/agent/ranks/{job.id}/rank-*.log"))
        restores: list[float] = []
        left: list[float] = []
        ranks = RankTimes()
        step_lines = 0
        for path in logs:
            for line in path.read_text(errors="replace").splitlines():
                if (m := RESTORED.match(line)) is not None:
                    restores.append(log_time(m.group(1)))
                elif (m := LEFT.match(line)) is not None:
                    left.append(log_time(m.group(1)))
                elif (m := JOINED.match(line)) is not None:
                    ranks.joined.append((log_time(m.group(1)), int(m.group(2))))
                elif (m := STEP_LINE.match(line)) is not None:
                    step_lines += 1
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        ranks.stepped.append((float(json.loads(line)["at"]), int(m.group(1))))
    if job.state != common_pb2.JOB_STATE_SUCCEEDED:
        raise SystemExit(f"pitstop: job ended {common_pb2.JobState.Name(job.state)}: {job.reason}")
    on_step(job)
    every = jobs_pb2.Goodput()
    every.incidents.extend(sorted(incidents.values(), key=lambda i: i.detected_at))
    per_failure, missed = split(every, run.injected, restores, left, ranks)
    # A failure the job ended before is one not measured: said, and the run fails.
    missed += [
        {
            "kind": fault.kind,
            "node": "",
            "step": fault.at_step,
            "why": "never injected: the job ended first (its waits for a warm standby "
            "used up the steps; give it more with --slack-steps)",
        }
        for fault in faults[len(run.injected) :]
    ]
    for failure in missed:
        say(
            f"{label}: {failure['kind']} on {failure['node']} at step {failure['step']}: "
            f"{failure['why']}"
        )
    step_seconds = work.step_seconds if work.step_seconds is not None else ranks.step_seconds()
    for row in per_failure:
        # Every rank stops and resumes at full strength: training again is whole again.
        row["to_progress"] = row["to_full"] = row["total"]
        row["lost_steps"] = row["lost_steps_seen"]
        row["lost_gpu"] = peers.lost_gpu_all_restart(
            work.ranks, row["stalled"], row["lost_steps"], step_seconds
        )
        say(
            f"{label}: {row['kind']}: {row['total']:.2f} s = detect "
            f"{row['detect']:.2f} + decide {row['decide']:.2f} + restore {row['restore']:.2f} "
            f"+ re-form {row['reform']:.2f} (survivors out of their collective after "
            f"{row['abort']:.2f} s)"
        )
    redone = step_lines - steps * work.ranks
    return {
        "job": job,
        "failures": per_failure,
        "unrecovered": missed,
        "injected": len(run.injected),
        "seconds": run.seconds,
        "steps_lost_per_failure": redone / work.ranks / max(len(run.injected), 1),
        "goodput": job.goodput.ratio,
        "config": {
            "workers": work.nodes,
            "gpus_per_node": work.gpus_per_node,
            "ranks": work.ranks,
            "mesh": {"dp": spec.dp, "pp": spec.pp or 1, "tp": spec.tp or 1},
            "command": " ".join(spec.command[1:]),
            "step_seconds": round(step_seconds, 3),
            "steps_between_failures": work.every,
            "spares": args.spares,
            "liveness_timeout_s": args.liveness_seconds,
            "silent_host_timeout_s": SILENT_HOST_SECONDS,
            "snapshot": "in memory every step, a copy on a buddy node",
            "replacement": "cold: no standby processes, a new rank process per replacement"
            if cold
            else "warm: a standby process with torch imported on 2 spares and beside each "
            "node's ranks; each failure waits until one is ready (printed)",
            "security": "plaintext, open API" if insecure else "mutual TLS, enrollment",
        },
    }


class WarmGate:
    """When the next failure may come. This run fails the job every few seconds; a job
    failing every few hours would meet each failure recovered from the one before, with
    its standbys warm and its nodes quiet (on this one machine, a standby importing torch
    for one simulated node slows the recovery of the others). So a failure waits until
    the previous one's recovery was decided (the job's generation moved on, and it steps
    again) and, for one that moves a node's ranks, a spare holds a standby of the job
    done importing; for one that restarts a rank in place, each of the job's nodes holds
    one beside its ranks. The wait is reported with each failure. Cold (no standby
    processes): only the recovery is waited for."""

    CHECK_SECONDS = 0.5

    def __init__(self, client: Any, cold: bool = False) -> None:
        self.client = client
        self.cold = cold
        self.due_at = 0.0  # when the pending failure fell due
        self.waited = 0.0  # how long the last failure waited after it fell due
        self.generation = -1  # the job's generation when the previous failure came
        self.checked_at = 0.0

    def ready(self, job: jobs_pb2.Job, fault: Fault) -> bool:
        now = time.time()
        if not self.due_at:
            self.due_at = now
        if job.generation <= self.generation or now < self.checked_at + self.CHECK_SECONDS:
            return False
        self.checked_at = now
        try:
            warm = self._warm(job, fault.kind)
        except PitstopError:
            return False
        if warm:
            self.generation, self.waited, self.due_at = job.generation, now - self.due_at, 0.0
        return warm

    def _warm(self, job: jobs_pb2.Job, kind: str) -> bool:
        if self.cold:
            return True
        nodes = {a.node_id for a in job.rank_map.ranks}
        if kind in ON_A_SPARE:
            # A spare that took a node's ranks keeps its role; its standby beside them
            # is no replacement for another node.
            spares = [
                n.id
                for n in self.client.list_nodes()
                if n.role == common_pb2.NODE_ROLE_SPARE and n.id not in nodes
            ]
            return any(job.id in self.client.get_node(n).standby_job_ids for n in spares)
        return all(job.id in self.client.get_node(n).standby_job_ids for n in nodes)


ENDED_BY = (jobs_pb2.INCIDENT_OUTCOME_RESUMED, jobs_pb2.INCIDENT_OUTCOME_JOB_SUCCEEDED)
"""The outcomes of the incident that ends a failure: the job stepped again."""


@dataclass
class RankTimes:
    """From the rank logs: when each rank joined a generation, and when it took each
    step (the example's step lines say), as (epoch seconds, rank)."""

    joined: list[tuple[float, int]] = field(default_factory=list)
    stepped: list[tuple[float, int]] = field(default_factory=list)

    def step_seconds(self) -> float:
        """The median time between one rank's consecutive steps (0 without any)."""
        by_rank: dict[int, list[float]] = {}
        for at, rank in self.stepped:
            by_rank.setdefault(rank, []).append(at)
        gaps = [
            later - earlier
            for times in by_rank.values()
            for earlier, later in itertools.pairwise(sorted(times))
        ]
        return statistics.median(gaps) if gaps else 0.0

    def whole_again(self, failed: float, resumed: float) -> float:
        """When every rank that joined a new generation between the failure and the
        scheduler's word that the job steps again (`resumed`) had taken its first step
        in it: the job at full strength, timed as the peers' are (each rank's first
        step after the reload). `resumed` where the logs do not say."""
        last_join: dict[int, float] = {}
        for at, rank in self.joined:
            if failed <= at <= resumed:
                last_join[rank] = max(at, last_join.get(rank, at))
        steps: dict[int, list[float]] = {}
        for at, rank in sorted(self.stepped):
            steps.setdefault(rank, []).append(at)
        firsts = []
        for rank, joined in last_join.items():
            mine = steps.get(rank, [])
            after = bisect.bisect_left(mine, joined)
            if after == len(mine):
                return resumed
            firsts.append(mine[after])
        return max(firsts, default=resumed)


def split(
    goodput: jobs_pb2.Goodput,
    injected: list[Injected],
    restores: list[float],
    left: list[float],
    ranks: RankTimes | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per failure: detect, decide, restore, re-form and total seconds (to when every
    rank stepped again, by `ranks`' logs; without them, to the scheduler's word, which
    comes a step report later: `reported`); abort: the
    failure -> the last rank out of its collective (it overlaps detect and decide); and
    stalled: how long the job did not train (the total, but for a hung agent, whose
    node trains on until the decision stops the survivors: from then on).

    A failure's incidents are those the scheduler noticed between it and the next
    failure (each failure waits for the previous recovery); it ended with the one whose
    outcome is that the job stepped again, after any it superseded. Detection counts
    from the failure to the first of them, the rest from that one's commit. A failure
    with no such incident is returned apart, with why: it was not recovered from."""
    out: list[dict[str, Any]] = []
    missed: list[dict[str, Any]] = []
    incidents = sorted(goodput.incidents, key=lambda i: i.detected_at)
    for number, fault in enumerate(injected):
        until = injected[number + 1].at if number + 1 < len(injected) else math.inf
        mine = [i for i in incidents if fault.at - 0.5 <= i.detected_at < until]
        ended = next((i for i in mine if i.outcome in ENDED_BY), None)
        if ended is None:
            outcomes = [jobs_pb2.IncidentOutcome.Name(i.outcome) for i in mine]
            missed.append(
                {
                    "kind": fault.fault.kind,
                    "node": fault.node_id,
                    "step": fault.step,
                    "why": f"no incident resumed the job (incidents: {outcomes or 'none'})",
                }
            )
            continue
        detected = mine[0].detected_at
        decided = ended.decided_at
        seen = ended.resumed_at  # the scheduler's word: one step report after the step
        resumed = seen if ranks is None else ranks.whole_again(fault.at, seen)
        restored = max((t for t in restores if decided <= t <= resumed), default=decided)
        leaving = [t for t in left if fault.at <= t <= resumed]
        out_of_collective = max(leaving, default=fault.at)
        # Training stands still from the failure on, but a hung agent's node trains on
        # until the decision's Reconfigure stops the survivors.
        stalled_from = (
            min(leaving, default=fault.at) if fault.fault.kind == "agent_hang" else fault.at
        )
        out.append(
            {
                "kind": REPORTED.get(fault.fault.kind, fault.fault.kind),
                "abort": out_of_collective - fault.at,
                "stalled": resumed - stalled_from,
                "detect": max(0.0, detected - fault.at),
                "decide": decided - detected,
                "restore": restored - decided,
                "reform": resumed - restored,
                "total": resumed - fault.at,
                "reported": seen - resumed,
                "incidents": float(len(mine)),
                "fallback": any(i.kind == jobs_pb2.INCIDENT_KIND_FALLBACK for i in mine),
                "lost_steps_seen": float(ended.lost_steps),
            }
        )
    return out, missed


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
