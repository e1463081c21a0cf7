"""Chaos benchmark: many random faults of many kinds under one long training run.

A local cluster (`pitstop.client.localcluster`, simulated GPUs): --workers worker nodes,
--spares hot spares, two scheduler processes (one leads, one stands by; the nodes reach
whichever answers) on a PostgreSQL and a Redis of the benchmark's own, started from the
machine's binaries so that it may restart and flush them; each agent keeps its
checkpoint daemon running. The example GPT job (dp = --workers, a snapshot every step,
standby processes on two spares) trains while --faults faults hit it one at a time, their
kinds drawn with a seeded RNG, every kind once per round in a random order:

  xid_fatal         Xid 79 on the GPU of a node of the job (the node is replaced)
  xid_app           Xid 13 (the rank on that GPU restarts in place)
  rank_kill         kill -9 of a rank process
  node_kill         kill -9 of a whole node: agent, checkpoint daemon, ranks
  agent_kill        kill -9 of a node's agent only
  checkpointd_kill  kill -9 of a node's checkpoint daemon only (its agent starts it again)
  agent_stop        SIGSTOP of a node's agent; SIGCONT once its node was declared lost
                    and the scheduler decided (or 5 s after)
  drain             NodeService drain of a node of the job; uncordoned afterwards
  scheduler_kill    kill -9 of the leading scheduler, started again at once
  leader_failover   kill -9 of the leader; once the standby leads, the old one comes back
  postgres_restart  PostgreSQL stopped (fast shutdown) and started again
  redis_flush       FLUSHALL of the schedulers' Redis
  sdc               one bit flipped in the weights of the rank on a node's GPU (inject-fault
                    --sdc): the replicas' check names it, its node is quarantined and
                    replaced; brought back afterwards as the others are
  nan               a NaN loss and gradients on one rank (--nan): every rank rolls back one
                    step and skips the batch, which the reference run then skips too
  hang              one rank blocks outside any collective (--hang): after the job's hang
                    threshold (HANG_FLOOR s here) the stacks name it and it is replaced
  fail_preflight    the next preflight of a spare the job does not use fails
                    (--fail-preflight): the spare is quarantined and never gets ranks;
                    brought back (its daemons restarted, the preflight passing) afterwards
  row_remap         a pending row remap on a node's GPU (an early warning): the node
                    drains, its ranks move off at the next committed step; cleared and
                    uncordoned afterwards
  preempt           a second job, of higher priority (dp 2, HIGH_STEPS steps), arrives:
                    the chaos job (preemptible, priority 0) stops at a step boundary, goes
                    back to the queue and resumes by itself once the other finished. Its
                    "recovery" is the other job's whole run, so it is reported apart
                    (preemptions: how soon the other job ran, how soon this one resumed
                    after it) and left out of the 10 s target; every such job must
                    succeed with the hash of its own fault-free run

The faults are spread over the job's steps (--steps-per-fault apart). Before the next one
the job is running again, has made --gap-steps steps, every failed node is back (its
daemons restarted, as a spare; a drained one uncordoned) and the standby processes wait
(at most 30 s), as long after a failure on a real cluster. Per fault: its time; when the
scheduler decided (the event time of job.recovering, job.restarting or job.reconfigured;
none for a fault the job rides through); when the job trained again (the job.recovered
after the last decision, else the first step beyond the newest step at the fault).
Recovery = fault -> training again, target none over 10 s. The leading scheduler's
event-loop lag is read from its /metrics every 3 s (target p99 < 50 ms). The fault-free
reference hash is computed once the cluster is down, told to skip the batches the job's
checks rolled back and skipped (its record's skipped_steps).

    .venv/bin/python bench/chaos.py [--faults 50] [--seed 0] [--load 2]
    .venv/bin/python bench/chaos.py --faults 18 --steps 2400     # every kind once
    .venv/bin/python bench/chaos.py --kinds preempt,node_kill,sdc --faults 6

Progress goes to stderr; the last line of stdout is one JSON object. A job without a step
for --stall-seconds (120) ends the run (exit code 1) with what is known and its last
events; so does a job that does not succeed with the reference hash. On any end (Ctrl-C,
SIGTERM and SIGHUP included) the cluster, the stores, the reference run and the load stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.client.client import PitstopClient
from pitstop.client.cpuload import MAX_SECONDS, cpu_load
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import DEFAULT_LIVENESS_TIMEOUT, ClusterError, running_cluster
from pitstop.client.localcluster.cluster import LocalCluster
from pitstop.client.localcluster.statefile import Kind
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis
from pitstop.client.scenario import ReferenceRun, example_spec, format_event
from pitstop.client.signals import Terminated, exit_code, orderly_exit
from pitstop.v1 import common_pb2, jobs_pb2, nodes_pb2

KINDS = (
    *("xid_fatal", "xid_app", "rank_kill", "node_kill", "agent_kill", "checkpointd_kill"),
    *("agent_stop", "drain", "scheduler_kill", "leader_failover", "postgres_restart"),
    *("redis_flush", "sdc", "nan", "hang", "row_remap", "fail_preflight", "preempt"),
)
HIGH_STEPS, HIGH_PRIORITY = 40, 10
"""A preempt fault's job: its steps (paced as the chaos job) and priority."""
DECIDED = {
    *("xid_fatal", "xid_app", "rank_kill", "node_kill", "agent_kill", "drain", "sdc"),
    *("hang", "row_remap", "preempt"),
}
HANG_FLOOR = 5.0
"""The job's hang threshold floor (spec.integrity.hang_floor_seconds), seconds."""
"""Kinds the scheduler must decide a recovery for. A stopped agent's ranks step on, and a
node back before the scheduler acted needs nothing; the other kinds the job rides out."""
DECISIONS = {"job.recovering", "job.restarting", "job.reconfigured", "job.preempted"}
RESUMED = {"job.recovered", "job.running"}
TERMINAL = {
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
}
TARGET_RECOVERY, TARGET_LAG_P99 = 10.0, 0.05
SETTLE = 10.0
"""Seconds a fault without a decision is watched for a late one before it is over."""
NO_DECISION = 45.0
"""Seconds a fault of DECIDED waits for its decision before it counts as ridden out."""
CONTINUE_AFTER = 5.0
"""Seconds a stopped agent stays stopped after its node was lost, unless decided sooner."""
API_POLL, READY_POLL = 0.3, 0.5
"""Seconds between polls of the job and events, and between looks at the next fault."""
STANDBY_WAIT, NODES_WAIT = 30.0, 180.0
"""Seconds the next fault waits for the standbys, and for nodes to come back."""
STEP_LINE = re.compile(rb'^\{"rank": (\d+), "step": (\d+), ', re.MULTILINE)
METRIC = re.compile(r'^pitstop_scheduler_(\w+?)(?:\{\w+="([^"]*)"\})? (\S+)$', re.MULTILINE)
STANDBY_START, STANDBY_WAITING = "--- pitstop: standby on GPU", ": waiting for a rank"


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def event_time(event: common_pb2.Event) -> float:
    return float(event.time.ToMicroseconds()) / 1e6


