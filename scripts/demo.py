"""`make demo`: the main job. A local cluster comes up (embedded PostgreSQL and Redis, a
scheduler, 4 worker nodes and 2 hot spares, simulated GPUs), the example GPT job trains on
it, a fatal Xid hits one node and another node is killed with kill -9 mid-run; training
goes on. The summary shows each failure's detect -> resume time, the steps lost, the
goodput, and the final-weights hash next to the fault-free reference.

    .venv/bin/python scripts/demo.py [--steps 150] [--step-seconds 0.1] [--keep] [--load [2]]
                                     [--json]

With --json its last line is the summary as one JSON object: each failure's detect,
decide, resume and total seconds and steps lost (`failures`), `bitwise_equal`, the job's
state and goodput; also when it ends otherwise (`error` says why).

It never hangs: a job that makes no step for --stall-seconds (90), or is not over by a
deadline from its steps and pace, ends the demo with the job's recent events (what the
scheduler last decided and why) and exit code 1. Nothing outlives it: on its end, an
error, Ctrl-C, SIGTERM or SIGHUP the cluster goes down (SIGKILL of the demo leaves it to
the next run, or `pitstop cluster down --state-dir .state/demo`), and the reference run
and the CPU load of --load die with it whatever kills it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.rule import Rule
from rich.table import Table

from pitstop.client.cpuload import DEFAULT_PROCS, MAX_SECONDS, cpu_load
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import (
    DEFAULT_LIVENESS_TIMEOUT,
    ClusterError,
    running_cluster,
    stop_cluster,
)
from pitstop.client.scenario import (
    STALL_TIMEOUT,
    Driver,
    Fault,
    Injected,
    JobStuck,
    ReferenceRun,
    example_spec,
    run_deadline,
)
from pitstop.client.signals import Terminated, exit_code, orderly_exit
from pitstop.v1 import common_pb2, jobs_pb2

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = ROOT / ".state" / "demo"
console = Console()

SHOWN = {
    "job.placed",
    "job.running",
    "job.recovering",
    "job.restarting",
    "job.reconfigured",
    "job.recovered",
    "job.succeeded",
    "job.failed",
    "node.xid",
    "node.unhealthy",
    "node.lost",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave the cluster running when the demo ends (Ctrl-C still stops it)",
    )
    parser.add_argument(
        "--load",
        type=int,
        nargs="?",
        const=DEFAULT_PROCS,
        default=0,
        metavar="PROCS",
        help=f"run PROCS busy processes beside the demo (default {DEFAULT_PROCS})",
    )
    parser.add_argument("--workers", type=int, default=4, help="worker nodes (the job's dp)")
    parser.add_argument("--spares", type=int, default=2, help="hot spares")
    parser.add_argument(
        "--stall-seconds",
        type=float,
        default=STALL_TIMEOUT,
        help="give up when the job makes no step for this long",
    )
    parser.add_argument(
        "--liveness-seconds",
        type=float,
        default=DEFAULT_LIVENESS_TIMEOUT,
        help="a node silent this long is lost (a hung agent; a dead one is seen at once)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON object, the last line",
    )
    parser.add_argument("--state-dir", type=Path, default=STATE_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers < 2 or args.spares < 1 or args.steps < 6:
        parser.error(
            "the demo fails two nodes: give --workers 2 or more, --spares 1 or more, "
            "--steps 6 or more"
        )
    return args


def show_event(event: common_pb2.Event) -> None:
    if event.kind not in SHOWN:
        return
    at = dt.datetime.fromtimestamp(event.time.ToMicroseconds() / 1e6).strftime("%H:%M:%S.%f")
    who = event.node_id or event.job_id
    console.print(f"[dim]{at[:-3]}[/dim] [bold]{event.kind:<17}[/bold] {who:<14} {event.reason}")


def summary(
    run_job: jobs_pb2.Job,
    injected: list[Injected],
    reference: str,
    seconds: float,
    record: jobs_pb2.JobRecord | None = None,
) -> dict[str, object]:
    """Print the summary; the same as a dict (what --json prints)."""
    goodput = run_job.goodput
    failures: list[dict[str, object]] = []
    table = Table(title="what happened", show_lines=False)
    for column in (
        "failure",
        "node",
        "at step",
        "detect",
        "decide",
        "resume (restore + re-form)",
        "total",
        "steps lost",
    ):
        table.add_column(column, justify="right" if column not in ("failure", "node") else "left")
    for fault, incident in zip(injected, goodput.incidents, strict=False):
        # Detection from the moment the fault was injected (the scheduler only knows
        # the node's last heartbeat or the Xid's report).
        detect = max(0.0, incident.failed_at + incident.detect_seconds - fault.at)
        total = detect + incident.decide_seconds + incident.resume_seconds
        failures.append(
            {
                "kind": fault.fault.kind,
                "node": fault.node_id,
                "step": fault.step,
                "detect_s": round(detect, 3),
                "decide_s": round(incident.decide_seconds, 3),
                "resume_s": round(incident.resume_seconds, 3),
                "restore_s": round(incident.restore_seconds, 3),
                "reform_s": round(incident.reform_seconds, 3),
                "total_s": round(total, 3),
                "lost_steps": incident.lost_steps,
            }
        )
        table.add_row(
            {"xid": "fatal Xid 79", "node_kill": "kill -9 of the node"}.get(
                fault.fault.kind, fault.fault.kind
            ),
            fault.node_id,
            str(fault.step),
            f"{detect:.2f} s",
            f"{incident.decide_seconds:.2f} s",
            f"{incident.resume_seconds:.2f} s"
            + (
                f" ({incident.restore_seconds:.2f} + {incident.reform_seconds:.2f})"
                if incident.restore_seconds + incident.reform_seconds > 0
                else ""
            ),
            f"[bold]{total:.2f} s[/bold]",
            str(incident.lost_steps),
        )
    console.print(table)
    final = run_job.result.get("final_weights_sha256", "")
    same = final == reference
    facts = Table.grid(padding=(0, 2))
    facts.add_row("job", f"{run_job.id} {common_pb2.JobState.Name(run_job.state)}")
    facts.add_row("steps", f"{run_job.current_step} in {seconds:.1f} s wall")
    facts.add_row(
        "goodput",
        f"{goodput.ratio:.1%} (productive {goodput.productive_seconds:.1f} s; lost: detect "
        f"{goodput.detect_seconds:.1f} s, recovery {goodput.recovery_seconds:.1f} s, "
        f"recompute {goodput.recompute_seconds:.1f} s)",
    )
    facts.add_row("final weights", final or "(none reported)")
    facts.add_row("fault-free run", reference)
    facts.add_row(
        "bitwise equal", "[bold green]yes[/bold green]" if same else "[bold red]NO[/bold red]"
    )
    if record is not None:
        code = record.submitted_code
        dirty = f" (+ uncommitted changes {code.dirty_digest[:12]})" if code.dirty else ""
        facts.add_row("code", f"{code.git_commit or '(not a git tree)'}{dirty}")
        if record.generations:
            first = record.generations[0]
            env = first.environment
            facts.add_row(
                "environment", f"python {env.python}, torch {env.torch}, pitstop {env.pitstop}"
            )
            facts.add_row("data", first.data_digest or "(no digest stated)")
        facts.add_row("record", f"pitstop job record {run_job.id} (with --keep)")
    console.print(facts)
    return {
        "ok": same and run_job.state == common_pb2.JOB_STATE_SUCCEEDED,
        "job": run_job.id,
        "state": common_pb2.JobState.Name(run_job.state).removeprefix("JOB_STATE_"),
        "steps": run_job.current_step,
        "wall_s": round(seconds, 3),
        "failures": failures,
        "goodput": round(goodput.ratio, 4),
        "final_weights_sha256": final,
        "reference_sha256": reference,
        "bitwise_equal": same,
    }


def main() -> int:
    args = parse_args()
    result: dict[str, object] = {"ok": False, "error": "it did not finish"}
    try:
        with orderly_exit(notice=lambda line: console.print(f"[yellow]{line}[/yellow]")):
            try:
                return run_demo(args, result)
            except (KeyboardInterrupt, Terminated) as stop:
                what = "Ctrl-C" if isinstance(stop, KeyboardInterrupt) else str(stop)
                console.print(
                    f"[bold red]{what}: the demo stopped, and so did its cluster[/bold red]"
                )
                result["error"] = f"stopped: {what}"
                return exit_code(stop)
            except (ClusterError, PitstopError, RuntimeError) as exc:
                console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
                result["error"] = str(exc)
                return 1
    finally:
        if args.json:
            print(json.dumps(result), flush=True)


def run_demo(args: argparse.Namespace, result: dict[str, object]) -> int:
    """The demo; what --json prints is filled into `result`."""
    console.print(Rule("pitstop demo: training that survives failures"))
    third = args.steps // 3
    faults = [Fault(third, "xid"), Fault(2 * third, "node_kill")]
    deadline = run_deadline(args.steps, args.step_seconds, len(faults))
    ok = False
    with contextlib.ExitStack() as stack:
        if args.load:
            load = stack.enter_context(cpu_load(args.load, min(MAX_SECONDS, deadline + 600)))
            console.print(
                f"CPU load: {args.load} busy processes beside the demo "
                f"(pids {', '.join(map(str, load.pids))})"
            )
        reference = stack.enter_context(ReferenceRun(args.steps))  # the fault-free run
        console.print(
            f"starting a local cluster: {args.workers} workers and {args.spares} hot spares "
            "(simulated GPUs)"
        )
        # An earlier demo's cluster, recorded in its cluster.json or not, and its job.
        stop_cluster(args.state_dir)
        shutil.rmtree(args.state_dir, ignore_errors=True)
        cluster = stack.enter_context(
            running_cluster(
                args.state_dir,
                keep=args.keep,
                nodes=args.workers,
                spares=args.spares,
                port=0,
                liveness_timeout=args.liveness_seconds,
                progress=lambda m: console.print(f"  {m}"),
            )
        )
        secure = (
            "TLS, every node enrolled with a join token and on mutual TLS"
            if cluster.tls
            else "insecure"
        )
        console.print(
            f"scheduler at {cluster.scheduler_address} ({secure}); nodes ready; a silent "
            "node is lost "
            f"after {cluster.liveness_timeout:g} s; the run gives up after "
            f"{args.stall_seconds:.0f} s without a step or {deadline:.0f} s in all"
        )
        if cluster.dashboard_url:
            signin = (
                f" (sign in with the token in {cluster.admin_token_file}; its certificate is "
                f"signed by the cluster CA {cluster.ca_cert})"
                if cluster.tls
                else ""
            )
            console.print(f"watch it live: {cluster.dashboard_url}{signin}")
        spec = example_spec(
            "demo-gpt",
            dp=args.workers,
            steps=args.steps,
            step_seconds=args.step_seconds,
            spares=args.spares,
        )
        bar = stack.enter_context(
            Progress(
                TextColumn("[bold]training[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[state]}"),
                TimeElapsedColumn(),
                console=console,
            )
        )
        task = bar.add_task("steps", total=args.steps, state="")

        def on_step(job: jobs_pb2.Job) -> None:
            state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
            bar.update(task, completed=job.current_step, state=state)

        def on_fault(injected: Injected) -> None:
            what = {"xid": "fatal Xid 79 injected on", "node_kill": "kill -9 of"}
            console.print(
                f"[bold red]>>> {what.get(injected.fault.kind, injected.fault.kind)} "
                f"{injected.node_id} at step {injected.step}[/bold red]"
            )

        def on_problem(message: str) -> None:
            console.print(f"[yellow]{escape(message)}[/yellow]")

        driver = stack.enter_context(
            Driver(
                cluster,
                on_step=on_step,
                on_event=show_event,
                on_fault=on_fault,
                on_problem=on_problem,
                stall_timeout=args.stall_seconds,
            )
        )
        try:
            run = driver.run(spec, faults, timeout=deadline)
        except JobStuck as stuck:
            bar.stop()
            console.print(Rule("[bold red]the job is stuck[/bold red]"))
            console.print(str(stuck), markup=False, highlight=False)
            console.print(f"daemon logs: {cluster.log_dir}; rank logs: {cluster.state_dir}/nodes")
            result["error"] = f"the job is stuck: {stuck}"
        else:
            bar.stop()
            console.print(Rule("summary"))
            result.clear()
            result.update(
                summary(run.job, run.injected, reference.final_hash(), run.seconds, run.record)
            )
            ok = bool(result["ok"])
    if args.keep:
        console.print(f"cluster left running: pitstop cluster down --state-dir {args.state_dir}")
    else:
        console.print("cluster stopped: nothing left running")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
