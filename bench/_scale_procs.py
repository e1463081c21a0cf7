"""bench/scale.py's processes, stores and measurements: the pitstop-scheduler processes,
their PostgreSQL and Redis, the windows a phase is measured over, the events it waits
for, and the end of every process it started, whatever ends the run."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis as SyncRedis

from bench._scale_fleet import Fleet
from bench._scale_sim import GPUS, load
from pitstop.client.launch import clean_env, scheduler_command
from pitstop.client.localcluster.spawning import free_port
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis
from pitstop.client.signals import dying_with_parent
from pitstop.v1 import jobs_pb2

# Processes, stores, measurements


LEASE_SECONDS = 4.0
"""The leader lease (the scheduler's default): a deciding process that dies is replaced
within about one period."""


class Scheduler:
    """One pitstop-scheduler process on the benchmark's stores."""

    def __init__(
        self,
        root: Path,
        name: str,
        database_url: str,
        redis_url: str,
        tls_dir: Path | None,
        role: str = "both",
        keepalive: tuple[float, float] | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        """`settings`: more of the scheduler's environment (PITSTOP_*), as given."""
        self.name = name
        self.role = role  # "both"; "decider": no agent streams; "ingest": no leader loops
        self.port = free_port()
        self.node_port = free_port() if tls_dir is not None else self.port
        self.metrics_port = free_port()
        self.log = root / f"{name}.log"
        env = clean_env(
            PITSTOP_DATABASE_URL=database_url,
            PITSTOP_REDIS_URL=redis_url,
            PITSTOP_REDIS_PREFIX="scale:",
            PITSTOP_HOST="127.0.0.1",
            PITSTOP_PORT=str(self.port),
            PITSTOP_METRICS_PORT=str(self.metrics_port),
            PITSTOP_DASHBOARD_PORT="0",  # a free one each: several processes side by side
            PITSTOP_STATE_DIR=str(root / name),
            PITSTOP_LOG_LEVEL="WARNING",
            PITSTOP_LEADER_LEASE_SECONDS=str(LEASE_SECONDS),
            GRPC_VERBOSITY="ERROR",
        )
        if keepalive is not None:  # else the scheduler's defaults, as users run it
            env["PITSTOP_KEEPALIVE_SECONDS"] = str(keepalive[0])
            env["PITSTOP_KEEPALIVE_TIMEOUT_SECONDS"] = str(keepalive[1])
        env.update(settings or {})
        if role == "decider":
            env["PITSTOP_AGENT_STREAMS"] = "false"
        elif role == "ingest":
            env["PITSTOP_LEADER_LOOPS"] = "false"
        if tls_dir is not None:
            # Mutual TLS for the nodes, as users run it; the CA is the benchmark's.
            env.update(
                PITSTOP_TLS="true",
                PITSTOP_TLS_DIR=str(tls_dir),
                PITSTOP_NODE_PORT=str(self.node_port),
            )
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                dying_with_parent(scheduler_command()),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.ps: psutil.Process | None = None

    @property
    def target(self) -> str:
        """Where people's clients call."""
        return f"127.0.0.1:{self.port}"

    @property
    def node_target(self) -> str:
        """Where agents connect (the mutual-TLS port with TLS)."""
        return f"127.0.0.1:{self.node_port}"

    async def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while b"listening on" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} did not start:\n{tail}")
            await asyncio.sleep(0.05)
        # The process that serves: the wrapper execs it, so the pid is the scheduler's.
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        if self.ps is None or not self.alive():
            return 0.0
        times = self.ps.cpu_times()
        return float(times.user + times.system)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        out: dict[str, Any] = {
            "lag_buckets": {},
            "leader": 0.0,
            "lag_gauge": {},
            "beats": 0.0,
            "beat_lag_buckets": {},
            "decisions": 0.0,
            "decision_seconds": 0.0,
        }
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "pitstop_scheduler_event_loop_lag_seconds_bucket":
                    out["lag_buckets"][float(sample.labels["le"])] = sample.value
                elif sample.name == "pitstop_scheduler_event_loop_lag_quantile_seconds":
                    out["lag_gauge"][sample.labels["q"]] = sample.value
                elif sample.name.startswith("pitstop_scheduler_decision_seconds_") and (
                    sample.labels.get("decision") == "recovery"
                ):
                    if sample.name.endswith("_count"):
                        out["decisions"] = sample.value
                    elif sample.name.endswith("_sum"):
                        out["decision_seconds"] = sample.value
                elif sample.name == "pitstop_scheduler_heartbeat_lag_seconds_bucket":
                    out["beat_lag_buckets"][float(sample.labels["le"])] = sample.value
                elif sample.name == "pitstop_scheduler_heartbeat_lag_seconds_count":
                    out["beats"] = sample.value
                elif sample.name == "pitstop_scheduler_leader":
                    out["leader"] = sample.value
        return out

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)