class Stuck(RuntimeError):
    """The job made no step for too long, or the run passed its deadline."""


class Steps:
    """The ranks' own progress, read from their logs: the newest step, when each newest
    step was first seen, and when any step line (a rolled-back one too) was last seen."""

    def __init__(self, state_dir: Path, job_id: str) -> None:
        self.logs = f"nodes/*/agent/ranks/{job_id}/rank-*.log"
        self.state_dir = state_dir
        self.newest = 0
        self.firsts: list[tuple[float, int]] = []  # (epoch seconds, the new newest step)
        self.last_line_at = time.time()
        self._read: dict[Path, int] = {}

    def poll(self) -> None:
        now = time.time()
        for path in self.state_dir.glob(self.logs):
            with path.open("rb") as log:
                log.seek(self._read.get(path, 0))
                chunk = log.read()
            complete = chunk.rfind(b"\n") + 1
            self._read[path] = self._read.get(path, 0) + complete
            for match in STEP_LINE.finditer(chunk[:complete]):
                self.last_line_at = now
                if int(match.group(2)) > self.newest:
                    self.newest = int(match.group(2))
                    self.firsts.append((now, self.newest))

    def first_beyond(self, step: int) -> float | None:
        return next((t for t, s in self.firsts if s > step), None)

    def lines(self) -> int:
        """Step lines in every rank log: a step run twice is two lines."""
        return sum(len(STEP_LINE.findall(p.read_bytes())) for p in self.state_dir.glob(self.logs))


