"""bench/scale.py's run of one fleet size: stores, schedulers and fleet brought up, each
phase measured, and the size's summary."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
from pathlib import Path
from typing import Any

import grpc

from bench._scale_procs import (
    LEASE_SECONDS,
    Events,
    Scheduler,
    Stores,
    Window,
    connect_fleet,
    job_spec,
    wait_for,
)
from bench._scale_sim import (
    DECISIONS,
    FULL_FLEET,
    GPUS,
    RANKS_PER_REPLICA,
    Fleet,
    NodeCertificates,
    SimNode,
    load,
    say,
)
from pitstop.client.client import PitstopClient
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis


class Run:
    """One fleet size (or one scale-out set-up): stores, schedulers, fleet."""

    def __init__(
        self,
        root: Path,
        nodes: int,
        schedulers: int,
        args: argparse.Namespace,
        deciders: int = 0,
    ) -> None:
        """`schedulers` processes hold the streams; with `deciders`, that many more
        decide and hold none (the others then only ingest)."""
        self.root, self.n, self.k, self.args = root, nodes, schedulers, args
        self.deciders = deciders
        # 2% hot spares, and one for each failure to come (each takes one).
        self.spares = max(8, nodes // 50, args.trials * len(args.kinds) + 8)
        self.dp = max(1, nodes * GPUS // RANKS_PER_REPLICA)
        self.stack = contextlib.ExitStack()
        self.schedulers: list[Scheduler] = []
        self.fleet: Fleet | None = None
        self.events: Events | None = None
        self.job_id = ""
        self.victims: set[str] = set()
        """Nodes a failure was injected on: a loss of any other is a false one."""
        self.first_event = 0

    async def __aenter__(self) -> Run:
        root = self.root / f"n{self.n}-k{self.k}-d{self.deciders}"
        root.mkdir(parents=True)
        pg = self.stack.enter_context(OwnPostgres(root / "postgres"))
        rd = self.stack.enter_context(OwnRedis(root / "redis"))
        self.stores = Stores(pg, rd)
        tls_dir = None if self.args.insecure else root / "tls"
        certificates = None if tls_dir is None else NodeCertificates(tls_dir)
        roles = ["decider"] * self.deciders + ["ingest" if self.deciders else "both"] * self.k
        for i, role in enumerate(roles):
            s = Scheduler(
                root, f"scheduler-{i + 1}", pg.url, rd.url, tls_dir, role, self.args.keepalive
            )
            self.schedulers.append(s)
            self.stack.callback(s.stop)
            s.wait_listening()
            if i == 0:  # the first one migrates the schema; the next ones find it made
                await asyncio.sleep(0.5)
        self.credentials = (
            None
            if certificates is None
            else grpc.ssl_channel_credentials(root_certificates=certificates.ca.pem)
        )
        self.fleet = Fleet(
            [s.node_target for s in self.schedulers if s.role != "decider"],
            self.args.interval,
            self.args.step_seconds,
            certificates,
        )
        total = self.n + self.spares
        self.fleet.watch_lag()
        self.fleet.nodes = [
            SimNode(self.fleet, i, spare=i >= self.n, target=i % self.k) for i in range(total)
        ]
        if "silent" in self.args.kinds:
            # Workers whose network can be cut (every worker runs the job).
            count = self.args.trials + 4  # a few may hold no rank of the job
            self.fleet.cabled = set(random.sample(range(1, self.n), min(count, self.n - 1)))
        say(
            f"N={self.n}: {total} nodes ({self.spares} spares) registering on {self.k} scheduler(s)"
        )
        self.registration_seconds = await connect_fleet(self.fleet, 300)
        say(f"N={self.n}: registered in {self.registration_seconds:.1f} s; load {load()}")
        self.events = Events(pg.url)
        self.first_event = self.events.last
        return self

    def false_losses(self) -> list[str]:
        """Nodes declared lost (node.lost) that no failure was injected on."""
        assert self.events is not None
        rows = self.events.conn.execute(
            "SELECT DISTINCT node_id FROM events WHERE id > %s AND kind = 'node.lost'",
            (self.first_event,),
        ).fetchall()
        return sorted(r[0] for r in rows if r[0] not in self.victims)

    async def __aexit__(self, *exc: object) -> None:
        if self.fleet is not None:
            await self.fleet.close()
        if self.events is not None:
            self.events.close()
        self.stack.close()

    def window(self) -> Window:
        assert self.fleet is not None
        return Window(self.stores, self.schedulers, self.fleet)

    def job_nodes(self) -> set[str]:
        """The nodes in the job's newest generation. A node the scheduler declared lost
        (a false loss) and replaced was never told to stop: it still holds an older
        generation, and is not counted (it was, so the expected fan-out grew and a
        "failure" of it decided nothing)."""
        assert self.fleet is not None
        newest = max(
            (n.jobs[self.job_id].generation for n in self.fleet.nodes if self.job_id in n.jobs),
            default=0,
        )
        return {
            n.node_id
            for n in self.fleet.nodes
            if self.job_id in n.jobs and n.jobs[self.job_id].generation == newest
        }

    async def start_job(self) -> dict[str, Any]:
        assert self.fleet is not None
        assert self.events is not None
        spec = job_spec(self.dp, min(self.spares, 8))
        ranks = self.dp * RANKS_PER_REPLICA
        live = next(s for s in self.schedulers if s.alive())

        def submit() -> str:
            with PitstopClient(live.target, timeout=120, credentials=self.credentials) as client:
                return client.submit_job(spec).id

        began = time.time()
        self.job_id = await asyncio.to_thread(submit)
        submitted = time.time()
        self.fleet.take_lag()
        nodes = ranks // GPUS
        await wait_for(
            lambda: len(self.fleet.received.get(1, {})) >= nodes, 300, "StartRanks everywhere"
        )
        got = self.fleet.received[1]
        running = await self.events.wait(
            lambda e: e[1] == "job.running" and e[3] == self.job_id, 300
        )
        return {
            "simulator_loop_lag_max_seconds": round(self.fleet.take_lag(), 3),
            "ranks": ranks,
            "nodes": nodes,
            "dp": self.dp,
            "submit_seconds": round(submitted - began, 3),
            "start_fanout_seconds": round(max(got.values()) - submitted, 3),
            "start_first_to_last_seconds": round(max(got.values()) - min(got.values()), 3),
            "to_running_seconds": round(running[4] - began, 3) if running else None,
            "start_ranks_bytes": self.fleet.command_bytes.get(1),
        }

    def decision_totals(self) -> tuple[float, float]:
        """Recovery decisions made so far by every live scheduler, and their seconds."""
        count = total = 0.0
        for s in self.schedulers:
            if s.alive():
                with contextlib.suppress(OSError):
                    m = s.metrics()
                    count, total = count + m["decisions"], total + m["decision_seconds"]
        return count, total

    async def failure(self, kind: str, on_scheduler: int | None = None) -> dict[str, Any]:
        """Inject one failure on a node of the job; detect, decide, fan-out, resume."""
        assert self.fleet is not None
        assert self.events is not None
        in_job = self.job_nodes()
        candidates = [
            n
            for n in self.fleet.nodes
            if n.node_id in in_job
            and not n.dead
            and not n.hung
            and n.unhealthy_gpu is None
            and n.registered.is_set()
            and (on_scheduler is None or n.target == on_scheduler)
            and (kind == "silent") == (n.cable is not None)
        ]
        if not candidates:
            return {"kind": kind, "error": "no node left to fail"}
        node = random.choice(candidates[1:] or candidates)  # not the first: rank 0's host
        self.victims.add(node.node_id)
        await asyncio.to_thread(self.events.skip)  # what happened before is not this one's
        before = await asyncio.to_thread(self.decision_totals)
        t0 = time.time()
        if kind == "stream":
            node.dead = True
            node.cancel()
        elif kind == "hung":
            node.hung = True
        elif kind == "silent":
            node.dead = True  # never reconnects: the host is gone
            assert node.cable is not None
            node.cable.cut()
        else:
            node.inject_xid()
        node_kinds = ("node.unhealthy",) if kind == "xid" else ("node.lost",)
        detected = await self.events.wait(lambda e: e[1] in node_kinds and e[2] == node.node_id, 60)
        decided = await self.events.wait(lambda e: e[1] in DECISIONS and e[3] == self.job_id, 60)
        row: dict[str, Any] = {"kind": kind, "node": node.node_id}
        if detected is None or decided is None:
            row["error"] = "no detection" if detected is None else "no decision"
            return row
        generation = await asyncio.to_thread(self.events.generation, self.job_id)
        expected = (self.job_nodes() - {node.node_id}) | set(
            self.fleet.received.get(generation, {})
        )
        told = self.dp * 16  # every node of the new generation
        with contextlib.suppress(RuntimeError):
            await wait_for(
                lambda: len(self.fleet.received.get(generation, {})) >= told, 60, "fan-out"
            )
        got = self.fleet.received.get(generation, {})
        if len(got) < told:
            # Counted as a failed fan-out, never as the time to the last node that did get it.
            row["error"] = f"fan-out incomplete after 60 s: {len(got)} of {told} nodes"
            got = {}
        recovered = await self.events.wait(
            lambda e: e[1] in ("job.recovered", "job.running") and e[3] == self.job_id, 60
        )
        after = await asyncio.to_thread(self.decision_totals)
        made = after[0] - before[0]
        if made > 0:
            # The recovery decisions' own time, start to commit (the scheduler's histogram):
            # the event's time is its transaction's start; the fan-out counts from there.
            row["decision_transaction_seconds"] = round((after[1] - before[1]) / made, 4)
        row.update(
            detect_seconds=round(detected[4] - t0, 4),
            decide_seconds=round(decided[4] - detected[4], 4),
            decision=decided[1],
            generation=generation,
            nodes_told=len(got),
            nodes_expected=len(expected),
            fanout_seconds=round(max(got.values()) - decided[4], 4) if got else None,
            fanout_first_to_last_seconds=(
                round(max(got.values()) - min(got.values()), 4) if got else None
            ),
            resume_seconds=round(recovered[4] - t0, 3) if recovered else None,
            loadavg=load(),
            _decided_at=decided[4],
        )
        tx = row.get("decision_transaction_seconds")
        if tx is not None:
            # decide = the failure seen -> its decision committed; fan-out from the commit.
            row["decide_to_commit_seconds"] = round(row["decide_seconds"] + tx, 4)
            if row.get("fanout_seconds") is not None:
                row["fanout_after_commit_seconds"] = round(max(row["fanout_seconds"] - tx, 0), 4)
        if kind == "hung":
            row["deadline_seconds"] = 5.0 * 2.5  # the scheduler's refresh x intervals
        return row


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def linear(points: list[tuple[int, float]]) -> dict[str, Any] | None:
    """y = c + d * N by least squares: d is the cost of one more node."""
    if len(points) < 2:
        return None
    xs, ys = [float(n) for n, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    d = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    c = my - d * mx
    return {
        "intercept": float(f"{c:.4g}"),
        "per_node": float(f"{d:.4g}"),
        "at_12500": float(f"{c + d * FULL_FLEET:.4g}"),
    }


def fit(points: list[tuple[int, float]]) -> dict[str, Any] | None:
    """y = a * N^b by least squares on logs; the value at 12,500 nodes."""
    usable = [(n, y) for n, y in points if y is not None and y > 0]
    if len(usable) < 2:
        return None
    xs = [math.log(n) for n, _ in usable]
    ys = [math.log(y) for _, y in usable]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    a = math.exp(my - b * mx)
    return {
        "a": float(f"{a:.4g}"),
        "b": round(b, 3),
        "at_12500": float(f"{a * FULL_FLEET**b:.4g}"),
        "points": [[n, float(f"{y:.4g}")] for n, y in usable],
    }


async def measure_size(root: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    deciders = (2 if args.failover else 1) if args.ingest else 0
    async with Run(root, n, max(args.ingest, 1), args, deciders=deciders) as run:
        out: dict[str, Any] = {"nodes": n, "spares": run.spares, "loadavg_start": load()}
        out["registration_seconds"] = round(run.registration_seconds, 1)
        say(f"N={n}: idle window ({args.window:.0f} s)")
        out["idle"] = await run.window().measure(args.window)
        say(f"N={n}: idle {brief(out['idle'])}")
        job_began, cpu_began = time.monotonic(), sum(s.cpu() for s in run.schedulers)
        out["job"] = await run.start_job()
        say(f"N={n}: job {out['job']}")
        await asyncio.sleep(args.step_seconds * 3)  # steps flowing everywhere
        say(f"N={n}: load window ({args.window:.0f} s)")
        out["load"] = await run.window().measure(args.window)
        say(f"N={n}: load {brief(out['load'])}")
        idle, busy = out["idle"], out["load"]
        batches = max(busy["_batches"], 1)
        # What a step summary adds: the load window's Redis calls and PostgreSQL
        # transactions beyond the heartbeats' own (at the idle window's rate per beat).
        out["redis_calls_per_step_summary"] = round(
            (busy["_redis_total"] - idle["redis_calls_per_heartbeat"] * busy["_beats"]) / batches, 3
        )
        out["pg_xacts_per_step_summary"] = round(
            (busy["pg"]["xacts"] - idle["pg_xacts_per_heartbeat"] * busy["_beats"]) / batches, 4
        )
        failures = []
        for trial in range(args.trials):
            for kind in args.kinds:
                say(f"N={n}: failure {kind} #{trial + 1}")
                row = await run.failure(kind)
                row.pop("_decided_at", None)
                say(f"N={n}:   {row}")
                failures.append(row)
                await asyncio.sleep(args.step_seconds * 2)
        out["failures"] = failures
        if args.failover:
            out["failover"] = await decider_failover(run)
            say(f"N={n}: failover {out['failover']}")
        out["job_running_seconds"] = round(time.monotonic() - job_began, 1)
        out["scheduler_cpu_cores_job_running"] = round(
            (sum(s.cpu() for s in run.schedulers) - cpu_began) / out["job_running_seconds"], 3
        )
        out["roles"] = [s.role for s in run.schedulers]
        out["false_losses"] = await asyncio.to_thread(run.false_losses)
        assert run.fleet is not None
        # Those whose traffic passes through a relay of this process (the nodes a silent
        # death can cut): the relay adds its own latency to every keepalive ping.
        relayed = {n.node_id for n in run.fleet.nodes if n.cable is not None}
        out["false_losses_relayed"] = sorted(set(out["false_losses"]) & relayed)
        out["relayed_nodes"] = len(relayed)
        out["command_bytes_max"] = max(run.fleet.command_bytes.values(), default=None)
        out["loadavg_end"] = load()
        out["summary"] = size_summary(out)
        say(f"N={n}: summary {out['summary']}")
        return out


def size_summary(out: dict[str, Any]) -> dict[str, Any]:
    """The headline of one fleet size (one scheduler process: it leads and ingests)."""
    rows = [f for f in out["failures"] if "error" not in f]

    def p99(kinds: tuple[str, ...], *keys: str) -> tuple[float | None, int]:
        values = []
        for f in rows:
            if f["kind"] in kinds:
                value = next((f[k] for k in keys if f.get(k) is not None), None)
                if value is not None:
                    values.append(value)
        return quantile(values, 0.99), len(values)

    every = ("stream", "xid", "silent", "hung")
    silent, silent_n = p99(("silent",), "detect_seconds")
    pushed, pushed_n = p99(("stream", "xid"), "detect_seconds")
    decide, decide_n = p99(every, "decide_to_commit_seconds", "decide_seconds")
    fanout, fanout_n = p99(every, "fanout_after_commit_seconds", "fanout_seconds")
    per_process = [pct / 100 for pct in out["load"]["scheduler_cpu_pct"]]
    roles = out["roles"]
    leader = sum(c for c, r in zip(per_process, roles, strict=True) if r != "ingest")
    ingest = sum(c for c, r in zip(per_process, roles, strict=True) if r != "decider")
    total_nodes = out["nodes"] + out["spares"]
    return {
        "nodes": total_nodes,
        "duration_s": out["job_running_seconds"],
        "false_losses": len(out["false_losses"]),
        "detect_silent_p99_s": silent,
        "detect_pushed_p99_s": pushed,
        "decide_p99_s": decide,
        "fanout_p99_s": fanout,
        # One process: it leads and ingests, and both figures are its CPU.
        "leader_cpu_cores": round(leader, 3),
        "ingest_cpu_cores_per_1000_nodes": round(ingest / (total_nodes / 1000), 3),
        "processes": {"deciding": roles.count("decider"), "ingest": roles.count("ingest")},
        "command_bytes_max": out["command_bytes_max"],
        "samples": {"silent": silent_n, "pushed": pushed_n, "decide": decide_n, "fanout": fanout_n},
        "failures_failed": len(out["failures"]) - len(rows),
        "cpu_cores_job_running": out["scheduler_cpu_cores_job_running"],
    }


async def decider_failover(run: Run) -> dict[str, Any]:
    """kill -9 of the leading deciding process under load, then at once a fatal Xid: the
    other deciding process must take the lease and decide it. Measured: the kill to the
    Xid's decision committed, against the lease period; a node declared lost meanwhile
    is a false loss (counted with the run's)."""
    assert run.events is not None
    leading = [
        s
        for s in run.schedulers
        if s.role == "decider" and (await asyncio.to_thread(s.metrics))["leader"] == 1.0
    ]
    if not leading:
        return {"error": "no leading deciding process found"}
    t0 = time.time()
    leading[0].kill()
    row = await run.failure("xid")
    decided_at = row.pop("_decided_at", None)
    return {
        "killed": leading[0].name,
        "lease_seconds": LEASE_SECONDS,
        "failover_seconds": None if decided_at is None else round(decided_at - t0, 3),
        "failure": row,
    }


def brief(window: dict[str, Any]) -> str:
    return (
        f"{window['heartbeats_ingested_per_s']} hb/s, sched CPU {window['scheduler_cpu_pct']}%, "
        f"hb lag p99 {window['heartbeat_lag_p99_seconds']}, "
        f"sim lag max {window['simulator_loop_lag_max_seconds']}, "
        f"reopened {window['streams_reopened']}, "
        f"sim {window['simulator_cpu_pct']}%, lag p99 {window['loop_lag_p99_seconds']}, "
        f"redis/hb {window['redis_calls_per_heartbeat']}, pg xacts/hb "
        f"{window['pg_xacts_per_heartbeat']}, load {window['loadavg']}"
    )
