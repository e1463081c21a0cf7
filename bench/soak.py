"""Soak: hours of jobs coming and going under faults of every kind, and whether anything
grows.

A local cluster as bench/chaos.py starts it (--workers workers, --spares spares, two
schedulers on a PostgreSQL and a Redis of the run's own, simulated GPUs, --load busy
processes beside), with what ended jobs leave behind deleted --retention-seconds after
they end (PITSTOP_ENDED_JOB_RETENTION_SECONDS, 600 here). For --minutes it runs one
example GPT job after another, each preemptible, dp = --workers, through
--faults-per-job chaos faults (bench/chaos.py's kinds, every kind once per round, the
rounds running on from job to job; a preempt fault submits a high-priority job that
preempts it), and every --cancel-every'th job is cancelled a few steps in instead. The
job running when the time is up finishes.

Sampled every --sample-seconds (60): the RSS and open descriptors of every pitstop
process (schedulers, agents, checkpoint daemons, zygotes, ranks), both less the /dev/shm
segments it maps (they come and go with the job running), Redis `used_memory`, the
PostgreSQL database's size and each table's size and rows, the pitstop files in
/dev/shm, and of those the checkpoint daemons' segments whose daemon is gone and that
were so at the sample before too (a live daemon's come and go with the jobs, within its
memory budget; a killed daemon's are cleared by its restart seconds later; an orphan
stays). A process's descriptors that grew are listed by kind (`fd_kinds_gained`).
A process is followed by its pid; its slope is fitted from --warmup-minutes (10) after
its first sample on, when that leaves at least half of the run after the warm-up (five
minutes at the least); shorter-lived processes (ranks, daemons a fault restarted) are
listed without one. Redis and PostgreSQL keep what a job left for the retention after it
ended, so they fill until the first job's is deleted: their slopes are fitted from the
first job's end plus the retention plus a minute (the sweep) on, or from the warm-up's
end if later (`store_warmup_seconds`). Faults restart a node's daemons every few
minutes, so no fault targets the first --steady-nodes (2) workers: they run ranks,
standbys and replicas like the others, and their agents, checkpoint daemons and zygotes
live the whole run. (The two schedulers are killed in turn by the scheduler faults.)

At the end, with the cluster down, each job's fault-free reference run gives the hash it
must end with. Targets: every job SUCCEEDED (a cancelled one CANCELLED) with its hash, no
recovery over 10 s, every process's RSS slope <= 5 MB/h, Redis and PostgreSQL slopes <=
1 MB/h, no descriptor growth, orphaned /dev/shm segments <= 1 MB/h.

    .venv/bin/python bench/soak.py [--minutes 60] [--load 2] [--seed 0]

Progress goes to stderr; the last line of stdout is one JSON object (exit code 0 when
every target holds). On any end (Ctrl-C, SIGTERM and SIGHUP included) the cluster, the
stores and the load stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.client.client import PitstopClient
from pitstop.client.cpuload import MAX_SECONDS, cpu_load
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import ClusterError, running_cluster
from pitstop.client.localcluster.cluster import LocalCluster
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis
from pitstop.client.scenario import ReferenceRun, example_spec, format_event
from pitstop.client.signals import Terminated, exit_code, orderly_exit
from pitstop.v1 import common_pb2, jobs_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._chaos_watch import (
    HANG_FLOOR,
    HIGH_STEPS,
    KINDS,
    TARGET_RECOVERY,
    TERMINAL,
    Steps,
    Stuck,
    say,
)
from bench._soak_samples import Sampler
from bench.chaos import Chaos

RSS_TARGET, STORE_TARGET = 5.0, 1.0
"""MB per hour: the most a process's RSS, and Redis or PostgreSQL, may grow after warm-up."""
CANCEL_AFTER_STEPS, CANCEL_WAIT = 20, 120.0
"""A cancelled job is cancelled after this many steps, and must be CANCELLED this soon."""


def state_name(job: jobs_pb2.Job) -> str:
    return common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")