class LagSampler(threading.Thread):
    """Every `every` s, each live scheduler's /metrics: whether it leads, its event-loop
    lag gauges (p50, p99 over the last minute) and lag histogram."""

    def __init__(self, cluster: LocalCluster, every: float = 3.0) -> None:
        super().__init__(name="lag-sampler", daemon=True)
        self.cluster, self.every = cluster, every
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            for proc in list(self.cluster.schedulers):
                with contextlib.suppress(ClusterError):
                    text = self.cluster.scheduler_metrics(proc.name, timeout=1.0)
                    sample: dict[str, Any] = {"pid": proc.pid, "buckets": {}}
                    for name, label, value in METRIC.findall(text):
                        if name == "event_loop_lag_seconds_bucket":
                            sample["buckets"][label] = float(value)
                        elif name == "event_loop_lag_quantile_seconds":
                            sample[label] = float(value)
                        elif name == "leader":
                            sample["leader"] = float(value) == 1.0
                    self.samples.append(sample)

    def summary(self) -> dict[str, Any]:
        """Over the leader's samples: the largest p50 and p99 gauges, the median p99, and
        p50/p99 of the histogram's increments while a process led (bucket bounds)."""
        leading = [s for s in self.samples if s.get("leader")]
        merged: dict[str, float] = {}
        last: dict[int, dict[str, float]] = {}
        for sample in self.samples:
            before = last.get(sample["pid"], {})
            for le, count in sample["buckets"].items() if sample.get("leader") else ():
                merged[le] = merged.get(le, 0.0) + count - before.get(le, 0.0)
            last[sample["pid"]] = sample["buckets"]
        ordered = sorted(merged.items(), key=lambda item: float(item[0]))
        total = merged.get("+Inf", 0.0)

        def bound(q: float) -> float | None:
            return next((float(le) for le, n in ordered if total and n >= q * total), None)

        p99s = [s["0.99"] for s in leading if "0.99" in s]
        return {
            "samples": len(leading),
            "p50_seconds_max_sampled": max((s["0.5"] for s in leading if "0.5" in s), default=None),
            "p99_seconds_max_sampled": max(p99s, default=None),
            "p99_seconds_median_sampled": statistics.median(p99s) if p99s else None,
            "histogram_p50_seconds_at_most": bound(0.5),
            "histogram_p99_seconds_at_most": bound(0.99),
            "target_p99_seconds": TARGET_LAG_P99,
        }


@dataclass
class Fault:
    """One fault and what is known of its recovery."""

    index: int
    kind: str
    target: str
    at: float  # epoch seconds
    step: int  # the newest step a rank had logged
    cursor: int  # the newest event id looked at
    decision: common_pb2.Event | None = None
    last_decision: common_pb2.Event | None = None
    resumed_at: float | None = None
    resumed_step: int = 0
    how: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    pending: list[threading.Thread] = field(default_factory=list)

    def recovery(self) -> float | None:
        return None if self.resumed_at is None else round(self.resumed_at - self.at, 3)

    def row(self) -> dict[str, Any]:
        decided = None if self.decision is None else event_time(self.decision) - self.at
        return {
            "index": self.index,
            "kind": self.kind,
            "target": self.target,
            "at": round(self.at, 3),
            "step": self.step,
            "decision": self.decision.kind if self.decision else None,
            "decided_seconds": None if decided is None else round(decided, 3),
            "recovery_seconds": self.recovery(),
            "training_again_by": self.how,
            **self.extra,
        }


