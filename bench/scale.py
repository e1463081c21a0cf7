"""Scale benchmark: real scheduler processes under a simulated fleet speaking the real
agent protocol, measured at several fleet sizes and projected to 12,500 nodes.

Per fleet size N (--nodes, default 500 1000 2500) the benchmark starts a PostgreSQL and
a Redis of its own (the machine's binaries, fresh per size, so their statistics are the
scheduler's alone) and the `pitstop-scheduler` processes on them: one that leads and
holds every stream (--ingest 0), or one that only decides (agent_streams: false) beside
K that only hold streams (--ingest K, leader_loops: false). Mutual TLS is on, as users
run it: the run's CA signs each simulated node's certificate (what enrollment would
hand it; each simulator process signs its own nodes'); --insecure turns TLS off.

The simulated fleet: N 8-GPU nodes in zones, blocks and racks (8 nodes a rack, 49 racks
a block, 8 blocks a zone) plus 2% hot spares (at least 8, one more for each failure to
come, and with --mass-loss-replace as many as it may cut), no torch, in --sim-procs
worker processes (bench/_scale_worker.py; default one per 400 nodes, node i in process i
mod P), each an asyncio loop, driven by this process over pipes. Each node has its own
channel and `AgentService.Connect` stream, as an agent has: Register (inventory, labels,
role); a look every heartbeat interval the scheduler gives (1 s), sending a heartbeat
(node health with 8 GPUs, the running ranks) when what it says changed and at least
every refresh interval (5 s), and its ranks' new steps summarized per node (and a window
summary per rank every 20 steps); a CommandAck for every command; gRPC's keepalive pings
answered in its core. The nodes whose network can be cut (a few for the silent deaths;
with --mass-loss every one) connect through a relay process of their worker
(bench/_scale_relay.py: a port per node, so it knows whose bytes it carries), which cuts
any set of them on request: no byte passes either way and nothing is closed, as a cut
cable; a heal lets through what waited.

Each worker and relay samples its event-loop lag every 50 ms and reports it (the largest
since its last report, and every lag over 100 ms with when it ended) with its CPU
seconds about every 0.5 s and on request. A failure sample taken while any of them
lagged more than 100 ms (between the injection and the end of its fan-out) is flagged
`sim_lagged`: late heartbeats or pings there are the benchmark's, not the scheduler's.

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
  CPU of the simulator processes, the relays, this process, PostgreSQL and Redis, and
  the simulators' and relays' largest lag.
* failures under load, --trials of each kind (--kinds, default stream xid exit silent)
  on nodes of the job: a broken stream (the call reset, as a dead host's TCP reset), a
  fatal Xid (79 on one GPU: the Xid, the rank's exit, a heartbeat saying FATAL, as the
  agent sends them), a rank's exit (code 1: RankExited at once, then a heartbeat without
  that rank), a silent death (the node's relay cuts it for good: seen only by the
  stream's keepalive pings), and on request an agent hung in Python (heartbeats stop,
  pings answered: the 12.5 s deadline). detect = injection (the simulator's or relay's
  clock) -> node.lost, node.unhealthy (xid) or rank.exited (exit) of that node; decide =
  that event -> its decision committed (job.recovering, job.restarting or
  job.reconfigured plus the decision's transaction); fan-out = the commit -> the last
  node of the new generation (the nodes the scheduler placed it on: rank_assignments)
  has its Reconfigure or StartRanks (the simulator's clock; same host); resume = ->
  job.recovered. A failure not detected, not decided or not fanned out to every node
  within 60 s is a failed sample: +inf in every percentile it belongs to. A false loss
  is a node.lost of a node no failure was injected on.
* with --mass-loss FRACTION, after the failures: that share of the job's nodes cut at
  once for --mass-loss-seconds (20), then healed. Reported as `mass_loss`: nodes_cut,
  held / released (a job.held / job.released event came), seconds_to_release (the heal
  -> job.released), nodes_replaced (cut nodes no longer in the job's newest generation),
  steps_lost (the newest step the nodes reported before the cut minus the step the job
  resumed from: a new generation's restore step, else 0), generation_before/_after,
  false_losses (nodes outside the cut set declared lost meanwhile).
* with --failover (and --ingest K): two deciding processes run; after the failures the
  leading one is killed (-9) and a fatal Xid injected at once. failover_seconds = the
  kill -> the Xid's decision committed by the other (judged against the lease period,
  leader_lease_seconds in the output); a node declared lost meanwhile is a false loss.
* with --mass-loss-replace (and --mass-loss): as many job nodes as the free spares
  cover (at least the mass-loss threshold, --mass-loss-nodes or 16) cut until each is
  out of the job's newest generation (or the replace deadline, --mass-loss-replace-after,
  --mass-loss-seconds + 20 s for this run, is a minute past), then healed:
  `mass_loss_replace` says how many were replaced in how many decisions (generations).
  Then the job ends (as --end-job).
* with --end-job, last: every rank of the job's newest generation exits 0 with its
  result; `job_end` is the job's state (SUCCEEDED expected) and the time to job.succeeded.

The scheduler's mass-loss settings pass through from --mass-loss-nodes, -job-share,
-window, -replace-after and -replace-batch (PITSTOP_MASS_LOSS_*), when given.

Then, at --scaleout-nodes, the idle and load phases with 1, 2 and 3 processes that each
both lead and hold streams, and leader failover under load (kill -9 of the leading
process, a fatal Xid at once on a node of a surviving process).

Percentiles interpolate between order statistics (type 7: bench/_scale_stats.py); each
comes as {"p50", "p90", "p99", "n", "failed"}, p99 only from 30 samples (else null and
"p99_needs": 30), null where a failed sample is within reach. The headline percentiles
leave out the sim_lagged samples, reported apart (`sim_lagged`: their count and values).

The last line holds, per size (`sizes`) and for the largest (`largest`), the headline:
nodes, duration_s (the job running), false_losses, detect_silent_p99_s,
detect_pushed_p99_s (stream, xid, exit), decide_p99_s, fanout_p99_s (each the p99
above, or null), the blocks detect_silent, detect_pushed, detect_hung, decide, fanout
and sim_lagged, leader_cpu_cores (the deciding process in the load window),
ingest_cpu_cores_per_1000_nodes, command_bytes_max, samples (taken, per group),
failed_samples, simulator (per worker and relay: largest CPU in cores and lag),
max_generation, unexplained_generations (max_generation - 1 - the recoveries the
injections call for: one per failure, one per mass-loss drill, one per replace batch of
the replace drill) and mass_loss (null without a drill); and `at_12500`: each of those
costs fitted linearly in N (a fixed part plus a cost per node) and taken to 12,500
nodes, the ingest CPU spread over processes of at most 0.75 cores beside one deciding
process. `details` and `fits` keep every phase; `details` gets each measurement as it
is taken, so a run stopped half-way (SIGINT, SIGTERM, SIGHUP) reports what it measured,
the size it was in marked "interrupted": true.

    .venv/bin/python bench/scale.py [--nodes 500 1000 2500] [--ingest 2] [--window 15]
        [--trials 20] [--kinds stream xid exit silent] [--insecure] [--step-seconds 2]
        [--failover] [--sim-procs P] [--mass-loss 0.1 [--mass-loss-seconds 20]
        [--mass-loss-replace]] [--end-job] [--scaleout-nodes 300]
        [--skip-scaleout | --only-scaleout] [--refit OLD.json]

The machine is shared: the JSON records os.getloadavg() at each phase. Progress goes to
stderr; the last line of stdout is one JSON object. On SIGINT, SIGTERM or SIGHUP every
process the benchmark started (schedulers, PostgreSQL, Redis, simulators, relays) is
gone within 10 s (SIGTERM, then SIGCONT and SIGKILL for any still there) and the JSON
printed; the exit code is 128 + the signal's number.
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
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from pitstop.client.signals import ORDERLY_SIGNALS, Terminated, exit_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._scale_fits import headline, refit
from bench._scale_procs import LEASE_SECONDS, reap_children, wait_for
from bench._scale_run import Run
from bench._scale_sim import TARGETS, load, say
from bench._scale_size import brief, measure_size

STOP_DEADLINE = 7.5
"""Seconds after a signal by which every process is killed and the JSON printed, whether
or not the orderly shutdown has finished."""


async def measure_scaleout(
    root: Path, n: int, args: argparse.Namespace, out: dict[str, Any]
) -> None:
    out.update(nodes=n, by_processes={})
    for k in (1, 2, 3):
        row: dict[str, Any] = {}
        out["by_processes"][str(k)] = row
        async with Run(root, n, k, args) as run:
            row["idle"] = await run.window().measure(args.window)
            row["job"] = await run.start_job()
            await asyncio.sleep(args.step_seconds * 3)
            row["load"] = await run.window().measure(args.window)
            say(f"scale-out N={n} k={k}: idle {brief(row['idle'])}; load {brief(row['load'])}")
            if k == 2:
                row["failover"] = await failover(run)
                say(f"scale-out: failover {row['failover']}")


async def failover(run: Run) -> dict[str, Any]:
    """kill -9 of the leader under load, a fatal Xid at once on a survivor's node."""
    assert run.fleet is not None
    leader = None
    for i, s in enumerate(run.schedulers):
        if (await asyncio.to_thread(s.metrics))["leader"] == 1.0:
            leader = i
    if leader is None:
        return {"error": "no leader found"}
    survivor = next(i for i in range(len(run.schedulers)) if i != leader)
    orphans = [v for v in run.fleet.nodes if v.target == leader]
    before = {v.node_id: v.registrations for v in orphans}
    t0, m0 = time.time(), time.monotonic()
    run.schedulers[leader].kill()
    await run.fleet.set_alive({i for i, s in enumerate(run.schedulers) if s.alive()})
    row = await run.failure("xid", on_scheduler=survivor)
    await wait_for(
        lambda: all(v.registrations > before[v.node_id] for v in orphans if not v.dead),
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


async def bench(args: argparse.Namespace, root: Path, result: dict[str, Any]) -> None:
    """Every size, then the scale-out; each measurement lands in `result` as it is
    taken."""
    details: list[dict[str, Any]] = result.setdefault("details", [])
    if not args.only_scaleout:
        for n in args.nodes:
            size: dict[str, Any] = {"nodes": n, "interrupted": True}
            details.append(size)
            try:
                await measure_size(root, n, args, size)
            except Exception as exc:
                size.pop("interrupted", None)
                size["error"] = repr(exc)
                raise
            await asyncio.sleep(1)
        headline(result)
    if not args.skip_scaleout:
        result["scaleout"] = {}
        await measure_scaleout(root, args.scaleout_nodes, args, result["scaleout"])


def finite(value: Any) -> Any:
    """`value` with every non-finite float as None: JSON has no infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class Stop:
    """The end of a run on SIGINT, SIGTERM or SIGHUP. The first one cancels the run's
    task, so each `async with` stops what it started; a thread it starts makes sure that
    within STOP_DEADLINE every process under this one is gone and the JSON printed, even
    if that unwinding hangs. Later signals only say the stop goes on. The JSON is printed
    once, whoever gets there first."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result
        self.signum: int | None = None
        self.task: asyncio.Task[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._printed = False
        self._lock = threading.Lock()

    def install(self) -> None:
        for signum in ORDERLY_SIGNALS:
            signal.signal(signum, self.handle)

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            say(f"{name} again: still stopping (everything is killed by the deadline)")
            return
        self.signum = signum
        say(f"{name}: stopping every process; the JSON follows")
        threading.Thread(target=self._deadline, name="stop deadline", daemon=True).start()
        if self.loop is not None and self.task is not None:
            # The loop may be closing or closed (the run over): then nothing to cancel.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.task.cancel)

    @property
    def error(self) -> BaseException:
        assert self.signum is not None
        return KeyboardInterrupt() if self.signum == signal.SIGINT else Terminated(self.signum)

    async def run(self, args: argparse.Namespace, root: Path) -> None:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        if self.signum is None:
            await bench(args, root, self.result)

    def _deadline(self) -> None:
        time.sleep(STOP_DEADLINE)
        if self._printed:
            return
        killed = reap_children(1.0)
        self.result["killed_at_stop_deadline"] = killed
        with contextlib.suppress(Exception):
            headline(self.result)
        self.emit()
        os._exit(exit_code(self.error))

    def emit(self) -> None:
        """The JSON line, once."""
        with self._lock:
            if self._printed:
                return
            for _ in range(5):  # the other thread may be changing it: try again
                try:
                    line = json.dumps(finite(self.result))
                    break
                except (RuntimeError, ValueError, TypeError):
                    time.sleep(0.05)
            else:
                line = json.dumps({"bench": "scale", "error": "the result could not be written"})
            print(line, flush=True)
            self._printed = True


def parse() -> argparse.Namespace:
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
        choices=("stream", "xid", "exit", "silent", "hung"),
        default=["stream", "xid", "exit", "silent"],
        help="failure kinds to inject",
    )
    add("--sim-procs", type=int, default=0, help="simulator processes (default: 1 per 400 nodes)")
    add("--mass-loss", type=float, metavar="FRACTION", help="the mass-loss drill: cut this share")
    add("--mass-loss-seconds", type=float, default=20.0, help="how long the drill's cut lasts")
    add(
        "--mass-loss-replace",
        action="store_true",
        help="with --mass-loss: also cut as many as the spares cover past the replace deadline",
    )
    add("--end-job", action="store_true", help="at the end, every rank exits 0 (job.succeeded)")
    add("--mass-loss-nodes", type=int, help="PITSTOP_MASS_LOSS_NODES (scheduler's default 16)")
    add("--mass-loss-job-share", type=float, help="PITSTOP_MASS_LOSS_JOB_SHARE")
    add("--mass-loss-window", type=float, help="PITSTOP_MASS_LOSS_WINDOW_SECONDS")
    add(
        "--mass-loss-replace-after",
        type=float,
        help="PITSTOP_MASS_LOSS_REPLACE_AFTER_SECONDS (with --mass-loss-replace: "
        "--mass-loss-seconds + 20)",
    )
    add("--mass-loss-replace-batch", type=int, help="PITSTOP_MASS_LOSS_REPLACE_BATCH")
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
    if args.window <= 0 or args.trials < 0 or args.sim_procs < 0:
        parser.error("give a positive --window, and --trials and --sim-procs 0 or more")
    if args.mass_loss is not None and not 0 < args.mass_loss < 1:
        parser.error("--mass-loss: a share of the job's nodes, between 0 and 1")
    if args.mass_loss_replace and not args.mass_loss:
        parser.error("--mass-loss-replace: give --mass-loss FRACTION too")
    if args.mass_loss_replace and args.mass_loss_replace_after is None:
        # Past the hold drill's cut, or its nodes would be replaced before they return.
        args.mass_loss_replace_after = args.mass_loss_seconds + 20.0
    if (
        args.mass_loss
        and args.mass_loss_replace_after is not None
        and args.mass_loss_replace_after <= args.mass_loss_seconds + 10
    ):
        parser.error(
            f"--mass-loss-replace-after {args.mass_loss_replace_after:g}: the hold drill cuts "
            f"its nodes for --mass-loss-seconds {args.mass_loss_seconds:g}, and they would be "
            "replaced before they return; give a deadline at least 10 s past the cut"
        )
    settings = {
        "PITSTOP_MASS_LOSS_NODES": args.mass_loss_nodes,
        "PITSTOP_MASS_LOSS_JOB_SHARE": args.mass_loss_job_share,
        "PITSTOP_MASS_LOSS_WINDOW_SECONDS": args.mass_loss_window,
        "PITSTOP_MASS_LOSS_REPLACE_AFTER_SECONDS": args.mass_loss_replace_after,
        "PITSTOP_MASS_LOSS_REPLACE_BATCH": args.mass_loss_replace_batch,
    }
    args.scheduler_settings = {k: str(v) for k, v in settings.items() if v is not None}
    # The scheduler's defaults where not given (what the replace drill sizes itself by).
    args.replace_nodes = args.mass_loss_nodes or 16
    args.replace_after = args.mass_loss_replace_after or 60.0
    args.replace_batch = args.mass_loss_replace_batch or 16
    args.end_job = args.end_job or args.mass_loss_replace
    return args


def main() -> int:
    args = parse()
    if args.refit:
        print(json.dumps(finite(refit(args.refit))))
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
        "sim_procs": args.sim_procs or "one per 400 nodes",
        "mass_loss": args.mass_loss,
        "mass_loss_seconds": args.mass_loss_seconds if args.mass_loss else None,
        "mass_loss_replace": args.mass_loss_replace,
        "scheduler_settings": args.scheduler_settings,
        "heartbeat_interval_seconds": args.interval,
        "keepalive_seconds": args.keepalive or "the scheduler's defaults",
        "step_seconds": args.step_seconds,
        "window_seconds": args.window,
        "loadavg_start": load(),
        "targets": TARGETS,
        "details": [],
    }
    began = time.monotonic()
    stop = Stop(result)
    stop.install()
    code = 1
    try:
        asyncio.run(stop.run(args, root))
        code = 0 if stop.signum is None else exit_code(stop.error)
    except asyncio.CancelledError:
        if stop.signum is None:
            raise
        code = exit_code(stop.error)
    except (RuntimeError, OSError, TimeoutError, grpc.RpcError) as exc:
        say(f"error: {exc!r}")
        result["error"] = repr(exc)
    finally:
        if stop.signum is not None:
            say(f"stopped: {stop.error!r}")
        with contextlib.suppress(Exception):
            headline(result)
        result["wall_seconds"] = round(time.monotonic() - began, 1)
        result["loadavg_end"] = load()
        left = reap_children(2.0)
        if left:
            result["killed_at_end"] = left
        if args.keep:
            say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        stop.emit()
    return code


if __name__ == "__main__":
    sys.exit(main())