@dataclass
class Soak:
    """The jobs run so far, their faults, and the kinds still to draw this round."""

    cluster: LocalCluster
    postgres: OwnPostgres
    redis: OwnRedis
    args: argparse.Namespace
    jobs: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    high_jobs: list[dict[str, Any]] = field(default_factory=list)
    first_ended: float | None = None  # monotonic
    _bag: list[str] = field(default_factory=list)

    @property
    def steady(self) -> list[str]:
        """The workers no fault targets: their daemons live the whole run (the others'
        are restarted by the faults every few minutes), so their growth can be read."""
        workers = sorted(n.node_id for n in self.cluster.nodes if n.node_id.startswith("node-"))
        return workers[: self.args.steady_nodes]

    def run(self, until: float) -> None:
        """Job after job until `until` (monotonic); the last one started runs to its end."""
        while time.monotonic() < until:
            index = len(self.jobs) + 1
            if self.args.cancel_every and index % self.args.cancel_every == 0:
                self.cancelled_job(index)
            else:
                self.chaos_job(index)
            if self.first_ended is None:
                self.first_ended = time.monotonic()

    def next_kinds(self, n: int) -> list[str]:
        """The next `n` fault kinds: every kind once per round, each round shuffled."""
        kinds: list[str] = []
        while len(kinds) < n:
            if not self._bag:
                self._bag = list(KINDS)
                random.Random(self.args.seed * 1000 + len(self.jobs)).shuffle(self._bag)
            kinds.append(self._bag.pop())
        return kinds

    def chaos_job(self, index: int) -> None:
        args = self.args
        steps = args.warmup_steps + args.reserve_steps + args.faults_per_job * args.steps_per_fault
        job_args = argparse.Namespace(**vars(args))
        job_args.faults, job_args.steps, job_args.kinds = args.faults_per_job, steps, ""
        job_args.seed = args.seed * 1000 + index
        chaos = Chaos(self.cluster, self.postgres, self.redis, job_args)
        chaos.spared = set(self.steady)
        kinds = self.next_kinds(args.faults_per_job)
        chaos._bag = list(reversed(kinds))  # drawn in this order
        spec = example_spec(
            f"soak-{index}", dp=args.workers, steps=steps, step_seconds=args.step_seconds, spares=2
        )
        spec.integrity.hang_floor_seconds = HANG_FLOOR
        spec.preemptible, spec.min_run_seconds = True, 0  # the preempt faults' victim
        say(f"job {index}: {steps} steps, faults {', '.join(kinds)}")
        stuck, tail = "", []
        try:
            job = chaos.run(spec)
        except Stuck as exc:
            stuck = str(exc)
            say(f"job {index} stuck: {exc}")
            self.problems.append(f"job {index} ({chaos.job.id}): {exc}")
            tail = [format_event(e) for e in chaos.since(0)[-20:]]
            job = self.give_up(chaos.job.id)
        finally:
            with contextlib.suppress(PitstopError):
                chaos.settle_high_jobs()
            chaos.close()
        for high in chaos.high_jobs.values():
            self.high_jobs.append(
                {
                    "id": high.id,
                    "state": state_name(high),
                    "sha256": high.result.get("final_weights_sha256", ""),
                }
            )
        self.problems += [f"job {index}: {p}" for p in chaos.problems]
        for fault in chaos.faults:
            self.faults.append({"job": index, **fault.row()})
        record = {
            "index": index,
            "id": job.id,
            "kind": "chaos",
            "steps": steps,
            "state": state_name(job),
            "expected": "SUCCEEDED",
            "skipped_steps": list(job.skipped_steps),
            "sha256": job.result.get("final_weights_sha256", ""),
            "faults": [f.kind for f in chaos.faults],
        }
        if stuck:
            record.update(stuck=stuck, last_events=tail)
        self.jobs.append(record)
        say(f"job {index}: {record['state']}")

    def give_up(self, job_id: str) -> jobs_pb2.Job:
        """Cancel a stuck job (the soak goes on) and return it as it ended."""
        with self.cluster.client(timeout=30.0) as client, contextlib.suppress(PitstopError):
            client.cancel_job(job_id, "soak: stuck")
            return self.wait_ended(client, job_id)
        return jobs_pb2.Job(id=job_id)

    def cancelled_job(self, index: int) -> None:
        """A job cancelled CANCEL_AFTER_STEPS steps in: it must end CANCELLED."""
        args = self.args
        spec = example_spec(
            f"soak-{index}-cancelled", dp=2, steps=1000, step_seconds=args.step_seconds, spares=0
        )
        with self.cluster.client(timeout=30.0) as client:
            job = client.submit_job(spec)
            say(f"job {index}: {job.id}, to be cancelled after {CANCEL_AFTER_STEPS} steps")
            steps = Steps(self.cluster.state_dir, job.id)
            deadline = time.monotonic() + args.stall_seconds
            while steps.newest < CANCEL_AFTER_STEPS and time.monotonic() < deadline:
                time.sleep(0.5)
                steps.poll()
            if steps.newest < CANCEL_AFTER_STEPS:
                self.problems.append(f"job {index}: no step {CANCEL_AFTER_STEPS} in time")
            client.cancel_job(job.id, "soak: cancelled")
            job = self.wait_ended(client, job.id)
        self.jobs.append(
            {
                "index": index,
                "id": job.id,
                "kind": "cancelled",
                "state": state_name(job),
                "expected": "CANCELLED",
            }
        )
        say(f"job {index}: {state_name(job)}")

    @staticmethod
    def wait_ended(client: PitstopClient, job_id: str) -> jobs_pb2.Job:
        deadline = time.monotonic() + CANCEL_WAIT
        job = client.get_job(job_id)
        while job.state not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
            job = client.get_job(job_id)
        return job


