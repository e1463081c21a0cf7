"""Scale benchmark: real scheduler processes under a simulated fleet speaking the real
agent protocol, measured at several fleet sizes and projected to 12,500 nodes.

Per fleet size N (--nodes, default 500 1000 2500) the benchmark starts a PostgreSQL and
a Redis of its own (the machine's binaries, fresh per size, so their statistics are the
scheduler's alone) and the `pitstop-scheduler` processes on them: one that leads and
holds every stream (--ingest 0), or one that only decides (agent_streams: false) beside
K that only hold streams (--ingest K, leader_loops: false). Mutual TLS is on, as users
run it: the run's CA signs each simulated node's certificate (what enrollment would
hand it); --insecure turns TLS off. The simulated fleet lives in this process, asyncio,
no torch: N 8-GPU nodes in zones, blocks and racks (8 nodes a rack, 49 racks a block,
8 blocks a zone) plus 2% hot spares (at least 8, and one more for each failure to
come), each with its own channel and `AgentService.Connect` stream, as an agent has:
Register (inventory, labels, role); a look every heartbeat interval the scheduler gives
(1 s), sending a heartbeat (node health with 8 GPUs, the running ranks) when what it
says changed and at least every refresh interval (5 s), and its ranks' new steps
summarized per node (and a window summary per rank every 20 steps); a CommandAck for
every command; gRPC's keepalive pings answered in its core.

Phases, each measured over --window seconds of wall time:

* idle: heartbeats only. Heartbeats ingested: the count of the schedulers'
  pitstop_scheduler_heartbeat_lag_seconds histograms (one observation a heartbeat
  handled). Per heartbeat: Redis commands (INFO commandstats deltas) and
  PostgreSQL transactions and rows (pg_stat_database deltas; its counters reach the
  view within about a second of each transaction, so edges blur by that much).
* load: the job of the fleet's size runs (TP 8 x PP 16 x DP = N*8/128: at 12,500 nodes
  the 99,968-rank job of docs/scale.md) at --step-seconds a step: heartbeats with 8 running
  ranks and a step summary a node per step.
  In both: heartbeats/s ingested, streams reopened (a broken stream), each process's
  CPU (% of one core), event-loop lag (the pitstop_scheduler_event_loop_lag_seconds
  histogram over the window: p99 as the bucket bound, and the 1-minute p99 gauge), the
  CPU of the simulator, PostgreSQL and Redis.
* failures under load, --trials of each kind (--kinds) on nodes of the job: a broken
  stream (the call reset, as a dead host's TCP reset), a silent death (the node's
  traffic goes through a relay of this process, and the relay stops passing bytes
  both ways without closing anything: a cut network or a host without power, seen
  only by the stream's keepalive pings), a fatal Xid (79 on one GPU: the Xid, the
  rank's exit, a heartbeat saying FATAL, as the agent sends them), and on request an
  agent hung in Python (heartbeats stop, pings answered: the 12.5 s deadline).
  detect = injection -> node.lost / node.unhealthy event; decide = that event ->
  its decision committed (job.recovering plus the decision's transaction); fan-out =
  the commit -> the last node of the new generation has its Reconfigure or StartRanks
  (the simulator's clock; same host; a fan-out that has not reached every node within
  60 s is a failed one, never a time); resume = -> job.recovered.
  A false loss is a node.lost of a node no failure was injected on.
* with --failover (and --ingest K): two deciding processes run; after the failures the
  leading one is killed (-9) and a fatal Xid injected at once. failover_seconds = the
  kill -> the Xid's decision committed by the other (judged against the lease period,
  leader_lease_seconds in the output); a node declared lost meanwhile is a false loss.

Then, at --scaleout-nodes, the idle and load phases with 1, 2 and 3 processes that each
both lead and hold streams, and leader failover under load (kill -9 of the leading
process, a fatal Xid at once on a node of a surviving process).

The last line holds, per size and for the largest, the headline: nodes, duration_s
(the job running), false_losses, detect_silent_p99_s, detect_pushed_p99_s (broken
stream and Xid), decide_p99_s, fanout_p99_s, leader_cpu_cores (the deciding process in
the load window), ingest_cpu_cores_per_1000_nodes, command_bytes_max and the sample
counts; and `at_12500`: each of those costs fitted linearly in N (a fixed part plus a
cost per node) and taken to 12,500 nodes, the ingest CPU spread over processes of at
most 0.75 cores beside one deciding process. `details` and `fits` keep every phase.

    .venv/bin/python bench/scale.py [--nodes 500 1000 2500] [--ingest 2] [--window 15]
        [--trials 20] [--kinds stream xid silent] [--insecure] [--step-seconds 2] [--failover]
        [--scaleout-nodes 300] [--skip-scaleout | --only-scaleout] [--refit OLD.json]

The machine is shared: the JSON records os.getloadavg() at each phase. Progress goes to
stderr; the last line of stdout is one JSON object. On any end (Ctrl-C, SIGTERM, SIGHUP
included) the schedulers and stores stop and the streams close.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc

from pitstop.client.signals import Terminated, exit_code, orderly_exit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._scale_procs import LEASE_SECONDS, wait_for
from bench._scale_run import Run, brief, fit, linear, measure_size, quantile
from bench._scale_sim import TARGETS, load, say

PROCESS_CORES = 0.75
"""The projection fills each scheduler process to this much of a core, no more."""


def at_12500(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Linear in the fleet (a fixed part plus a cost per node), fitted over the sizes
    measured: ingest CPU, the deciding process's CPU, decide and fan-out, taken to 12,500
    nodes; the streams spread over as many ingest processes as keep each under
    PROCESS_CORES, beside one deciding process."""
    ingest = linear(
        [(s["nodes"], s["ingest_cpu_cores_per_1000_nodes"] * s["nodes"] / 1000) for s in summaries]
    )
    leader = linear([(s["nodes"], s["leader_cpu_cores"]) for s in summaries])
    decide = linear([(s["nodes"], s["decide_p99_s"]) for s in summaries if s["decide_p99_s"]])
    fanout = linear([(s["nodes"], s["fanout_p99_s"]) for s in summaries if s["fanout_p99_s"]])
    if ingest is None or leader is None:
        return None
    total = max(ingest["at_12500"], 0.0)
    processes = max(1, math.ceil(total / PROCESS_CORES))
    split = all(s["processes"]["deciding"] for s in summaries)
    return {
        "processes": processes + 1,
        "cpu_cores_per_process": {
            "ingest": round(total / processes, 3),
            "deciding": round(max(leader["at_12500"], 0.0), 3),
        },
        "ingest_cpu_cores_total": round(total, 3),
        "decide_s": None if decide is None else decide["at_12500"],
        "fanout_s": None if fanout is None else fanout["at_12500"],
        "how": (
            "least squares y = c + d*N over the sizes measured, at N=12,500: ingest CPU "
            f"over processes of at most {PROCESS_CORES} cores, plus one deciding process"
            + ("" if split else " (measured with one process doing both: its CPU counts as both)")
        ),
    }


