"""Recovery benchmark: many failures under one long run, pitstop beside plain torchrun,
torchft and NVIDIA's resiliency extension.

pitstop: a local cluster (`pitstop.client.localcluster`, embedded PostgreSQL and Redis,
simulated GPUs) of --workers worker nodes and --spares hot spares runs the example GPT
job (dp = --workers, an in-memory snapshot every step, standby processes on 2 spares and
one beside its ranks on each of its nodes). The driver fails a node of the job every
--every steps at least, cycling through six kinds: kill -9 of the whole node (agent,
checkpoint daemon, ranks), a fatal Xid (79), a hung agent (SIGSTOP: heartbeats stop, the
stream stays open), kill -9 of one rank, an application Xid (13: the rank dies, the GPU
stays), and a frozen node (SIGSTOP of its agent, checkpoint daemon and ranks: a silent
host, no connection reset, its peers blocked on it). Those on a node move its ranks to a
spare; the two on a rank restart it in place. Failed nodes come back as spares once the
job has left them. A failure waits until the previous one's recovery was decided and
the standbys it will need are warm (`WarmGate`: this run fails the job every few
seconds; one failing every few hours meets each failure that way); the wait is printed.
Per failure, from the driver's own clock for the failure, the scheduler's goodput
incident and the rank logs:

* detect: failure -> the scheduler marks the node (lost or unhealthy) or sees the exit;
* abort: failure -> the last survivor out of its collective (overlaps the others);
* decide: -> the new rank map is committed (spare chosen, restore step picked);
* restore: -> the last rank has loaded the restore step (rank logs);
* re-form: -> the process group is formed again and the job steps (scheduler event);
* stalled: how long the job did not train (a hung agent's node trains on until the
  decision stops the survivors).

Steps lost: the steps the ranks ran twice, counted from their logs, per failure.

Each failure is matched to the incident that ended it: of those the scheduler noticed
between it and the next failure, the one after which the job stepped again (earlier
ones it superseded count in its detect). A failure with none is listed under
`unrecovered`, with why, and the benchmark exits 1 after printing its JSON.

torchrun: the same job, steps and number of failures under `torchrun` (c10d
rendezvous, --max-restarts, one torchrun agent per node), the example saving a
torch.save checkpoint every --save-every steps and loading the newest at start, as a
plain torchrun user would. torchrun has no spare to swap in, so its failure is kill -9
of one worker process; the elastic agents then restart every worker. Measured from the
kill to the first step after the reload; steps lost = last step before the kill minus
the step reloaded. torchft and NVRx: bench/peers.py (kill -9 of a replica or worker;
skipped, saying why, when their packages are missing: pip install -e '.[bench]').

Every run must end with the same final-weights hash as a fault-free run. Run from the
repository root (about 25 minutes on 2 cores with every peer):

    .venv/bin/python bench/recovery.py [--failures 20] [--workers 4] [--spares 4]
        [--liveness-seconds 2] [--skip-torchrun] [--skip torchft] [--skip nvrx]
        [--load [2]]

A hung agent is detected by the local cluster's liveness deadline (--liveness-seconds,
the local cluster's default; the JSON says which was used): that deadline is most of its
detect time. Progress goes to stderr; the last line of stdout is one JSON object. A job
that makes no step for 90 s, or a wait that passes its deadline, ends the benchmark with
a message and exit code 1; on any end (Ctrl-C, SIGTERM and SIGHUP included) the cluster,
the torchrun agents, the peers' processes, the reference run and the load are stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pitstop.client.cpuload import DEFAULT_PROCS, MAX_SECONDS, cpu_load
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import DEFAULT_LIVENESS_TIMEOUT, ClusterError, running_cluster
from pitstop.client.scenario import (
    Driver,
    Fault,
    FaultKind,
    Injected,
    JobStuck,
    ReferenceRun,
    example_command,
    example_spec,
)
from pitstop.client.signals import Terminated, dying_with_parent, exit_code, orderly_exit
from pitstop.v1 import common_pb2, jobs_pb2

# bench/peers.py, the torchft and NVRx runs: a script's own directory is first on sys.path.
peers = importlib.import_module("peers")

RESTORED = re.compile(r"^(\S+ \S+) pitstop\.trainer\.session rank (\d+) restored step (\d+)")
LEFT = re.compile(
    r"^(\S+ \S+) pitstop\.trainer\."
    r"(?:group abandoned the process group|recovery rank \d+ lost a peer)"
)
STEP_LINE = re.compile(r'^\{"rank": (\d+), "step": (\d+), ')
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


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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


def log_time(text: str) -> float:
    """A rank log's timestamp (the ranks log in the machine's local time)."""
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


# pitstop -------------------------------------------------------------------------------


def run_pitstop(
    args: argparse.Namespace, steps: int, root: Path, insecure: bool = False
) -> dict[str, Any]:
    faults = [Fault(args.every * (i + 1), KINDS[i % len(KINDS)]) for i in range(args.failures)]
    say(
        f"pitstop{' (insecure)' if insecure else ''}: {args.workers} workers + {args.spares} "
        f"spares, {len(faults)} failures, a silent node lost after {args.liveness_seconds:g} s"
    )
    with running_cluster(
        root / ("cluster-insecure" if insecure else "cluster"),
        nodes=args.workers,
        spares=args.spares,
        port=0,
        liveness_timeout=args.liveness_seconds,
        insecure=insecure,
    ) as cluster:
        spec = example_spec(
            "bench-recovery",
            dp=args.workers,
            steps=steps,
            step_seconds=args.step_seconds,
            # Two spares hold standby processes: the one a failure takes is started
            # again while the other waits, ready for the next.
            spares=2,
        )

        client = cluster.client(timeout=10.0)
        gate = WarmGate(client)

        def on_fault(injected: Injected) -> None:
            waited = gate.waited
            say(
                f"pitstop: {injected.fault.kind} on {injected.node_id} at step {injected.step}"
                + (f" (waited {waited:.1f} s for warm standbys)" if waited > 0.5 else "")
            )

        try:
            with Driver(
                cluster,
                on_fault=on_fault,
                on_problem=say,
                seed=args.seed,
                spacing=args.every,
                ready=gate.ready,
            ) as driver:
                run = driver.run(spec, faults)
        finally:
            client.close()
        job = run.job
        logs = sorted((cluster.state_dir / "nodes").glob(f"*/agent/ranks/{job.id}/rank-*.log"))
        restores: list[float] = []
        left: list[float] = []
        step_lines = 0
        for path in logs:
            for line in path.read_text(errors="replace").splitlines():
                if (m := RESTORED.match(line)) is not None:
                    restores.append(log_time(m.group(1)))
                elif (m := LEFT.match(line)) is not None:
                    left.append(log_time(m.group(1)))
                elif STEP_LINE.match(line):
                    step_lines += 1
    if job.state != common_pb2.JOB_STATE_SUCCEEDED:
        raise SystemExit(f"pitstop: job ended {common_pb2.JobState.Name(job.state)}: {job.reason}")
    per_failure, missed = split(job.goodput, run.injected, restores, left)
    for failure in missed:
        say(
            f"pitstop: {failure['kind']} on {failure['node']} at step {failure['step']}: "
            f"{failure['why']}"
        )
    for row in per_failure:
        say(
            f"pitstop: {KINDS[int(row['kind_index'])]}: {row['total']:.2f} s = detect "
            f"{row['detect']:.2f} + decide {row['decide']:.2f} + restore {row['restore']:.2f} "
            f"+ re-form {row['reform']:.2f} (survivors out of their collective after "
            f"{row['abort']:.2f} s)"
        )
    redone = step_lines - steps * args.workers
    return {
        "job": job,
        "failures": per_failure,
        "unrecovered": missed,
        "injected": len(run.injected),
        "seconds": run.seconds,
        "steps_lost_per_failure": redone / args.workers / max(len(run.injected), 1),
        "goodput": job.goodput.ratio,
    }


class WarmGate:
    """When the next failure may come. This run fails the job every few seconds; a job
    failing every few hours would meet each failure recovered from the one before and
    with its standbys warm. So a failure waits until the previous one's recovery was
    decided (the job's generation moved on, and it steps again) and, for one that moves
    a node's ranks, a spare holds a standby of the job done importing; for one that
    restarts a rank in place, each of the job's nodes holds one beside its ranks. The
    wait is reported with each failure."""

    CHECK_SECONDS = 0.5

    def __init__(self, client: Any) -> None:
        self.client = client
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


def split(
    goodput: jobs_pb2.Goodput, injected: list[Injected], restores: list[float], left: list[float]
) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """Per failure: detect, decide, restore, re-form and total seconds; abort: the
    failure -> the last rank out of its collective (it overlaps detect and decide); and
    stalled: how long the job did not train (the total, but for a hung agent, whose
    node trains on until the decision stops the survivors: from then on).

    A failure's incidents are those the scheduler noticed between it and the next
    failure (each failure waits for the previous recovery); it ended with the one whose
    outcome is that the job stepped again, after any it superseded. Detection counts
    from the failure to the first of them, the rest from that one's commit. A failure
    with no such incident is returned apart, with why: it was not recovered from."""
    out: list[dict[str, float]] = []
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
        resumed = ended.resumed_at
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
                "kind_index": KINDS.index(fault.fault.kind),
                "abort": out_of_collective - fault.at,
                "stalled": resumed - stalled_from,
                "detect": max(0.0, detected - fault.at),
                "decide": decided - detected,
                "restore": restored - decided,
                "reform": resumed - restored,
                "total": resumed - fault.at,
                "incidents": float(len(mine)),
                "lost_steps_seen": float(ended.lost_steps),
            }
        )
    return out, missed


# torchrun ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Follower:
    """Reads rank 0's output as it comes, stamping each line."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self.cond:
                self.lines.append((time.time(), line.strip()))
                self.cond.notify_all()

    def wait(self, pred: Any, timeout: float, start: int = 0) -> tuple[float, str] | None:
        """The first line from index `start` on that `pred` accepts, waiting for it."""
        deadline = time.monotonic() + timeout
        with self.cond:
            seen = start
            while True:
                for item in self.lines[seen:]:
                    if pred(item[1]):
                        return item
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)


