"""bench/scale.py's run of one fleet size: stores, schedulers and the simulated fleet
brought up, each phase measured into the size's record as it is measured (so a run
stopped half-way still reports what it had), and the failures injected."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from pathlib import Path
from typing import Any

import grpc

from bench._scale_fleet import Fleet, NodeView, default_procs
from bench._scale_procs import (
    Events,
    Scheduler,
    Stores,
    Window,
    decision_totals,
    job_spec,
    stop_schedulers,
    wait_for,
)
from bench._scale_sim import DECISIONS, GPUS, RANKS_PER_REPLICA, NodeCertificates, load, say
from pitstop.client.client import PitstopClient
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis

DETECTED_BY = {"xid": "node.unhealthy", "exit": "rank.exited"}
"""The event that says a failure was seen: node.lost for the others."""
TIMEOUT = 60.0
"""A failure not detected, not decided or not fanned out to every node by then failed."""


def relayed(args: argparse.Namespace, n: int, total: int) -> set[int]:
    """The nodes whose network can be cut: every one for a mass-loss drill, else a few
    workers for the silent deaths (every worker runs the job)."""
    if args.mass_loss:
        return set(range(total))
    if "silent" not in args.kinds:
        return set()
    count = args.trials + 4  # a few may hold no rank of the job
    return set(random.sample(range(1, n), min(count, n - 1)))


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
        # 2% hot spares, and one for each failure to come (each takes one); with the
        # replace drill, as many more as it cuts.
        self.spares = max(8, nodes // 50, args.trials * len(args.kinds) + 8)
        if args.mass_loss_replace:
            self.spares += args.replace_nodes + 8
        self.dp = max(1, nodes * GPUS // RANKS_PER_REPLICA)
        self.stack = contextlib.ExitStack()
        self.schedulers: list[Scheduler] = []
        self.fleet: Fleet | None = None
        self.events: Events | None = None
        self.job_id = ""
        self.victims: set[str] = set()
        """Nodes a failure was injected on (or cut by a drill): a loss of another is false."""
        self.first_event = 0

    async def __aenter__(self) -> Run:
        try:
            await self._up()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _up(self) -> None:
        root = self.root / f"n{self.n}-k{self.k}-d{self.deciders}"
        root.mkdir(parents=True)
        pg = OwnPostgres(root / "postgres")
        self.stack.callback(pg.stop, 5.0)
        rd = OwnRedis(root / "redis")
        self.stack.callback(rd.stop, 5.0)
        self.stores = Stores(pg, rd)
        tls_dir = None if self.args.insecure else root / "tls"
        certificates = None if tls_dir is None else NodeCertificates(tls_dir)  # makes the CA
        self.stack.callback(stop_schedulers, self.schedulers, 4.0)
        roles = ["decider"] * self.deciders + ["ingest" if self.deciders else "both"] * self.k
        for i, role in enumerate(roles):
            s = Scheduler(
                root,
                f"scheduler-{i + 1}",
                pg.url,
                rd.url,
                tls_dir,
                role,
                self.args.keepalive,
                self.args.scheduler_settings,
            )
            self.schedulers.append(s)
            await s.wait_listening()
            if i == 0:  # the first one migrates the schema; the next ones find it made
                await asyncio.sleep(0.5)
        self.credentials = (
            None
            if certificates is None
            else grpc.ssl_channel_credentials(root_certificates=certificates.ca.pem)
        )
        total = self.n + self.spares
        procs = self.args.sim_procs or default_procs(total)
        self.fleet = Fleet(
            root,
            [s.node_target for s in self.schedulers if s.role != "decider"],
            self.args.interval,
            self.args.step_seconds,
            tls_dir,
            procs,
        )
        self.fleet.add_nodes(total, self.n, self.k, relayed(self.args, self.n, total))
        await self.fleet.start()
        say(
            f"N={self.n}: {total} nodes ({self.spares} spares) in {procs} simulator "
            f"process(es), {len(self.fleet.relays)} relay(s), registering on {self.k} "
            "scheduler(s)"
        )
        self.registration_seconds = await self.fleet.connect(300)
        say(f"N={self.n}: registered in {self.registration_seconds:.1f} s; load {load()}")
        self.events = Events(pg.url)
        self.first_event = self.events.last

    def false_losses(self) -> list[str]:
        """Nodes declared lost (node.lost) that no failure was injected on."""
        assert self.events is not None
        rows = self.events.conn.execute(
            "SELECT DISTINCT node_id FROM events WHERE id > %s AND kind = 'node.lost'",
            (self.first_event,),
        ).fetchall()
        return sorted(r[0] for r in rows if r[0] not in self.victims)

    async def __aexit__(self, *exc: object) -> None:
        began = time.monotonic()
        for s in self.schedulers:  # beside the fleet's stop, not after it: a signal's
            s.terminate()  # 10 s hold every stop
        try:
            if self.fleet is not None:
                await self.fleet.close()
        finally:
            if self.events is not None:
                self.events.close()
            self.stack.close()
            took = time.monotonic() - began
            say(f"N={self.n}: schedulers, stores and simulators stopped in {took:.1f} s")

    def window(self) -> Window:
        assert self.fleet is not None
        return Window(self.stores, self.schedulers, self.fleet)

    def job_nodes(self) -> set[str]:
        """The nodes in the job's newest generation. A node the scheduler declared lost
        (a false loss) and replaced was never told to stop: it still holds an older
        generation, and is not counted (it was, so the expected fan-out grew and a
        "failure" of it decided nothing)."""
        assert self.fleet is not None
        newest = max((v.generation for v in self.fleet.nodes), default=0)
        return {v.node_id for v in self.fleet.nodes if newest and v.generation == newest}

    async def max_generation(self) -> int:
        """The job's highest generation: the scheduler's, or a command's if higher."""
        assert self.events is not None
        assert self.fleet is not None
        stored = await asyncio.to_thread(self.events.generation, self.job_id)
        return max(stored, max(self.fleet.received, default=0))

    async def start_job(self) -> dict[str, Any]:
        assert self.fleet is not None
        assert self.events is not None
        spec = job_spec(self.dp, min(self.spares, 8))
        ranks = self.dp * RANKS_PER_REPLICA
        live = next(s for s in self.schedulers if s.alive())

        def submit() -> str:
            with PitstopClient(live.target, timeout=120, credentials=self.credentials) as client:
                return client.submit_job(spec).id

        fleet = self.fleet
        await fleet.refresh()
        fleet.take_lag()
        began = time.time()
        self.job_id = await asyncio.to_thread(submit)
        submitted = time.time()
        nodes = ranks // GPUS
        await wait_for(
            lambda: len(fleet.received.get(1, {})) >= nodes, 300, "StartRanks everywhere"
        )
        got = fleet.received[1]
        running = await self.events.wait(
            lambda e: e[1] == "job.running" and e[3] == self.job_id, 300
        )
        await fleet.refresh()
        sim_lag, relay_lag = fleet.take_lag()
        return {
            "simulator_loop_lag_max_seconds": round(sim_lag, 3),
            "relay_loop_lag_max_seconds": round(relay_lag, 3),
            "ranks": ranks,
            "nodes": nodes,
            "dp": self.dp,
            "submit_seconds": round(submitted - began, 3),
            "start_fanout_seconds": round(max(got.values()) - submitted, 3),
            "start_first_to_last_seconds": round(max(got.values()) - min(got.values()), 3),
            "to_running_seconds": round(running[4] - began, 3) if running else None,
            "start_ranks_bytes": fleet.command_bytes.get(1),
        }

    def candidates(self, kind: str, on_scheduler: int | None) -> list[NodeView]:
        """Nodes of the job a failure of `kind` may hit: a silent death needs a relay;
        the others leave the relayed nodes to it where they can."""
        assert self.fleet is not None
        in_job = self.job_nodes()
        pool = [
            v
            for v in self.fleet.nodes
            if v.node_id in in_job
            and not (v.dead or v.hung or v.unhealthy)
            and v.registered
            and (on_scheduler is None or v.target == on_scheduler)
        ]
        if kind == "silent":
            return [v for v in pool if v.relayed]
        return [v for v in pool if not v.relayed] or pool

    async def inject(self, kind: str, node: NodeView) -> float:
        """Fail `node` the `kind` way; when it happened (the worker's or relay's clock)."""
        assert self.fleet is not None
        if kind == "silent":
            node.dead = True  # never reconnects: the host is gone
            await self.fleet.act("gone", node)
            return await self.fleet.network("cut", [node])
        if kind == "stream":
            node.dead = True
            return await self.fleet.act("break", node)
        if kind == "hung":
            node.hung = True
            return await self.fleet.act("hang", node)
        if kind == "xid":
            node.unhealthy = True
        return await self.fleet.act(kind, node)

    async def failure(self, kind: str, on_scheduler: int | None = None) -> dict[str, Any]:
        """Inject one failure on a node of the job; detect, decide, fan-out, resume. A
        time that never came is a failed sample (`failed` names which); a sample while a
        simulator or relay lagged past LAG_LIMIT is flagged `sim_lagged`."""
        assert self.fleet is not None
        assert self.events is not None
        candidates = self.candidates(kind, on_scheduler)
        if not candidates:
            return {"kind": kind, "error": "no node left to fail"}
        node = random.choice(candidates[1:] or candidates)  # not the first: rank 0's host
        self.victims.add(node.node_id)
        await asyncio.to_thread(self.events.skip)  # what happened before is not this one's
        before = await asyncio.to_thread(decision_totals, self.schedulers)
        t0 = await self.inject(kind, node)
        seen = DETECTED_BY.get(kind, "node.lost")
        detected = await self.events.wait(lambda e: e[1] == seen and e[2] == node.node_id, TIMEOUT)
        row: dict[str, Any] = {"kind": kind, "node": node.node_id}
        if detected is None:
            row.update(error="no detection", failed=["detect", "decide", "fanout"])
            return await flag_lag(self.fleet, row, t0, time.time())
        row["detect_seconds"] = round(detected[4] - t0, 4)
        decided = await self.events.wait(
            lambda e: e[1] in DECISIONS and e[3] == self.job_id, TIMEOUT
        )
        if decided is None:
            row.update(error="no decision", failed=["decide", "fanout"])
            return await flag_lag(self.fleet, row, t0, time.time())
        row["decide_seconds"] = round(decided[4] - detected[4], 4)
        await self.fan_out(row, decided, before)
        got = self.fleet.received.get(row["generation"], {})
        await flag_lag(self.fleet, row, t0, max(got.values()) if got else time.time())
        recovered = await self.events.wait(
            lambda e: e[1] in ("job.recovered", "job.running") and e[3] == self.job_id, TIMEOUT
        )
        row.update(resume_seconds=round(recovered[4] - t0, 3) if recovered else None)
        row.update(loadavg=load(), _decided_at=decided[4])
        if kind == "hung":
            row["deadline_seconds"] = 5.0 * 2.5  # the scheduler's refresh x intervals
        return row

    async def fan_out(
        self, row: dict[str, Any], decided: tuple[Any, ...], before: tuple[float, float]
    ) -> None:
        """The decision's commands reaching every node of its generation (as the scheduler
        placed it: a job that shrank has fewer), into `row`."""
        assert self.fleet is not None
        assert self.events is not None
        fleet, events = self.fleet, self.events
        generation = await asyncio.to_thread(events.generation, self.job_id)
        members = await asyncio.to_thread(events.job_nodes, self.job_id)
        with contextlib.suppress(RuntimeError):
            await wait_for(
                lambda: members <= fleet.received.get(generation, {}).keys(), TIMEOUT, ""
            )
        received = fleet.received.get(generation, {})
        got = {n: t for n, t in received.items() if n in members}
        if len(got) < len(members) or not members:
            # A failed fan-out, never the time to the last node that did get it.
            row["error"] = (
                f"fan-out incomplete after {TIMEOUT:.0f} s: {len(got)} of {len(members)} nodes"
            )
            row["failed"] = ["fanout"]
            got = {}
        after = await asyncio.to_thread(decision_totals, self.schedulers)
        made = after[0] - before[0]
        if made > 0:
            # The recovery decisions' own time, start to commit (the scheduler's histogram):
            # the event's time is its transaction's start; the fan-out counts from there.
            row["decision_transaction_seconds"] = round((after[1] - before[1]) / made, 4)
        row.update(
            decision=decided[1],
            generation=generation,
            nodes_told=len(received),
            nodes_expected=len(members),
            fanout_seconds=round(max(got.values()) - decided[4], 4) if got else None,
            fanout_first_to_last_seconds=(
                round(max(got.values()) - min(got.values()), 4) if got else None
            ),
        )
        tx = row.get("decision_transaction_seconds")
        if tx is not None:
            # decide = the failure seen -> its decision committed; fan-out from the commit.
            row["decide_to_commit_seconds"] = round(row["decide_seconds"] + tx, 4)
            if row["fanout_seconds"] is not None:
                row["fanout_after_commit_seconds"] = round(max(row["fanout_seconds"] - tx, 0), 4)


async def flag_lag(fleet: Fleet, row: dict[str, Any], since: float, until: float) -> dict[str, Any]:
    """Mark `row` sim_lagged when a worker or relay lagged past LAG_LIMIT within [since,
    until]: its times are the benchmark's as much as the scheduler's."""
    await fleet.refresh()
    lag = fleet.lagged(since, until)
    row.update(sim_lagged=lag > 0, sim_lag_max_seconds=round(lag, 3))
    return row
