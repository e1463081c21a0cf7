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
  link_flap         a port of a node's host goes down and up 4 times (inject-fault
                    --link-flap mlx5_0/1:4): the node drains at the next committed step
  link_down         a port of a node's host goes down (--link-down): the node is replaced
  pcie_fatal        a fatal PCIe AER error on a node's GPU (--pcie-aer 1): replaced
  oom               the kernel kills the rank on a node's GPU for memory (--oom): its exit
                    says OOM and it restarts in place
  disk_full         a node's daemons' disk reads full (--disk-full) for DISK_FULL_SECONDS:
                    reported, the job rides through; then its room is back
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
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pitstop.client.cpuload import MAX_SECONDS, cpu_load
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import (
    DEFAULT_LIVENESS_TIMEOUT,
    ClusterError,
    holding_a_rank,
    running_cluster,
)
from pitstop.client.localcluster.statefile import Kind
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis
from pitstop.client.scenario import ReferenceRun, example_spec, format_event
from pitstop.client.signals import Terminated, exit_code, orderly_exit
from pitstop.v1 import common_pb2, jobs_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._chaos_watch import (
    API_POLL,
    CONTINUE_AFTER,
    DECIDED,
    DECISIONS,
    DISK_FULL_SECONDS,
    HANG_FLOOR,
    HIGH_PRIORITY,
    HIGH_STEPS,
    HOST_CLEAR,
    HOST_DRILLS,
    KINDS,
    NO_DECISION,
    RESUMED,
    SETTLE,
    TARGET_RECOVERY,
    TERMINAL,
    ChaosWatch,
    Fault,
    LagSampler,
    Steps,
    Stuck,
    event_time,
    say,
)


class Chaos(ChaosWatch):
    """Runs the job, injects the faults one at a time and follows each to its end."""

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
            target = self.random.choice([n for n in spares if n not in self.spared] or spares)
        else:
            nodes = sorted({a.node_id for a in self.job.rank_map.ranks})
            nodes = [n for n in nodes if n not in self.spared] or nodes
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
        elif kind in HOST_DRILLS:
            self.client.inject_fault(target, common_pb2.Fault(gpu_index=0, host=HOST_DRILLS[kind]))
            if kind == "disk_full":
                fault.pending.append(self.background(self.room_back, target))
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
            pids = holding_a_rank(self.cluster.rank_pids(target))  # not a standby beside it
            if pids:
                os.kill(min(pids), signal.SIGKILL)
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

    def room_back(self, node_id: str) -> None:
        """A disk_full fault's end: the node's disk reads as it is again."""
        time.sleep(DISK_FULL_SECONDS)  # how long the fault lasts, not a wait for anything
        self.client.inject_fault(node_id, HOST_CLEAR)

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
