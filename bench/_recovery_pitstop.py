"""bench/recovery.py's pitstop run: the example job on a local cluster, the failures
injected one at a time (each when the previous one's recovery is done and the standbys
warm), and each failure matched, from the rank logs and the job's incidents, to what
it cost."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime as dt
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import peers
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import SCHEDULER_ENV, running_cluster, silent_host_of
from pitstop.client.scenario import Driver, Fault, FaultKind, Injected, example3d_spec, example_spec
from pitstop.v1 import common_pb2, jobs_pb2

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