async def measure_scaleout(root: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": n, "by_processes": {}}
    for k in (1, 2, 3):
        async with Run(root, n, k, args) as run:
            row: dict[str, Any] = {"idle": await run.window().measure(args.window)}
            row["job"] = await run.start_job()
            await asyncio.sleep(args.step_seconds * 3)
            row["load"] = await run.window().measure(args.window)
            say(f"scale-out N={n} k={k}: idle {brief(row['idle'])}; load {brief(row['load'])}")
            if k == 2:
                row["failover"] = await failover(run)
                say(f"scale-out: failover {row['failover']}")
            out["by_processes"][str(k)] = row
    return out


async def failover(run: Run) -> dict[str, Any]:
    """kill -9 of the leader under load, a fatal Xid at once on a survivor's node."""
    assert run.fleet is not None
    assert run.events is not None
    leader = None
    for i, s in enumerate(run.schedulers):
        if (await asyncio.to_thread(s.metrics))["leader"] == 1.0:
            leader = i
    if leader is None:
        return {"error": "no leader found"}
    survivor = next(i for i in range(len(run.schedulers)) if i != leader)
    orphans = [n for n in run.fleet.nodes if n.target == leader]
    before = {n.node_id: n.registrations for n in orphans}
    t0, m0 = time.time(), time.monotonic()
    run.schedulers[leader].kill()
    run.fleet.alive_targets.discard(leader)
    row = await run.failure("xid", on_scheduler=survivor)
    await wait_for(
        lambda: all(n.registrations > before[n.node_id] for n in orphans if not n.dead),
        120,
        "orphaned nodes to register again",
    )
    back = time.monotonic() - m0
    decided_at = row.pop("_decided_at", None)
    return {
        "killed": run.schedulers[leader].name,
        "orphaned_nodes": len(orphans),
        "failover_seconds": None if decided_at is None else round(decided_at - t0, 3),
        "orphans_registered_again_within_seconds": round(back, 1),
        "failure": row,
    }


def summarize(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    def series(get: Any) -> list[tuple[int, float]]:
        out = []
        for s in sizes:
            with contextlib.suppress(KeyError, TypeError, IndexError):
                value = get(s)
                if value is not None:
                    out.append((s["nodes"], float(value)))
        return out

    def failures(s: dict[str, Any], kind: str, key: str) -> list[float]:
        return [f[key] for f in s["failures"] if f.get("kind") == kind and f.get(key) is not None]

    fits: dict[str, Any] = {
        "heartbeats_ingested_per_s": fit(series(lambda s: s["load"]["heartbeats_ingested_per_s"])),
        "scheduler_cpu_pct_load": fit(series(lambda s: s["load"]["scheduler_cpu_pct_total"])),
        "scheduler_cpu_pct_idle": fit(series(lambda s: s["idle"]["scheduler_cpu_pct_total"])),
        "cpu_ms_per_1k_heartbeats_idle": fit(
            series(lambda s: s["idle"]["scheduler_cpu_ms_per_1k_heartbeats"])
        ),
        "loop_lag_p99_seconds_load": fit(series(lambda s: s["load"]["loop_lag_p99_seconds"][0])),
        "start_fanout_seconds": fit(series(lambda s: s["job"]["start_fanout_seconds"])),
        "start_ranks_bytes": fit(series(lambda s: s["job"]["start_ranks_bytes"])),
        "redis_calls_per_heartbeat": fit(series(lambda s: s["idle"]["redis_calls_per_heartbeat"])),
        "pg_xacts_per_heartbeat_load": fit(series(lambda s: s["load"]["pg_xacts_per_heartbeat"])),
    }
    for name in ("scheduler_cpu_pct_total", "redis_cpu_pct", "postgres_cpu_pct"):
        for phase in ("idle", "load"):
            fits[f"linear_{name}_{phase}"] = linear(series(lambda s, p=phase, x=name: s[p][x]))
    fits["linear_pg_xacts_per_s_load"] = linear(
        series(lambda s: s["load"]["pg"]["xacts"] / s["load"]["seconds"])
    )
    fits["linear_redis_calls_per_s_load"] = linear(
        series(lambda s: s["load"]["_redis_total"] / s["load"]["seconds"])
    )
    for kind in ("stream", "xid", "silent", "hung"):
        for key in ("detect_seconds", "decide_seconds", "fanout_seconds"):
            fits[f"{kind}_{key}_p99"] = fit(
                series(lambda s, k=kind, x=key: quantile(failures(s, k, x), 0.99))
            )

    def p99(s: dict[str, Any], key: str) -> float | None:
        return quantile([f[key] for f in s["failures"] if f.get(key) is not None], 0.99)

    for key in (
        "decide_seconds",
        "decide_to_commit_seconds",
        "decision_transaction_seconds",
        "fanout_seconds",
        "fanout_after_commit_seconds",
        "fanout_first_to_last_seconds",
    ):
        fits[f"{key}_p99"] = fit(series(lambda s, k=key: p99(s, k)))
        fits[f"linear_{key}_p99"] = linear(series(lambda s, k=key: p99(s, k)))
    fits["detect_seconds_p99_stream_and_xid"] = fit(
        series(
            lambda s: quantile(
                [
                    f["detect_seconds"]
                    for f in s["failures"]
                    if f.get("kind") in ("stream", "xid") and "detect_seconds" in f
                ],
                0.99,
            )
        )
    )
    return fits


def verdicts(fits: dict[str, Any]) -> dict[str, Any]:
    def at(name: str) -> float | None:
        f = fits.get(name)
        return None if f is None else f["at_12500"]

    # CPU: the linear fit (a fixed part plus a cost per node), not the power law, whose
    # exponent the fixed part drags below 1 at these sizes.
    linear_cpu = fits.get("linear_scheduler_cpu_pct_total_load")
    cores = None if linear_cpu is None else linear_cpu["at_12500"]
    checks = {
        "detect_p99_seconds": at("detect_seconds_p99_stream_and_xid"),
        "decide_p99_seconds": at("decide_to_commit_seconds_p99"),
        "fanout_seconds": at("fanout_after_commit_seconds_p99"),
        "loop_lag_p99_seconds": at("loop_lag_p99_seconds_load"),
        "ingest_cpu_cores": None if cores is None else cores / 100,
    }
    return {
        name: {
            "at_12500": value,
            "target": TARGETS[name],
            "met": None if value is None else value < TARGETS[name],
        }
        for name, value in checks.items()
    }


async def bench(args: argparse.Namespace, root: Path, result: dict[str, Any]) -> None:
    details: list[dict[str, Any]] = result.setdefault("details", [])
    if not args.only_scaleout:
        for n in args.nodes:
            details.append(await measure_size(root, n, args))
            result["sizes"] = [size["summary"] for size in details]
            await asyncio.sleep(1)
        result["fits"] = summarize(details)
        result["targets_at_12500"] = verdicts(result["fits"])
        result["largest"] = max(result["sizes"], key=lambda x: x["nodes"])
        result["at_12500"] = at_12500(result["sizes"])
    if not args.skip_scaleout:
        result["scaleout"] = await measure_scaleout(root, args.scaleout_nodes, args)


async def until_signalled(run: Coroutine[Any, Any, None]) -> None:
    """`run`, ended by SIGTERM or SIGHUP the way asyncio ends it on Ctrl-C: the signal
    cancels this, the main task, so every `async with` unwinds and brings down what it
    started. (A handler that raises lands in whichever task is running, most often a
    simulated node's, which ends that one task and leaves the run going on: a SIGTERM
    once left the simulator reconnecting to schedulers already gone.)"""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    arrived: list[int] = []

    def stop(signum: int) -> None:
        if arrived:
            say(f"{signal.Signals(signum).name} again: still shutting down")
            return
        arrived.append(signum)
        main.cancel()

    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, stop, signum)
    try:
        await run
    except asyncio.CancelledError:
        if arrived:
            raise Terminated(arrived[0]) from None
        raise
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--nodes", type=int, nargs="+", default=[500, 1000, 2500])
    add("--window", type=float, default=15.0, help="seconds per measured phase")
    add("--trials", type=int, default=20, help="failures of each kind per size")
    add("--insecure", action="store_true", help="no TLS (default: mutual TLS, as users run it)")
    add(
        "--ingest",
        type=int,
        default=0,
        help="K > 0: K processes hold the streams and one more decides (agent_streams: "
        "false); 0: one process does both",
    )
    add(
        "--failover",
        action="store_true",
        help="with --ingest: two deciding processes, and after the failures the leading "
        "one is killed (-9) and a fatal Xid decided by the other",
    )
    add("--interval", type=float, default=1.0, help="heartbeat interval (the scheduler's)")
    add(
        "--keepalive",
        type=float,
        nargs=2,
        metavar=("SECONDS", "TIMEOUT"),
        help="the schedulers' keepalive ping interval and timeout (default: theirs)",
    )
    add("--step-seconds", type=float, default=2.0, help="the job's step time")
    add(
        "--kinds",
        nargs="+",
        choices=("stream", "xid", "silent", "hung"),
        default=["stream", "xid", "silent"],
        help="failure kinds to inject",
    )
    add("--scaleout-nodes", type=int, default=300)
    add("--skip-scaleout", action="store_true")
    add("--only-scaleout", action="store_true", help="only the 1/2/3-process runs and failover")
    add("--keep", action="store_true", help="keep the run directory (scheduler logs)")
    add("--refit", type=Path, metavar="JSON", help="fit again the sizes of an earlier run's output")
    args = parser.parse_args()
    if any(n < 16 for n in args.nodes) or args.scaleout_nodes < 16:
        parser.error(f"--nodes {args.nodes}: give 16 or more nodes (one 128-rank replica)")
    if args.failover and not args.ingest:
        parser.error("--failover: give --ingest K too (the deciding processes hold no stream)")
    if args.window <= 0 or args.trials < 0:
        parser.error("give a positive --window and --trials 0 or more")
    if args.refit:
        old = json.loads(args.refit.read_text().strip().splitlines()[-1])
        old.setdefault("details", old.get("sizes", []))  # before the headline per size
        for size in old["details"]:
            for row in size["failures"]:
                tx = row.get("decision_transaction_seconds")
                if tx is not None and "decide_seconds" in row:
                    row["decide_to_commit_seconds"] = round(row["decide_seconds"] + tx, 4)
                    if row.get("fanout_seconds") is not None:
                        row["fanout_after_commit_seconds"] = round(
                            max(row["fanout_seconds"] - tx, 0), 4
                        )
        old["fits"] = summarize(old["details"])
        old["targets_at_12500"] = verdicts(old["fits"])
        print(json.dumps(old))
        return 0
    root = Path(tempfile.mkdtemp(prefix="pitstop-scale-", dir="/tmp"))
    result: dict[str, Any] = {
        "bench": "scale",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count()},
        "insecure": args.insecure,
        "ingest_processes": args.ingest,
        "failover": args.failover,
        "leader_lease_seconds": LEASE_SECONDS,
        "kinds": args.kinds,
        "trials": args.trials,
        "heartbeat_interval_seconds": args.interval,
        "keepalive_seconds": args.keepalive or "the scheduler's defaults",
        "step_seconds": args.step_seconds,
        "window_seconds": args.window,
        "loadavg_start": load(),
        "targets": TARGETS,
    }
    began = time.monotonic()
    code = 1
    with orderly_exit(notice=say):
        try:
            asyncio.run(until_signalled(bench(args, root, result)))
            code = 0
        except (KeyboardInterrupt, Terminated) as stop:
            say(f"stopped: {stop!r}")
            code = exit_code(stop)
        except (RuntimeError, OSError, TimeoutError, grpc.RpcError) as exc:
            say(f"error: {exc!r}")
            result["error"] = repr(exc)
        finally:
            result["wall_seconds"] = round(time.monotonic() - began, 1)
            result["loadavg_end"] = load()
            if args.keep:
                say(f"kept {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)
            print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
