"""bench/scale.py's phases of one fleet size, in order, each written into the size's
record as soon as it is measured: idle, the job started, load, the failures, the drills
(bench/_scale_drill.py), the deciding process's failover, the job's end."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from bench._scale_drill import end_job, mass_loss, mass_loss_replace
from bench._scale_procs import LEASE_SECONDS
from bench._scale_run import Run
from bench._scale_sim import load, say
from bench._scale_stats import size_summary


async def measure_size(root: Path, n: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Every phase of fleet size `n`, into `out` as measured (it is already in the
    benchmark's output: a run stopped now reports what it holds)."""
    deciders = (2 if args.failover else 1) if args.ingest else 0
    out["loadavg_start"] = load()
    run = Run(root, n, max(args.ingest, 1), args, deciders=deciders)
    out["spares"] = run.spares
    async with run:
        try:
            await phases(run, args, out)
        finally:
            if run.fleet is not None:
                out["simulator"] = run.fleet.processes()
                out["command_bytes_max"] = max(run.fleet.command_bytes.values(), default=None)
    out.pop("interrupted", None)
    out["summary"] = size_summary(out)
    say(f"N={n}: summary {out['summary']}")


async def phases(run: Run, args: argparse.Namespace, out: dict[str, Any]) -> None:
    n = run.n
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
    failures: list[dict[str, Any]] = []
    out["failures"] = failures
    for trial in range(args.trials):
        for kind in args.kinds:
            say(f"N={n}: failure {kind} #{trial + 1}")
            row = await run.failure(kind)
            row.pop("_decided_at", None)
            say(f"N={n}:   {row}")
            failures.append(row)
            await asyncio.sleep(args.step_seconds * 2)
    await drills(run, args, out)
    out["job_running_seconds"] = round(time.monotonic() - job_began, 1)
    out["scheduler_cpu_cores_job_running"] = round(
        (sum(s.cpu() for s in run.schedulers) - cpu_began) / out["job_running_seconds"], 3
    )
    out["roles"] = [s.role for s in run.schedulers]
    out["max_generation"] = await run.max_generation()
    if args.end_job:
        out["job_end"] = await end_job(run)
        say(f"N={n}: job end {out['job_end']}")
    out["false_losses"] = await asyncio.to_thread(run.false_losses)
    assert run.fleet is not None
    # Those whose traffic passes through a relay process (the nodes a silent death or
    # a drill can cut): the relay adds its own latency to every keepalive ping.
    relayed = {v.node_id for v in run.fleet.nodes if v.relayed}
    out["false_losses_relayed"] = sorted(set(out["false_losses"]) & relayed)
    out["relayed_nodes"] = len(relayed)
    out["loadavg_end"] = load()


async def drills(run: Run, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The mass loss (before the failover, as asked), the failover, the replace drill."""
    n = run.n
    out["mass_loss"] = None
    if args.mass_loss:
        say(f"N={n}: mass loss of {args.mass_loss:.0%} of the job's nodes")
        out["mass_loss"] = {}
        await mass_loss(run, args.mass_loss, args.mass_loss_seconds, out["mass_loss"])
        say(f"N={n}: mass loss {out['mass_loss']}")
    if args.failover:
        out["failover"] = await decider_failover(run)
        say(f"N={n}: failover {out['failover']}")
    if args.mass_loss_replace:
        say(f"N={n}: mass loss kept past the replace deadline")
        out["mass_loss_replace"] = {}
        await mass_loss_replace(run, args, out["mass_loss_replace"])
        say(f"N={n}: replace drill {out['mass_loss_replace']}")


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
        f"relay lag max {window['relay_loop_lag_max_seconds']}, "
        f"reopened {window['streams_reopened']}, "
        f"sim {window['simulator_cpu_pct']}%, relays {window['relay_cpu_pct']}%, "
        f"lag p99 {window['loop_lag_p99_seconds']}, "
        f"redis/hb {window['redis_calls_per_heartbeat']}, pg xacts/hb "
        f"{window['pg_xacts_per_heartbeat']}, load {window['loadavg']}"
    )