def check_hashes(soak: Soak) -> dict[str, Any]:
    """Each succeeded job's hash against its fault-free reference run (one run per
    distinct steps and skipped batches), the preempting jobs' against theirs."""
    references: dict[tuple[int, tuple[int, ...]], str] = {}

    def reference(steps: int, skipped: tuple[int, ...]) -> str:
        if (steps, skipped) not in references:
            say(f"reference run: {steps} steps, skipping {list(skipped) or 'none'}")
            with ReferenceRun(steps, skipped=skipped) as run:
                references[steps, skipped] = run.final_hash()
        return references[steps, skipped]

    mismatches = []
    for job in soak.jobs:
        if job["kind"] != "chaos" or job["state"] != "SUCCEEDED":
            continue
        job["hash_equal"] = job["sha256"] == reference(job["steps"], tuple(job["skipped_steps"]))
        if not job["hash_equal"]:
            mismatches.append(job["id"])
    for high in soak.high_jobs:
        if high["state"] == "SUCCEEDED":
            high["hash_equal"] = high["sha256"] == reference(HIGH_STEPS, ())
            if not high["hash_equal"]:
                mismatches.append(high["id"])
    return {"hash_mismatches": len(mismatches), "mismatched_jobs": mismatches}


def outcome(soak: Soak) -> dict[str, Any]:
    """The jobs and the recoveries, as the JSON reports them."""
    failures = [f for f in soak.faults if f["kind"] != "preempt"]
    slow = [f for f in failures if (f["recovery_seconds"] or 0) > TARGET_RECOVERY]
    ended_as_expected = [j for j in soak.jobs if j["state"] == j["expected"]]
    highs_ok = [h for h in soak.high_jobs if h["state"] == "SUCCEEDED"]
    recoveries = sorted(f["recovery_seconds"] for f in failures if f["recovery_seconds"])
    return {
        "jobs": len(soak.jobs) + len(soak.high_jobs),
        "jobs_succeeded": len(ended_as_expected) + len(highs_ok),
        "jobs_by_kind": {
            "chaos": sum(1 for j in soak.jobs if j["kind"] == "chaos"),
            "cancelled": sum(1 for j in soak.jobs if j["kind"] == "cancelled"),
            "preempting": len(soak.high_jobs),
        },
        "faults": len(soak.faults),
        "faults_by_kind": {k: sum(1 for f in soak.faults if f["kind"] == k) for k in KINDS},
        "recoveries_over_10s": len(slow),
        "recovery_seconds_max": recoveries[-1] if recoveries else None,
        "recovery_seconds_median": recoveries[len(recoveries) // 2] if recoveries else None,
        "not_recovered": [f for f in failures if f["recovery_seconds"] is None],
        "over_10s": slow,
    }


def targets(result: dict[str, Any]) -> dict[str, bool]:
    def at_most(key: str, bound: float) -> bool:
        value = result.get(key)
        return value is not None and value <= bound

    return {
        "every_job_as_expected": result.get("jobs_succeeded") == result.get("jobs"),
        "hashes_equal": result.get("hash_mismatches") == 0,
        # A fault after which training was never seen again is no recovery under 10 s.
        "no_recovery_over_10s": result.get("recoveries_over_10s") == 0
        and not result.get("not_recovered", []),
        "rss_slope": at_most("rss_slope_mb_per_hour_max", RSS_TARGET),
        "redis_slope": at_most("redis_slope_mb_per_hour", STORE_TARGET),
        "pg_slope": at_most("pg_slope_mb_per_hour", STORE_TARGET),
        "no_fd_growth": at_most("fd_growth_max", 0),
        "no_shm_growth": at_most("shm_orphaned_slope_mb_per_hour", STORE_TARGET),
    }


@dataclass
class Parts:
    """What a run started, for its JSON whatever way the run ends."""

    soak: Soak | None = None
    sampler: Sampler | None = None


def soak_run(args: argparse.Namespace, root: Path, parts: Parts) -> None:
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
                env={"PITSTOP_ENDED_JOB_RETENTION_SECONDS": str(args.retention_seconds)},
                progress=say,
            )
        )
        sampler = parts.sampler = Sampler(
            cluster.state_dir, redis.url, postgres.url, every=args.sample_seconds
        )
        sampler.start()
        stack.callback(sampler.stop.set)
        parts.soak = Soak(cluster, postgres, redis, args)
        parts.soak.run(sampler.began + args.minutes * 60)
        sampler.stop.set()
        sampler.join(timeout=120)