def stop_schedulers(schedulers: list[Scheduler], grace: float) -> None:
    """SIGTERM to every one at once, SIGKILL to those still up `grace` seconds on."""
    for s in schedulers:
        s.terminate()
    deadline = time.monotonic() + grace
    while any(s.alive() for s in schedulers) and time.monotonic() < deadline:
        time.sleep(0.05)
    for s in schedulers:
        s.kill()


def decision_totals(schedulers: list[Scheduler]) -> tuple[float, float]:
    """Recovery decisions made so far by every live scheduler, and their seconds."""
    count = total = 0.0
    for s in schedulers:
        if s.alive():
            with contextlib.suppress(OSError):
                m = s.metrics()
                count, total = count + m["decisions"], total + m["decision_seconds"]
    return count, total


def reap_children(grace: float) -> list[str]:
    """Every process under this one (its children's children too), ended: SIGTERM, then
    after `grace` seconds SIGCONT and SIGKILL for any still there (a stopped process dies
    of SIGTERM only once continued). What was still there to kill."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    for proc in children:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace)
    killed = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            killed.append(f"{proc.pid} {proc.name()}")
            proc.send_signal(signal.SIGCONT)
            proc.kill()
    psutil.wait_procs(alive, timeout=1.0)
    return killed


def tree_cpu(pid: int | None) -> float:
    """CPU seconds of a process and its children (PostgreSQL's backends)."""
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system
        return total
    except psutil.Error:
        return 0.0


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def lag_p99(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The bucket bound under which 99% of the window's loop-lag samples fell."""
    bounds = sorted(after)
    delta = {b: after[b] - before.get(b, 0.0) for b in bounds}
    total = delta.get(math.inf, 0.0)
    if total <= 0:
        return None
    for bound in bounds:
        if delta[bound] >= 0.99 * total:
            return bound
    return math.inf


@dataclass
class Stores:
    postgres: OwnPostgres
    redis: OwnRedis
    r: SyncRedis = field(init=False)

    def __post_init__(self) -> None:
        self.r = SyncRedis.from_url(self.redis.url)

    def redis_calls(self) -> dict[str, int]:
        stats = self.r.info("commandstats")
        return {
            k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in stats.items()
            if k not in ("cmdstat_info",)
        }

    def pg_stats(self) -> dict[str, int]:
        with psycopg.connect(self.postgres.url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT xact_commit + xact_rollback, tup_returned, tup_fetched, tup_inserted,"
                " tup_updated, tup_deleted FROM pg_stat_database WHERE datname = 'postgres'"
            ).fetchone()
        assert row is not None
        names = ("xacts", "tup_returned", "tup_fetched", "tup_inserted", "tup_updated")
        return dict(zip((*names, "tup_deleted"), (int(x) for x in row), strict=True))


class Window:
    """Counters at a window's start and end."""

    def __init__(self, stores: Stores, schedulers: list[Scheduler], fleet: Fleet) -> None:
        self.stores, self.schedulers, self.fleet = stores, schedulers, fleet

    def read(self) -> dict[str, Any]:
        """The stores' and schedulers' counters (in a thread: they block)."""
        return {
            "t": time.monotonic(),
            "redis": self.stores.redis_calls(),
            "pg": self.stores.pg_stats(),
            "sched_cpu": [s.cpu() for s in self.schedulers],
            "bench_cpu": own_cpu(),
            "pg_cpu": tree_cpu(self.stores.postgres.pid),
            "redis_cpu": tree_cpu(self.stores.redis.pid),
            "metrics": [s.metrics() if s.alive() else None for s in self.schedulers],
        }

    async def counters(self) -> dict[str, Any]:
        await self.fleet.refresh()
        return {**await asyncio.to_thread(self.read), **self.fleet.counters()}

    async def measure(self, seconds: float) -> dict[str, Any]:
        a = await self.counters()
        self.fleet.take_lag()
        await asyncio.sleep(seconds)
        b = await self.counters()
        sim_lag, relay_lag = self.fleet.take_lag()
        span = b["t"] - a["t"]
        redis_delta = {k: v - a["redis"].get(k, 0) for k, v in b["redis"].items()}
        redis_delta = {k: v for k, v in redis_delta.items() if v}
        pg_delta = {k: v - a["pg"][k] - (1 if k == "xacts" else 0) for k, v in b["pg"].items()}
        sent = {k: v - a["sent"].get(k, 0) for k, v in b["sent"].items()}
        sent = {"heartbeat": 0, "step_summaries": 0, "samples": 0, "windows": 0, **sent}
        # Heartbeats the scheduler processes handled: their heartbeat-lag observations.
        ingested = sum(
            mb["beats"] - ma["beats"]
            for ma, mb in zip(a["metrics"], b["metrics"], strict=True)
            if ma and mb
        )
        cpus = [y - x for x, y in zip(a["sched_cpu"], b["sched_cpu"], strict=True)]
        lags = [
            lag_p99(ma["lag_buckets"], mb["lag_buckets"]) if ma and mb else None
            for ma, mb in zip(a["metrics"], b["metrics"], strict=True)
        ]
        gauges = [m["lag_gauge"].get("0.99") if m else None for m in b["metrics"]]
        beat_lags = [
            lag_p99(ma["beat_lag_buckets"], mb["beat_lag_buckets"]) if ma and mb else None
            for ma, mb in zip(a["metrics"], b["metrics"], strict=True)
        ]
        beats = max(sent["heartbeat"], 1)
        return {
            "seconds": round(span, 1),
            "loadavg": load(),
            "heartbeats_sent_per_s": round(sent["heartbeat"] / span, 1),
            "heartbeats_ingested_per_s": round(ingested / span, 1),
            "step_summaries_per_s": round(sent["step_summaries"] / span, 1),
            "step_samples_folded_per_s": round(sent["samples"] / span, 1),
            "rank_windows_per_s": round(sent["windows"] / span, 1),
            "scheduler_cpu_pct": [round(100 * c / span, 1) for c in cpus],
            "scheduler_cpu_pct_total": round(100 * sum(cpus) / span, 1),
            "scheduler_cpu_ms_per_1k_heartbeats": round(1e6 * sum(cpus) / beats, 1),
            "simulator_cpu_pct": round(100 * (b["sim_cpu"] - a["sim_cpu"]) / span, 1),
            "relay_cpu_pct": round(100 * (b["relay_cpu"] - a["relay_cpu"]) / span, 1),
            "bench_cpu_pct": round(100 * (b["bench_cpu"] - a["bench_cpu"]) / span, 1),
            "postgres_cpu_pct": round(100 * (b["pg_cpu"] - a["pg_cpu"]) / span, 1),
            "redis_cpu_pct": round(100 * (b["redis_cpu"] - a["redis_cpu"]) / span, 1),
            "loop_lag_p99_seconds": lags,
            "loop_lag_p99_gauge_1min": gauges,
            "heartbeat_lag_p99_seconds": beat_lags,
            "simulator_loop_lag_max_seconds": round(sim_lag, 3),
            "relay_loop_lag_max_seconds": round(relay_lag, 3),
            "redis_calls": redis_delta,
            "redis_calls_per_heartbeat": round(sum(redis_delta.values()) / beats, 3),
            "pg": pg_delta,
            "pg_xacts_per_heartbeat": round(pg_delta["xacts"] / beats, 4),
            "streams_reopened": b["registrations"] - a["registrations"],
            "_beats": sent["heartbeat"],
            "_batches": sent["step_summaries"],
            "_redis_total": sum(redis_delta.values()),
        }


class Events:
    """The scheduler's event log, read straight from PostgreSQL (not through the
    scheduler: the benchmark must not load what it measures)."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        row = self.conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()
        self.last = int(row[0]) if row else 0
        # Read and not yet passed by a wait: the events after the one a wait returned
        # are the next wait's (a decision read in the same poll as its failure's
        # detection was dropped with it, and its failure counted as "no decision").
        self.unread: list[tuple[int, str, str | None, str | None, float, dict[str, str]]] = []

    def skip(self) -> None:
        """Forget everything that happened so far."""
        self.since()
        self.unread.clear()

    def since(self) -> list[tuple[int, str, str | None, str | None, float, dict[str, str]]]:
        rows = self.conn.execute(
            "SELECT id, kind, node_id, job_id, extract(epoch from time), attributes"
            " FROM events WHERE id > %s ORDER BY id",
            (self.last,),
        ).fetchall()
        if rows:
            self.last = int(rows[-1][0])
        return [(int(r[0]), r[1], r[2], r[3], float(r[4]), r[5] or {}) for r in rows]

    async def wait(self, match: Any, timeout: float) -> tuple[Any, ...] | None:
        """The first event, oldest first, that `match`es; the events before it are
        passed, those after it kept for the next wait."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.unread += await asyncio.to_thread(self.since)
            for index, event in enumerate(self.unread):
                if match(event):
                    del self.unread[: index + 1]
                    return tuple(event)
            await asyncio.sleep(0.02)
        return None

    def generation(self, job_id: str) -> int:
        row = self.conn.execute("SELECT generation FROM jobs WHERE id = %s", (job_id,)).fetchone()
        return int(row[0]) if row else 0

    def job(self, job_id: str) -> dict[str, Any]:
        """The job's state, generation and steps as the scheduler stored them."""
        row = self.conn.execute(
            "SELECT state, generation, current_step, committed_step, restore_step"
            " FROM jobs WHERE id = %s",
            (job_id,),
        ).fetchone()
        if row is None:
            return {}
        names = ("state", "generation", "current_step", "committed_step", "restore_step")
        return dict(zip(names, [str(row[0]), *(int(x) for x in row[1:])], strict=True))

    def between(
        self, first: int, kinds: tuple[str, ...]
    ) -> list[tuple[int, str, str | None, str | None, float, dict[str, str]]]:
        """The events of `kinds` after id `first`, oldest first (without moving the
        cursor that `wait` reads from)."""
        rows = self.conn.execute(
            "SELECT id, kind, node_id, job_id, extract(epoch from time), attributes"
            " FROM events WHERE id > %s AND kind = ANY(%s) ORDER BY id",
            (first, list(kinds)),
        ).fetchall()
        return [(int(r[0]), r[1], r[2], r[3], float(r[4]), r[5] or {}) for r in rows]

    def job_nodes(self, job_id: str) -> set[str]:
        """The nodes of the job's current generation, as the scheduler placed it (a node
        cut off holds no command of it, so the simulator cannot tell)."""
        rows = self.conn.execute(
            "SELECT DISTINCT node_id FROM rank_assignments"
            " WHERE job_id = %s AND until_generation IS NULL",
            (job_id,),
        ).fetchall()
        return {str(r[0]) for r in rows}

    def newest(self) -> int:
        row = self.conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.conn.close()


def job_spec(dp: int, spares: int) -> jobs_pb2.JobSpec:
    return jobs_pb2.JobSpec(
        name="bench-scale",
        command=["python", "-c", "pass"],
        tp=8,
        pp=16,
        dp=dp,
        gpus_per_node=GPUS,
        min_dp=max(dp - spares, 1),
        spares=spares,
        standby_processes=False,
        max_restarts=1000,
    )


async def wait_for(predicate: Any, timeout: float, what: str) -> float:
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - began