def worker_pids(run_dir: Path) -> list[int]:
    """The example's worker processes under this torchrun run (by their save dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"torchrun") for arg in cmdline):
            continue  # an elastic agent (its argv names the script too), not a worker
        if b"pitstop.trainer.example" in cmdline and str(run_dir).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def run_torchrun(args: argparse.Namespace, steps: int, root: Path) -> dict[str, Any]:
    save_dir = root / "torchrun-save"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    # torchrun shares one TCPStore server across rendezvous rounds by default, and the
    # restarted workers' gloo group then reads the previous round's peer addresses from
    # it ("Connection refused" in connectFullMesh, or a hang). This opt-out gives each
    # round a store of its own; it is what a torchrun user who restarts workers needs.
    env.update(PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = example_command(steps, args.step_seconds)
    command += ["--save-dir", str(save_dir), "--save-every", str(args.save_every)]
    agents = []
    say(f"torchrun: {args.workers} agents, {args.failures} failures")
    started = time.monotonic()
    for node in range(args.workers):
        agents.append(
            subprocess.Popen(
                dying_with_parent(
                    [
                        str(Path(sys.executable).parent / "torchrun"),
                        f"--nnodes={args.workers}",
                        "--nproc-per-node=1",
                        "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}",
                        f"--rdzv-id=bench-{port}",
                        f"--max-restarts={args.failures + 5}",
                        "--monitor-interval=0.1",
                        *command[1:],
                    ]
                ),
                stdout=subprocess.PIPE if node == 0 else subprocess.DEVNULL,
                stderr=(root / f"torchrun-{node}.log").open("w"),
                text=True,
                env=env,
                start_new_session=True,
            )
        )
    follower = Follower(agents[0].stdout)
    failures: list[dict[str, float]] = []
    try:
        for index in range(args.failures):
            target = args.every * (index + 1)
            hit = follower.wait(
                lambda line, t=target: (m := STEP_LINE.match(line)) and int(m.group(2)) >= t,
                timeout=300,
            )
            if hit is None:
                raise SystemExit(f"torchrun: step {target} never came")
            last = max(
                int(m.group(2))
                for _, line in follower.lines
                if (m := STEP_LINE.match(line)) is not None
            )
            victims = worker_pids(save_dir)
            if not victims:
                raise SystemExit("torchrun: no worker process found to kill")
            with follower.cond:
                seen = len(follower.lines)
            killed_at = time.time()
            os.kill(victims[index % len(victims)], signal.SIGKILL)
            loaded = follower.wait(lambda line: '"loaded_step"' in line, timeout=300, start=seen)
            if loaded is None:
                raise SystemExit("torchrun: the workers never reloaded")
            step = json.loads(loaded[1])["loaded_step"]
            resumed = follower.wait(
                lambda line, s=step: (m := STEP_LINE.match(line)) and int(m.group(2)) > s,
                timeout=300,
                start=seen,
            )
            if resumed is None:
                raise SystemExit("torchrun: the workers never stepped after the reload")
            failures.append({"total": resumed[0] - killed_at, "lost_steps": float(last - step)})
            say(
                f"torchrun: failure {index + 1}: {failures[-1]['total']:.1f} s, "
                f"{last - step} steps lost"
            )
        for agent in agents:
            agent.wait(timeout=900)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    final = follower.wait(lambda line: "final_weights_sha256" in line, timeout=1)
    return {
        "failures": failures,
        "seconds": time.monotonic() - started,
        "hash": json.loads(final[1])["final_weights_sha256"] if final else "",
    }


def peer_summary(peer: dict[str, Any], expected: str) -> dict[str, Any]:
    """A peer's run (bench/peers.py) as the JSON reports it: its failure -> training
    again seconds, the failed replica's rejoin, steps run twice, and its hash compared."""
    if "skipped" in peer:
        return {"skipped": peer["skipped"]}
    failures = peer["failures"]
    out: dict[str, Any] = {"failures": len(failures)}
    if failures:
        out["detect_to_resume_seconds"] = summary([f["total"] for f in failures])
        out["rejoin_seconds"] = summary([f["rejoin"] for f in failures])
        out["steps_lost_per_failure"] = round(statistics.mean(f["lost_steps"] for f in failures), 2)
    out["wall_seconds"] = round(peer["seconds"], 1)
    if "error" in peer:  # it broke down: what it completed, and why it stopped
        out["error"] = peer["error"]
    else:
        out["hash_equal"] = peer["hash"] == expected
        out["hash_note"] = peer.get("hash_note", "")
    out["config"] = peer.get("config", {})
    return out