def measure(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="pitstop-soak-", dir="/tmp"))  # short: sockets
    result: dict[str, Any] = {
        "bench": "soak",
        "machine": {"cpus": os.cpu_count()},
        "settings": {
            k: getattr(args, k)
            for k in (
                *("minutes", "seed", "load", "workers", "spares", "faults_per_job"),
                *("steps_per_fault", "step_seconds", "cancel_every", "retention_seconds"),
                *("sample_seconds", "warmup_minutes", "steady_nodes"),
            )
        },
    }
    say(f"run dir {root}; should this run be killed with SIGKILL, its cluster stays up:")
    say(f"  pitstop cluster down --state-dir {root / 'cluster'}")
    began = time.monotonic()
    parts = Parts()
    code = 1
    try:
        soak_run(args, root, parts)
        result["wall_seconds"] = round(time.monotonic() - began, 1)
        assert parts.soak is not None
        result.update(check_hashes(parts.soak))
        checks = targets({**result, **summary(parts, args)})
        code = 0 if all(checks.values()) else 1
    finally:
        result.setdefault("wall_seconds", round(time.monotonic() - began, 1))
        result.update(summary(parts, args))
        result["targets_met"] = targets(result)
        if parts.soak is not None:
            result["job_list"] = parts.soak.jobs + parts.soak.high_jobs
            result["fault_list"] = parts.soak.faults
            result["problems"] = parts.soak.problems
        if args.keep:
            say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(result))
    return code


def summary(parts: Parts, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if parts.soak is not None:
        out.update(outcome(parts.soak))
    if parts.sampler is not None:
        warmup = args.warmup_minutes * 60
        stores = warmup
        if parts.soak is not None and parts.soak.first_ended is not None:
            # Redis and PostgreSQL keep what a job left for the retention after it ended:
            # they fill until the first job's is deleted (the sweep comes within a minute).
            filled = parts.soak.first_ended - parts.sampler.began + args.retention_seconds + 60
            stores = max(warmup, filled)
        after = args.minutes * 60 - warmup
        out.update(parts.sampler.summary(warmup, max(300.0, after / 2), stores))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--minutes", type=float, default=60.0, help="how long jobs keep coming")
    add("--seed", type=int, default=0)
    add("--load", type=int, default=2, metavar="PROCS", help="busy processes beside (0: none)")
    add("--workers", type=int, default=4)
    add("--spares", type=int, default=3)
    add("--faults-per-job", type=int, default=3)
    add("--steps-per-fault", type=int, default=120)
    add("--step-seconds", type=float, default=0.1)
    add("--cancel-every", type=int, default=5, help="every Nth job is cancelled (0: none)")
    add("--steady-nodes", type=int, default=2, help="workers no fault targets (see above)")
    add("--retention-seconds", type=float, default=600.0)
    add("--sample-seconds", type=float, default=60.0)
    add("--warmup-minutes", type=float, default=10.0)
    add("--keep", action="store_true", help="keep the run's directory (logs)")
    args = parser.parse_args()
    if args.workers < 2 or args.spares < 2 or args.faults_per_job < 1 or args.minutes <= 0:
        parser.error("give --workers and --spares 2 or more, --faults-per-job 1 or more")
    if not 0 <= args.steady_nodes <= args.workers - 2:
        parser.error(f"--steady-nodes {args.steady_nodes}: give 0 to --workers less 2")
    if args.warmup_minutes >= args.minutes:
        parser.error(f"--warmup-minutes {args.warmup_minutes:g} leaves nothing of --minutes")
    # What bench/chaos.py's per-job machinery reads.
    args.gap_steps, args.warmup_steps, args.reserve_steps = 10, 30, 60
    args.stall_seconds, args.max_minutes = 120.0, 20.0
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
