"""`make demo`: the main job. A local cluster comes up (embedded PostgreSQL and Redis, a
scheduler, 4 worker nodes and 2 hot spares, simulated GPUs), the example GPT job trains on
it, a fatal Xid hits one node and another node is killed with kill -9 mid-run; training
goes on. The summary shows each failure's detect -> resume time, the steps lost, the
goodput, and the final-weights hash next to the fault-free reference.

    .venv/bin/python scripts/demo.py [--steps 150] [--step-seconds 0.1] [--keep]
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.rule import Rule
from rich.table import Table

from pitstop.client.localcluster import LocalCluster
from pitstop.client.scenario import (
    Driver,
    Fault,
    Injected,
    example_spec,
    read_hash,
    reference_hash,
)
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
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    return parser.parse_args()


def show_event(event: common_pb2.Event) -> None:
    if event.kind not in SHOWN:
        return
    at = dt.datetime.fromtimestamp(event.time.ToMicroseconds() / 1e6).strftime("%H:%M:%S.%f")
    who = event.node_id or event.job_id
    console.print(f"[dim]{at[:-3]}[/dim] [bold]{event.kind:<17}[/bold] {who:<14} {event.reason}")


def summary(
    run_job: jobs_pb2.Job, injected: list[Injected], reference: str, seconds: float
) -> bool:
    goodput = run_job.goodput
    table = Table(title="what happened", show_lines=False)
    for column in (
        "failure",
        "node",
        "at step",
        "detect",
        "decide",
        "resume",
        "total",
        "steps lost",
    ):
        table.add_column(column, justify="right" if column not in ("failure", "node") else "left")
    for fault, incident in zip(injected, goodput.incidents, strict=False):
        # Detection from the moment the fault was injected (the scheduler only knows
        # the node's last heartbeat or the Xid's report).
        detect = max(0.0, incident.failed_at + incident.detect_seconds - fault.at)
        total = detect + incident.decide_seconds + incident.resume_seconds
        table.add_row(
            {"xid": "fatal Xid 79", "node_kill": "kill -9 of the node"}.get(
                fault.fault.kind, fault.fault.kind
            ),
            fault.node_id,
            str(fault.step),
            f"{detect:.2f} s",
            f"{incident.decide_seconds:.2f} s",
            f"{incident.resume_seconds:.2f} s",
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
    console.print(facts)
    return same and run_job.state == common_pb2.JOB_STATE_SUCCEEDED


def main() -> int:
    args = parse_args()
    console.print(Rule("pitstop demo: training that survives failures"))
    reference = reference_hash(args.steps)  # the fault-free run, alongside
    console.print("starting a local cluster: 4 workers and 2 hot spares (simulated GPUs)")
    earlier = LocalCluster.load(STATE_DIR)
    if earlier is not None:
        earlier.down()
    shutil.rmtree(STATE_DIR, ignore_errors=True)  # a fresh cluster: no job of an earlier run
    cluster = LocalCluster.up(
        STATE_DIR, nodes=4, spares=2, port=0, progress=lambda m: console.print(f"  {m}")
    )
    ok = False
    try:
        console.print(f"scheduler at {cluster.scheduler_address}; nodes ready")
        third = args.steps // 3
        faults = [Fault(third, "xid"), Fault(2 * third, "node_kill")]
        spec = example_spec(
            "demo-gpt", dp=4, steps=args.steps, step_seconds=args.step_seconds, spares=2
        )
        with Progress(
            TextColumn("[bold]training[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[state]}"),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
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

            driver = Driver(cluster, on_step=on_step, on_event=show_event, on_fault=on_fault)
            run = driver.run(spec, faults)
        console.print(Rule("summary"))
        ok = summary(run.job, run.injected, read_hash(reference), run.seconds)
    finally:
        if args.keep:
            console.print(f"cluster left running: pitstop cluster down --state-dir {STATE_DIR}")
        else:
            cluster.down()
            console.print("cluster stopped: nothing left running")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