def pitstop_summary(run: dict[str, Any], expected: str) -> dict[str, Any]:
    """What one pitstop run measured, for the JSON line."""
    rows = run["failures"]
    return {
        "failures": run["injected"],
        "recovered": len(rows),
        "unrecovered": run["unrecovered"],
        "by_kind": {k: sum(1 for r in rows if KINDS[int(r["kind_index"])] == k) for k in KINDS},
        "detect_to_resume_seconds": summary([r["total"] for r in rows]),
        "p50_by_kind": {
            k: round(
                statistics.median([r["total"] for r in rows if KINDS[int(r["kind_index"])] == k]),
                3,
            )
            for k in KINDS
            if any(KINDS[int(r["kind_index"])] == k for r in rows)
        },
        "detect_seconds": summary([r["detect"] for r in rows]),
        "abort_seconds": summary([r["abort"] for r in rows]),
        "training_stalled_seconds": summary([r["stalled"] for r in rows]),
        "decide_seconds": summary([r["decide"] for r in rows]),
        "restore_seconds": summary([r["restore"] for r in rows]),
        "reform_seconds": summary([r["reform"] for r in rows]),
        "steps_lost_per_failure": round(run["steps_lost_per_failure"], 2),
        "goodput": round(run["goodput"], 4),
        "wall_seconds": round(run["seconds"], 1),
        "hash_equal": run["job"].result.get("final_weights_sha256") == expected,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures", type=int, default=20)
    parser.add_argument("--every", type=int, default=20, help="steps between failures")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--spares", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--save-every", type=int, default=25, help="torchrun's torch.save")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=("torchft", "nvrx"),
        help="leave a peer out (repeat for both); a peer whose package is missing is "
        "reported skipped (pip install -e '.[bench]')",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (logs, rank logs)"
    )
    parser.add_argument(
        "--liveness-seconds",
        type=float,
        default=DEFAULT_LIVENESS_TIMEOUT,
        help="a node silent this long is lost: a hung agent's detection deadline",
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
    # Room for each failure's wait for a warm standby and its recovery.
    steps = (args.every + 60) * (args.failures + 1)
    root = Path(tempfile.mkdtemp(prefix="pitstop-recovery-"))
    try:
        with contextlib.ExitStack() as stack:
            if args.load:
                stack.enter_context(cpu_load(args.load, MAX_SECONDS))
                say(f"CPU load: {args.load} busy processes beside the benchmark")
            with ReferenceRun(steps) as reference:
                expected = reference.final_hash()
            # torchrun first, on a quiet machine: run after the local cluster, its workers
            # once hung forming their group (not understood yet; see the README).
            torchrun = None if args.skip_torchrun else run_torchrun(args, steps, root)
            peer_runs: dict[str, dict[str, Any]] = {}
            for name, run in (("torchft", peers.run_torchft), ("nvrx", peers.run_nvrx)):
                if name in args.skip:
                    continue
                began = time.monotonic()
                try:
                    peer_runs[name] = run(
                        workers=args.workers,
                        steps=steps,
                        step_seconds=args.step_seconds,
                        failures=args.failures,
                        every=args.every,
                        root=root / name,
                        say=say,
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # set-up broke
                    say(f"{name}: {exc}; the benchmark goes on without it")
                    seconds = time.monotonic() - began
                    peer_runs[name] = {"failures": [], "seconds": seconds, "error": str(exc)}
            pitstop = run_pitstop(args, steps, root)
            insecure = run_pitstop(args, steps, root, insecure=True) if args.insecure_too else None
    finally:
        if args.keep:
            say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "recovery",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpus": os.cpu_count()},
        "nodes": args.workers + args.spares,
        "steps": steps,
        "step_seconds": args.step_seconds,
        "liveness_timeout_seconds": args.liveness_seconds,
        "cpu_load_procs": args.load,
        "pitstop": pitstop_summary(pitstop, expected),
        "targets": {"p50_seconds": 1.5, "p95_seconds": 2.5, "max_seconds": 4.0, "steps_lost": 1},
    }
    if insecure is not None:
        result["pitstop_insecure"] = pitstop_summary(insecure, expected)
        result["secure_over_insecure_p50"] = round(
            result["pitstop"]["detect_to_resume_seconds"]["p50"]
            / result["pitstop_insecure"]["detect_to_resume_seconds"]["p50"],
            3,
        )

    if torchrun is not None:
        totals = [f["total"] for f in torchrun["failures"]]
        result["torchrun"] = {
            "failures": len(totals),
            "detect_to_resume_seconds": summary(totals),
            "steps_lost_per_failure": round(
                statistics.mean(f["lost_steps"] for f in torchrun["failures"]), 2
            ),
            "wall_seconds": round(torchrun["seconds"], 1),
            "hash_equal": torchrun["hash"] == expected,
            "config": {
                "launcher": "torchrun, one agent per simulated node, --nproc-per-node=1",
                "rendezvous": "c10d, a store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE)",
                "max_restarts": args.failures + 5,
                "monitor_interval_s": 0.1,
                "restart": "every worker restarted, the newest torch.save loaded",
                "checkpoint": f"torch.save every {args.save_every} steps",
            },
        }
        pitstop_p50 = result["pitstop"]["detect_to_resume_seconds"]["p50"]
        result["torchrun_over_pitstop_p50"] = round(
            result["torchrun"]["detect_to_resume_seconds"]["p50"] / pitstop_p50, 2
        )
    for name, peer in peer_runs.items():
        result[name] = peer_summary(peer, expected)
        if "detect_to_resume_seconds" in result[name]:
            result[f"{name}_over_pitstop_p50"] = round(
                result[name]["detect_to_resume_seconds"]["p50"]
                / result["pitstop"]["detect_to_resume_seconds"]["p50"],
                2,
            )
    print(json.dumps(result))
    unrecovered = [
        f for r in ("pitstop", "pitstop_insecure") for f in result.get(r, {}).get("unrecovered", [])
    ]
    if unrecovered:
        say(f"error: {len(unrecovered)} failure(s) not recovered from (see the JSON)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
