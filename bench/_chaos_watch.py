"""bench/chaos.py's parts: the fault kinds and what a run waits for, the job's steps
as its ranks log them, the schedulers' loop lag, one fault's record, and what a run
watches and restores between faults."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.client.client import PitstopClient
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import ClusterError
from pitstop.client.localcluster.cluster import LocalCluster
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis
from pitstop.client.scenario import format_event
from pitstop.v1 import common_pb2, jobs_pb2, nodes_pb2

KINDS = (
    *("xid_fatal", "xid_app", "rank_kill", "node_kill", "agent_kill", "checkpointd_kill"),
    *("agent_stop", "drain", "scheduler_kill", "leader_failover", "postgres_restart"),
    *("redis_flush", "sdc", "nan", "hang", "row_remap", "fail_preflight", "preempt"),
    *("link_flap", "link_down", "pcie_fatal", "oom", "disk_full"),
)
HOST_CLEAR = common_pb2.Fault(host=common_pb2.HostFault(clear=True))
"""Every injected host fault undone (a link back up, the disk read as it is)."""
HOST_DRILLS = {
    "link_flap": common_pb2.HostFault(link_flap=common_pb2.PortCount(port="mlx5_0/1", count=4)),
    "link_down": common_pb2.HostFault(link_down="mlx5_0/1"),
    "pcie_fatal": common_pb2.HostFault(pcie_aer=1),
    "oom": common_pb2.HostFault(oom=True),
    "disk_full": common_pb2.HostFault(disk_full=True),
}
"""The host faults, as `pitstop node inject-fault` sends them."""
DISK_FULL_SECONDS = 10.0
"""How long a disk_full fault's disk reads full before the chaos run gives its room back."""
HIGH_STEPS, HIGH_PRIORITY = 40, 10
"""A preempt fault's job: its steps (paced as the chaos job) and priority."""
DECIDED = {
    *("xid_fatal", "xid_app", "rank_kill", "node_kill", "agent_kill", "drain", "sdc"),
    *("hang", "row_remap", "preempt", "link_flap", "link_down", "pcie_fatal", "oom"),
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
        self._read: dict[Path, tuple[int, int]] = {}  # path -> (inode, bytes read)

    def poll(self) -> None:
        now = time.time()
        for path in self.state_dir.glob(self.logs):
            with path.open("rb") as log:
                # A standby that takes its rank over on the same node starts the log
                # anew (the old one kept as rank-N.1.log): a new file is read from 0.
                inode = os.fstat(log.fileno()).st_ino
                known, offset = self._read.get(path, (inode, 0))
                offset = offset if known == inode else 0
                log.seek(offset)
                chunk = log.read()
            complete = chunk.rfind(b"\n") + 1
            self._read[path] = (inode, offset + complete)
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


class ChaosWatch:
    """What a chaos run knows and keeps up to date: the job and its events as polled,
    when the next fault may come, and nodes brought back after one (bench/chaos.py's
    Chaos injects the faults and follows them)."""

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
        self.spared: set[str] = set()
        """Nodes no fault targets while another may be (bench/soak.py's steady nodes)."""
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
                with contextlib.suppress(PitstopError):
                    client.inject_fault(node.id, HOST_CLEAR)
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
