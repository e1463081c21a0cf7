"""The real binaries on embedded stores: a job and its events survive a scheduler restart
on the same state dir, and SIGTERM shuts everything down."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from pitstop.client.launch import binary, clean_env, scheduler_command

ROOT = Path(__file__).resolve().parents[2]
# The scheduler under test must choose the embedded stores: no PITSTOP_* from outside.
ENV = clean_env()


@contextmanager
def scheduler_process(state_dir: Path) -> Iterator[str]:
    log_path = state_dir.parent / f"{state_dir.name}-scheduler.log"
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        proc = subprocess.Popen(
            scheduler_command(state_dir=state_dir, port=0, metrics_port=0, dashboard_port=0),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=ENV,
        )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, log_path.read_text()[-3000:]
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        assert proc.poll() is None, f"the scheduler died: {log_path.read_text()[-3000:]}"
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running after SIGTERM: {alive}"


def cli(address: str, *args: str) -> str:
    result = subprocess.run(
        [binary("pitstop"), "--server", address, *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_job_and_its_events_survive_a_restart_on_embedded_stores(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with scheduler_process(state) as address:
        job = json.loads(cli(address, "job", "submit", "-f", "examples/jobs/tiny.yaml", "--json"))
        listed = json.loads(cli(address, "job", "list", "--json"))
        assert job["id"] in [j["id"] for j in listed]
    assert (state / "postgres" / "PG_VERSION").is_file()

    with scheduler_process(state) as address:
        listed = json.loads(cli(address, "job", "list", "--json"))
        (again,) = [j for j in listed if j["id"] == job["id"]]
        assert again["spec"]["name"] == "tiny"
        assert again["state"] == "JOB_STATE_PENDING"
        events = json.loads(cli(address, "events", "--job", job["id"], "--json"))
        assert [e["kind"] for e in events] == ["job.submitted"]
