"""`make demo`: a scheduler on embedded PostgreSQL and Redis, driven with the CLI.

Until the local cluster lands this walks through the durable core: submit, list,
show, a refused spec, the event log, a scheduler restart that loses nothing, cancel.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STATE_DIR = ROOT / ".state" / "demo"
console = Console()


def start_scheduler() -> tuple[subprocess.Popen[str], str]:
    """Start pitstop-scheduler on a free port; return it and its address."""
    proc = subprocess.Popen(
        [
            str(BIN / "pitstop-scheduler"),
            "--state-dir",
            str(STATE_DIR),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            address = line.rsplit(" ", 1)[1].strip()
            console.print(f"[green]scheduler up[/green] at {address} (state in {STATE_DIR})")
            return proc, address
    raise SystemExit(f"pitstop-scheduler exited with {proc.wait()} before listening")


def stop_scheduler(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    console.print(f"[yellow]scheduler stopped[/yellow] (SIGTERM, exit {code})")


def pitstop(address: str, *args: str, check: bool = True) -> str:
    """Run the CLI like a person would, echo the command and its output."""
    console.print(f"\n[bold cyan]$ pitstop {' '.join(args)}[/bold cyan]")
    result = subprocess.run(
        [str(BIN / "pitstop"), "--server", address, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
    )
    out = (result.stdout + result.stderr).rstrip()
    if out and "--json" not in args:
        console.print(out, highlight=False, markup=False, soft_wrap=True)
    if check and result.returncode != 0:
        raise SystemExit(f"command failed with exit {result.returncode}")
    return result.stdout


def main() -> int:
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    STATE_DIR.mkdir(parents=True)
    console.print(Rule("pitstop demo: the durable core"))
    proc, address = start_scheduler()
    try:
        submitted = json.loads(
            pitstop(address, "job", "submit", "-f", "examples/jobs/tiny.yaml", "--json")
        )
        job_id = submitted["id"]
        console.print(f"submitted [bold]{job_id}[/bold]")
        pitstop(address, "job", "list")
        pitstop(address, "job", "show", job_id)

        console.print(Rule("a bad spec is refused, naming the field"))
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as bad:
            bad.write("name: wide\ncommand: [python, train.py]\ntp: 3\ngpus_per_node: 8\n")
        pitstop(address, "job", "submit", "-f", bad.name, check=False)
        os.unlink(bad.name)

        pitstop(address, "events", "--job", job_id)

        console.print(Rule("restart the scheduler: nothing is lost"))
        stop_scheduler(proc)
        proc, address = start_scheduler()
        listed = json.loads(pitstop(address, "job", "list", "--json"))
        assert job_id in [j["id"] for j in listed], "the job did not survive the restart"
        console.print(f"[green]{job_id} is still there after the restart[/green]")
        pitstop(address, "job", "cancel", job_id, "--reason", "demo over")
        pitstop(address, "events", "--job", job_id)
        pitstop(address, "node", "list")
    finally:
        stop_scheduler(proc)
    console.print(Rule("done"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