class Chaos:
    """Runs the job, injects the faults one at a time and follows each to its end."""

    def __init__(
        self, cluster: LocalCluster, postgres: OwnPostgres, redis: OwnRedis, args: Any
    ) -> None:
        self.cluster, self.postgres, self.redis, self.args = cluster, postgres, redis, args
        self.client = cluster.client(timeout=30.0)
        # Polls give up at once: a scheduler that does not answer is asked next time.
        self.poller = cluster.client(timeout=3.0, max_attempts=1)
        self.random = random.Random(args.seed)
        self.job = jobs_pb2.Job()  # as last read
        self.steps = Steps(cluster.state_dir, "")
        self.events: list[common_pb2.Event] = []
        self.faults: list[Fault] = []
        self.problems: list[str] = []
        self.stopped: set[int] = set()  # agents under SIGSTOP
        self.restoring: list[threading.Thread] = []
        self.want_standbys = 0
        self._bag: list[str] = []
        self._last_victim = ""
        self._next_poll = self._next_look = 0.0
        self._waiting: dict[str, float] = {}  # what the next fault waits for, since when
        self._standbys = 0
        self.kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
        self.high_jobs: dict[str, jobs_pb2.Job] = {}  # the preempt faults' jobs, by id

    def close(self) -> None:
        for pid in self.stopped:  # a stopped agent would not act on the SIGTERM of `down`
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.client.close()
        self.poller.close()

    def run(self, spec: jobs_pb2.JobSpec) -> jobs_pb2.Job:
        self.job = self.client.submit_job(spec)
        self.steps = Steps(self.cluster.state_dir, self.job.id)
        self.want_standbys = min(spec.spares, len(self.cluster.nodes) - spec.dp)
        say(f"job {self.job.id} submitted: {self.args.steps} steps")
        deadline = time.monotonic() + self.args.max_minutes * 60
        current: Fault | None = None
        while self.job.state not in TERMINAL:
            self.tick()
            if time.monotonic() > deadline:
                raise Stuck(f"not over after {self.args.max_minutes:g} min")
            if current is None and self.faults and self.decided_late(self.faults[-1]):
                current = self.faults[-1]  # its recovery lasts until the job trains again
            if current is not None and self.follow(current):
                current = None
            if current is None and len(self.faults) < self.args.faults and self.ready():
                current = self.inject(self.draw())
            time.sleep(0.1)
        if current is not None:
            self.follow(current)
        if len(self.faults) < self.args.faults:
            self.problems.append(
                f"only {len(self.faults)} of {self.args.faults} faults: the job's steps ran out "
                "(give more --steps-per-fault)"
            )
        for worker in self.restoring:
            worker.join(timeout=30)
        return self.job

    def tick(self) -> None:
        self.steps.poll()
        if time.monotonic() >= self._next_poll:  # the schedulers' load stays light
            self._next_poll = time.monotonic() + API_POLL
            self.poll_events()
            with contextlib.suppress(PitstopError):
                self.job = self.poller.get_job(self.job.id)
        silent = time.time() - self.steps.last_line_at
        if silent > self.args.stall_seconds:
            raise Stuck(f"no step for {silent:.0f} s")

    def poll_events(self) -> None:
        with contextlib.suppress(PitstopError):
            while True:
                after = self.events[-1].id if self.events else 0
                batch = self.poller.list_events(after_event_id=after, limit=500)
                self.events += batch
                if len(batch) < 500:
                    return

    def since(self, cursor: int) -> list[common_pb2.Event]:
        """Events after `cursor` of the job, or of no job (nodes, leadership)."""
        return [e for e in self.events if e.id > cursor and e.job_id in ("", self.job.id)]

    # When the next fault comes

    def ready(self) -> bool:
        """Whether the next fault may come: it is due, the job runs, has made --gap-steps
        steps since the last recovery and has steps left, every node is back, and the
        standbys wait."""
        if time.monotonic() < self._next_look or self.job.state != common_pb2.JOB_STATE_RUNNING:
            return False
        self._next_look = time.monotonic() + READY_POLL
        args = self.args
        spacing = (args.steps - args.warmup_steps - args.reserve_steps) / args.faults
        due = args.warmup_steps + round(len(self.faults) * spacing)
        since = self.faults[-1].resumed_step if self.faults else 0
        newest = self.steps.newest
        if newest < max(since + args.gap_steps, due) or newest > args.steps - args.reserve_steps:
            return False
        if any(w.is_alive() for w in self.restoring):
            return False
        try:
            nodes = self.poller.list_nodes()
        except PitstopError:
            return False
        in_use = {a.node_id for a in self.job.rank_map.ranks}
        away = [
            n
            for n in nodes
            if n.id not in in_use
            and not (
                n.connected
                and n.state == common_pb2.NODE_STATE_READY
                and n.role == common_pb2.NODE_ROLE_SPARE
            )
        ]
        if any(n.id in in_use and n.state != common_pb2.NODE_STATE_READY for n in nodes):
            return False
        if away and not self.waited("nodes", NODES_WAIT):
            self.bring_back(away, in_use)
            return False
        if away:
            self.problems.append(f"went on without {[n.id for n in away]}: not back in time")
        self._standbys = self.ready_standbys(in_use)
        return self._standbys >= self.want_standbys or self.waited("standbys", STANDBY_WAIT)

    def waited(self, what: str, limit: float) -> bool:
        """Whether the next fault has waited `limit` s for `what` (then it waits no more)."""
        since = self._waiting.setdefault(what, time.monotonic())
        if time.monotonic() - since < limit:
            return False
        del self._waiting[what]
        return True

    def ready_standbys(self, in_use: set[str]) -> int:
        """Standby processes of the job that have imported its script and wait for a
        rank: the last start in their log says so, and their node runs them."""
        ready = 0
        for node in self.cluster.nodes:
            if node.node_id in in_use:
                continue
            folder = self.cluster.state_dir / f"nodes/{node.node_id}/agent/ranks/{self.job.id}"
            for log in folder.glob("standby-gpu*.log"):
                last = log.read_text(errors="replace").rsplit(STANDBY_START, 1)[-1]
                ready += STANDBY_WAITING in last and bool(self.cluster.rank_pids(node.node_id))
        return ready

    def draw(self) -> str:
        """Every kind once per round, each round in a random order."""
        if not self._bag:
            self._bag = list(self.kinds)
            self.random.shuffle(self._bag)
        return self._bag.pop()

    # Injecting and following a fault

    def inject(self, kind: str) -> Fault:
        self._waiting.clear()
        self.steps.poll()
        self.poll_events()
        if kind == "preempt":
            target = "the chaos job"
        elif kind in ("scheduler_kill", "leader_failover"):
            target = self.cluster.leader() or "scheduler"
        elif kind in ("postgres_restart", "redis_flush"):
            target = kind.split("_")[0]
        elif kind == "fail_preflight":  # a spare: the ranks it could have got
            in_use = {a.node_id for a in self.job.rank_map.ranks}
            spares = sorted(n.node_id for n in self.cluster.nodes if n.node_id not in in_use)
            target = self.random.choice(spares)
        else:
            nodes = sorted({a.node_id for a in self.job.rank_map.ranks})
            target = self.random.choice([n for n in nodes if n != self._last_victim] or nodes)
            self._last_victim = target
        cursor = self.events[-1].id if self.events else 0
        fault = Fault(len(self.faults) + 1, kind, target, time.time(), self.steps.newest, cursor)
        fault.extra["standbys_ready"] = self._standbys
        self.faults.append(fault)
        say(f"fault {fault.index}/{self.args.faults}: {kind} on {target} at step {fault.step}")
        if kind in ("xid_fatal", "xid_app"):
            xid = 79 if kind == "xid_fatal" else 13
            self.client.inject_fault(target, common_pb2.Fault(gpu_index=0, xid=xid))
        elif kind in ("sdc", "nan", "hang"):
            fault_pb = common_pb2.Fault(gpu_index=0)
            setattr(fault_pb, kind, True)
            self.client.inject_fault(target, fault_pb)
        elif kind == "fail_preflight":
            self.client.inject_fault(target, common_pb2.Fault(gpu_index=0, fail_preflight=True))
        elif kind == "row_remap":
            self.client.inject_fault(target, common_pb2.Fault(gpu_index=0, pending_row_remap=True))
        elif kind == "preempt":
            spec = example_spec(
                f"bench-chaos-high-{fault.index}",
                dp=2,
                steps=HIGH_STEPS,
                step_seconds=self.args.step_seconds,
                spares=0,
            )
            spec.priority, spec.standby_processes = HIGH_PRIORITY, False
            high = self.client.submit_job(spec)
            self.high_jobs[high.id] = high
            fault.extra["high_job"] = high.id
        elif kind == "rank_kill":
            pids = self.cluster.rank_pids(target)
            if pids:
                os.kill(min(pids), signal.SIGKILL)  # the rank, not what it forked
            else:
                self.problems.append(f"fault {fault.index}: {target} had no rank to kill")
        elif kind == "node_kill":
            self.cluster.kill_node(target, signal.SIGKILL, wait=False)
        elif kind in ("agent_kill", "agent_stop", "checkpointd_kill"):
            daemon: Kind = "checkpointd" if kind == "checkpointd_kill" else "agent"
            fault.extra["pids"] = self.cluster.daemon_pids(target, daemon)
            for pid in fault.extra["pids"]:
                os.kill(pid, signal.SIGSTOP if kind == "agent_stop" else signal.SIGKILL)
            if kind == "agent_stop":
                self.stopped.update(fault.extra["pids"])
        elif kind == "drain":
            self.client.drain_node(target, "chaos: drain")
        elif kind in ("scheduler_kill", "leader_failover"):
            self.cluster.kill_scheduler(target)
            if kind == "scheduler_kill":
                fault.pending.append(self.background(self.cluster.start_scheduler, target))
        elif kind == "postgres_restart":
            # From the main thread: the server dies with the thread that started it.
            fault.extra["postgres_down_seconds"] = round(self.postgres.restart(), 3)
        else:
            self.redis.flush_all()
        return fault

    def background(self, action: Callable[..., object], *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                action(*args)
            except (ClusterError, PitstopError) as exc:
                self.problems.append(str(exc))
                say(f"problem: {exc}")

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        return worker

    def follow(self, fault: Fault) -> bool:
        """Update what is known of `fault`; True once it is over: the job trains again,
        what the fault started is done, and without a decision SETTLE s have passed."""
        now = time.time()
        if fault.kind == "preempt":
            self.note_high_job(fault)
        for event in self.since(fault.cursor):
            self.react(fault, event)
            if event.job_id and event.kind in DECISIONS:
                fault.decision = fault.decision or event
                fault.last_decision, fault.resumed_at, fault.how = event, None, ""
            elif event.kind in RESUMED and fault.last_decision and fault.resumed_at is None:
                fault.resumed_at, fault.how = event_time(event), event.kind
                fault.resumed_step = self.steps.newest
        fault.cursor = self.events[-1].id if self.events else fault.cursor
        beyond = self.steps.first_beyond(fault.step)
        undecided = fault.kind not in DECIDED or now - fault.at > NO_DECISION
        if fault.last_decision is None and fault.resumed_at is None and beyond and undecided:
            fault.resumed_at, fault.how, fault.resumed_step = beyond, "step", self.steps.newest
        self.continue_agent(fault, now)
        if fault.kind == "checkpointd_kill" and "daemon_back_seconds" not in fault.extra:
            pids = set(self.cluster.daemon_pids(fault.target, "checkpointd"))
            if pids - set(fault.extra["pids"]):  # started again, by its agent
                fault.extra["daemon_back_seconds"] = round(now - fault.at, 2)
        if (
            fault.resumed_at is None
            or any(w.is_alive() for w in fault.pending)
            or self.stopped & set(fault.extra.get("pids", []))
            or (fault.last_decision is None and now - fault.at < SETTLE)
            or self.job.state not in (common_pb2.JOB_STATE_RUNNING, *TERMINAL)
        ):
            return False
        decided = "no decision"
        if fault.decision is not None:
            decided = f"{fault.decision.kind} at +{event_time(fault.decision) - fault.at:.2f} s"
            fault.extra.setdefault("decision_reason", fault.decision.reason)
        elif fault.kind in DECIDED:
            self.problems.append(f"fault {fault.index} ({fault.kind}): no decision recorded")
        say(f"fault {fault.index}: {decided}; training again after {fault.recovery()} s")
        return True

    def settle_high_jobs(self) -> None:
        """Read every preempt fault's job as it ended (each ran before the chaos job
        resumed; one still live after 60 s counts as what it is)."""
        deadline = time.monotonic() + 60
        for job_id in self.high_jobs:
            while True:
                with contextlib.suppress(PitstopError):
                    self.high_jobs[job_id] = self.client.get_job(job_id)
                if self.high_jobs[job_id].state in TERMINAL or time.monotonic() > deadline:
                    break
                time.sleep(API_POLL)

    def note_high_job(self, fault: Fault) -> None:
        """When a preempt fault's job ran and ended, from its events."""
        high = fault.extra["high_job"]
        for event in self.events:
            if event.job_id != high or event.id <= fault.cursor:
                continue
            key = {"job.running": "high_ran_seconds", "job.succeeded": "high_done_seconds"}
            if event.kind in key:
                fault.extra.setdefault(key[event.kind], round(event_time(event) - fault.at, 3))

    def decided_late(self, fault: Fault) -> bool:
        """Whether the scheduler decided a recovery after `fault` was over (before the
        next): it belongs to that fault, whose recovery then lasts until it ends."""
        if not any(e.job_id and e.kind in DECISIONS for e in self.since(fault.cursor)):
            return False
        fault.extra["decided_after_it_seemed_over"] = True
        fault.resumed_at = None
        return True

    def react(self, fault: Fault, event: common_pb2.Event) -> None:
        """Note when a stopped agent's node is lost; bring a killed leader back once
        another one leads."""
        if (
            fault.kind == "agent_stop"
            and event.kind == "node.lost"
            and event.node_id == fault.target
        ):
            fault.extra["declared_lost_seconds"] = round(event_time(event) - fault.at, 3)
        took_over = fault.kind == "leader_failover" and event.kind == "scheduler.leader"
        if fault.kind == "preempt" and event.kind == "job.resuming":
            fault.extra.setdefault("resumed_seconds", round(event_time(event) - fault.at, 3))
        if took_over and "takeover_seconds" not in fault.extra:
            fault.extra["takeover_seconds"] = round(event_time(event) - fault.at, 3)
            fault.pending.append(self.background(self.cluster.start_scheduler, fault.target))

    def continue_agent(self, fault: Fault, now: float) -> None:
        """SIGCONT for an agent_stop's agent once its node was lost and the scheduler
        decided, or CONTINUE_AFTER s after the loss."""
        lost = fault.extra.get("declared_lost_seconds")
        if lost is None or (fault.decision is None and now - fault.at < lost + CONTINUE_AFTER):
            return
        for pid in self.stopped & set(fault.extra["pids"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self.stopped.discard(pid)
            fault.extra["continued_seconds"] = round(now - fault.at, 3)

    # Bringing nodes back

    def bring_back(self, nodes: list[nodes_pb2.Node], in_use: set[str]) -> None:
        self.restoring = [self.background(self.restore, n, in_use) for n in nodes]

    def restore(self, node: nodes_pb2.Node, in_use: set[str]) -> None:
        """A node back as a ready spare: uncordoned when only cordoned or draining, else
        its daemons restarted (a stopped agent gets 10 s to come back by itself)."""
        began = time.monotonic()
        with self.cluster.client(timeout=30.0) as client:
            if node.connected:  # an injected early warning would drain it again
                with contextlib.suppress(PitstopError):
                    client.inject_fault(node.id, common_pb2.Fault(gpu_index=0, clear=True))
            if node.state in (common_pb2.NODE_STATE_CORDONED, common_pb2.NODE_STATE_DRAINING):
                client.uncordon_node(node.id, "chaos: back")
            elif not self.returns(client, node):
                self.cluster.restart_node(node.id, wait=True)
            if node.id not in in_use and node.role != common_pb2.NODE_ROLE_SPARE:
                client.set_node_role(node.id, common_pb2.NODE_ROLE_SPARE, "chaos: back as a spare")
        if self.faults:
            backs = self.faults[-1].extra.setdefault("nodes_back_seconds", {})
            backs[node.id] = round(time.monotonic() - began, 1)

    def returns(self, client: PitstopClient, node: nodes_pb2.Node, grace: float = 10.0) -> bool:
        """Whether the node is ready, or becomes so within `grace` s while its agent runs."""
        deadline = time.monotonic() + grace
        while not (node.connected and node.state == common_pb2.NODE_STATE_READY):
            if time.monotonic() > deadline or not self.cluster.daemon_pids(node.id, "agent"):
                return False
            time.sleep(0.5)
            with contextlib.suppress(PitstopError):
                node = client.get_node(node.id)
        return True

    def fault_events(self, fault: Fault) -> list[str]:
        """The events from the fault until it trained again, of the job, its node and
        the leadership."""
        end = (fault.resumed_at or time.time()) + 0.5
        return [
            format_event(e)
            for e in self.since(0)
            if fault.at - 0.5 <= event_time(e) <= end
            and (e.job_id or e.node_id in ("", fault.target))
        ]


def summary(chaos: Chaos) -> dict[str, Any]:
    """The faults by kind, recoveries by kind, the slow and the unfinished ones."""
    by_kind: dict[str, list[float]] = {}
    failures = [f for f in chaos.faults if f.kind != "preempt"]
    for fault in failures:
        if (recovery := fault.recovery()) is not None:
            by_kind.setdefault(fault.kind, []).append(recovery)
    preemptions = [f for f in chaos.faults if f.kind == "preempt"]
    decided = [event_time(f.decision) - f.at for f in chaos.faults if f.decision]
    worst = max((r for rs in by_kind.values() for r in rs), default=None)
    return {
        "faults_injected": len(chaos.faults),
        "faults_by_kind": {k: sum(1 for f in chaos.faults if f.kind == k) for k in chaos.kinds},
        "recovery_seconds_by_kind": {
            kind: {"n": len(rs), "median": round(statistics.median(rs), 3), "max": max(rs)}
            for kind, rs in sorted(by_kind.items())
        },
        "recovery_seconds_max": worst,
        "recovery_target_seconds": TARGET_RECOVERY,
        "decided_seconds_median": round(statistics.median(decided), 3) if decided else None,
        "over_target": [
            {**f.row(), "events": chaos.fault_events(f)}
            for f in failures
            if (f.recovery() or 0) > TARGET_RECOVERY
        ],
        "preemptions": {
            "n": len(preemptions),
            "high_job": {"dp": 2, "steps": HIGH_STEPS, "priority": HIGH_PRIORITY},
            "high_ran_after_submit_seconds": [f.extra.get("high_ran_seconds") for f in preemptions],
            "resumed_after_high_done_seconds": [
                round(f.extra["resumed_seconds"] - f.extra["high_done_seconds"], 3)
                if "resumed_seconds" in f.extra and "high_done_seconds" in f.extra
                else None
                for f in preemptions
            ],
            "high_jobs": [
                {
                    "id": job.id,
                    "state": common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_"),
                    "final_weights_sha256": job.result.get("final_weights_sha256", ""),
                }
                for job in chaos.high_jobs.values()
            ],
        },
        "not_recovered": [
            {**f.row(), "events": chaos.fault_events(f)}
            for f in chaos.faults
            if f.recovery() is None
        ],
        "faults": [f.row() for f in chaos.faults],
        "problems": chaos.problems,
    }


@dataclass
class Parts:
    """What a run started, for its JSON whatever way the run ends."""

    chaos: Chaos | None = None
    sampler: LagSampler | None = None


def chaos_run(args: argparse.Namespace, root: Path, result: dict[str, Any], parts: Parts) -> None:
    """The cluster up, the job run under faults, the cluster down; `result` filled."""
    with contextlib.ExitStack() as stack:
        if args.load:
            stack.enter_context(cpu_load(args.load, MAX_SECONDS))
            say(f"CPU load: {args.load} busy processes beside the run")
        postgres = stack.enter_context(OwnPostgres(root / "postgres"))
        redis = stack.enter_context(OwnRedis(root / "redis"))
        say(f"PostgreSQL at {postgres.url}, Redis at {redis.url}")
        cluster = stack.enter_context(
            running_cluster(
                root / "cluster",
                nodes=args.workers,
                spares=args.spares,
                port=0,
                database_url=postgres.url,
                redis_url=redis.url,
                schedulers=2,
                insecure=True,  # several schedulers: a local cluster of them runs insecure
                agent_owns_checkpointd=True,
                liveness_timeout=args.liveness_seconds,
                progress=say,
            )
        )
        parts.sampler = LagSampler(cluster)
        parts.sampler.start()
        stack.callback(parts.sampler.stop.set)
        chaos = parts.chaos = Chaos(cluster, postgres, redis, args)
        stack.callback(chaos.close)
        spec = example_spec(
            "bench-chaos",
            dp=args.workers,
            steps=args.steps,
            step_seconds=args.step_seconds,
            spares=2,
        )
        spec.integrity.hang_floor_seconds = HANG_FLOOR
        spec.preemptible, spec.min_run_seconds = True, 0  # the preempt faults' victim
        try:
            job = chaos.run(spec)
        except Stuck as exc:
            say(f"stuck: {exc}")
            result["stuck"] = str(exc)
            result["last_events"] = [format_event(e) for e in chaos.since(0)[-30:]]
            job = chaos.job
        chaos.settle_high_jobs()
        chaos.steps.poll()
        redone = (chaos.steps.lines() - args.steps * args.workers) / args.workers
        result["steps_run_twice"] = round(redone, 1)
        result["steps_run_twice_per_fault"] = round(redone / max(len(chaos.faults), 1), 2)
        result["job"] = {
            "id": job.id,
            "state": common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_"),
            "reason": job.reason,
            "generation": job.generation,
            "restarts": job.restarts,
            "final_weights_sha256": job.result.get("final_weights_sha256", ""),
            "skipped_steps": list(job.skipped_steps),
        }


def measure(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="pitstop-chaos-", dir="/tmp"))  # short: sockets
    result: dict[str, Any] = {
        "bench": "chaos",
        "machine": {"cpus": os.cpu_count()},
        "seed": args.seed,
        "faults_requested": args.faults,
        "nodes": {"workers": args.workers, "spares": args.spares, "schedulers": 2},
        "steps": args.steps,
        "step_seconds": args.step_seconds,
        "liveness_timeout_seconds": args.liveness_seconds,
        "cpu_load_procs": args.load,
    }
    say(f"run dir {root}; should this run be killed with SIGKILL, its cluster stays up:")
    say(f"  pitstop cluster down --state-dir {root / 'cluster'}")
    began = time.monotonic()
    parts = Parts()
    code = 1
    try:
        chaos_run(args, root, result, parts)
        result["wall_seconds"] = round(time.monotonic() - began, 1)
        if "stuck" not in result:
            say("the fault-free reference run, alone")
            skipped = result["job"]["skipped_steps"]
            with ReferenceRun(args.steps, skipped=skipped) as reference:
                expected = reference.final_hash()
            got = result["job"]["final_weights_sha256"]
            result["hash"] = {"equal": got == expected, "job": got, "reference": expected}
            code = 0 if got == expected and result["job"]["state"] == "SUCCEEDED" else 1
            high_jobs = parts.chaos.high_jobs if parts.chaos is not None else {}
            if high_jobs:
                say("the preempting jobs' fault-free reference run, alone")
                with ReferenceRun(HIGH_STEPS) as reference:
                    high_expected = reference.final_hash()
                high_equal = all(
                    j.state == common_pb2.JOB_STATE_SUCCEEDED
                    and j.result.get("final_weights_sha256") == high_expected
                    for j in high_jobs.values()
                )
                result["hash"]["high_jobs_equal"] = high_equal
                result["hash"]["high_reference"] = high_expected
                code = code if high_equal else 1
    finally:
        result.setdefault("wall_seconds", round(time.monotonic() - began, 1))
        if parts.chaos is not None:
            result.update(summary(parts.chaos))
        if parts.sampler is not None:
            result["scheduler_event_loop_lag"] = parts.sampler.summary()
        if args.keep:
            say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(result))
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--faults", type=int, default=50)
    add("--seed", type=int, default=0)
    add("--load", type=int, default=2, metavar="PROCS", help="busy processes beside (0: none)")
    add("--workers", type=int, default=4)
    add("--spares", type=int, default=3)
    add("--steps", type=int, default=0, help="the job's steps (default: from --faults)")
    add("--steps-per-fault", type=int, default=120)
    add("--step-seconds", type=float, default=0.1)
    add("--gap-steps", type=int, default=10, help="steps after a recovery before the next fault")
    add("--warmup-steps", type=int, default=30)
    add("--reserve-steps", type=int, default=60, help="no fault in the last N steps")
    add("--stall-seconds", type=float, default=120.0)
    add("--max-minutes", type=float, default=60.0)
    add("--liveness-seconds", type=float, default=DEFAULT_LIVENESS_TIMEOUT)
    add("--keep", action="store_true", help="keep the run's directory (logs)")
    add("--kinds", default="", help=f"comma-separated fault kinds (default all: {','.join(KINDS)})")
    args = parser.parse_args()
    unknown = set(filter(None, args.kinds.split(","))) - set(KINDS)
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}; use some of {', '.join(KINDS)}")
    if args.workers < 2 or args.spares < 2 or args.faults < 1:
        parser.error("give --workers 2 or more, --spares 2 or more, --faults 1 or more")
    args.steps = args.steps or (
        args.warmup_steps + args.reserve_steps + args.faults * args.steps_per_fault
    )
    with orderly_exit(notice=say):
        try:
            return measure(args)
        except (KeyboardInterrupt, Terminated) as stop:
            say(f"{'Ctrl-C' if isinstance(stop, KeyboardInterrupt) else stop}: stopped")
            return exit_code(stop)
        except (ClusterError, PitstopError, RuntimeError) as exc:
            say(f"error: {exc}")
            return 1


if __name__ == "__main__":
    sys.exit(main())
