"""bench/scale.py stopped by SIGTERM at any moment: within 10 s every process it started
(schedulers, PostgreSQL, Redis, simulator workers, relays) is gone, it exits as a
SIGTERM'd program does, and its last line is the JSON of everything measured so far."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from kit.processes import line_with
from pitstop.client.launch import clean_env

ROOT = Path(__file__).resolve().parents[2]
STOPPED_WITHIN = 10.0
COMMAND = [
    *("bench/scale.py", "--nodes", "16", "--trials", "1", "--window", "2"),
    *("--step-seconds", "0.5", "--skip-scaleout", "--insecure"),
]


def gone(proc: psutil.Process) -> bool:
    """Whether a process recorded earlier has ended (a zombie left to a container's init
    to reap has)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def started_by(bench: subprocess.Popen[str]) -> list[psutil.Process]:
    return psutil.Process(bench.pid).children(recursive=True)


def command_lines(procs: list[psutil.Process]) -> str:
    out = []
    for proc in procs:
        try:
            out.append(" ".join(proc.cmdline()))
        except psutil.Error:
            continue
    return "\n".join(out)


def stop_at(moment: str) -> tuple[dict[str, Any], float, list[psutil.Process], int, str]:
    """Run the benchmark, SIGTERM it once stderr shows `moment`; its report, the seconds
    from the signal to its exit, what it had started (and their command lines), its exit
    code."""
    bench = subprocess.Popen(
        [sys.executable, *COMMAND],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    progress: queue.Queue[str] = queue.Queue()
    stdout: list[str] = []
    assert bench.stderr is not None
    assert bench.stdout is not None
    readers = [
        threading.Thread(target=lambda: [progress.put(line) for line in bench.stderr], daemon=True),
        threading.Thread(target=lambda: stdout.extend(bench.stdout), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        line_with(progress, moment, time.monotonic() + 90, f"the benchmark never said {moment!r}")
        children = started_by(bench)
        names = command_lines(children)
        bench.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = bench.wait(timeout=30)
        seconds = time.monotonic() - signalled
    finally:
        if bench.poll() is None:  # a test that failed leaves nothing running either
            for proc in started_by(bench):
                proc.kill()
            bench.kill()
            bench.wait()
    for reader in readers:
        reader.join(timeout=10)
    assert stdout, "no output"
    return json.loads(stdout[-1]), seconds, children, code, names


def assert_all_stopped(seconds: float, children: list[psutil.Process], code: int) -> None:
    assert code == 128 + signal.SIGTERM
    assert seconds <= STOPPED_WITHIN, f"{seconds:.1f} s from SIGTERM to its exit"
    left = [p for p in children if not gone(p)]
    assert left == [], f"still running:\n{command_lines(left)}"


def test_sigterm_while_registering_stops_every_process() -> None:
    report, seconds, children, code, names = stop_at("registering on")
    # Everything the size started is up: stores, a scheduler, a worker and its relay.
    for part in ("postgres", "redis-server", "bench._scale_worker", "bench._scale_relay"):
        assert part in names, f"no {part} among the processes started:\n{names}"
    assert_all_stopped(seconds, children, code)
    assert report["bench"] == "scale"
    (size,) = report["details"]
    assert size["nodes"] == 16
    assert size["interrupted"] is True
    assert size["spares"] >= 8


def test_sigterm_during_the_failures_keeps_what_was_measured() -> None:
    report, seconds, children, code, _ = stop_at("failure xid #1")
    assert_all_stopped(seconds, children, code)
    (size,) = report["details"]
    assert size["interrupted"] is True
    for phase in ("idle", "job", "load"):
        assert phase in size, phase
    assert size["load"]["heartbeats_ingested_per_s"] > 0
    # The broken stream measured before the signal is there, with its times.
    first = size["failures"][0]
    assert first["kind"] == "stream"
    assert first["detect_seconds"] >= 0
    assert first["fanout_seconds"] is not None
    # The size's headline of what it has, marked interrupted.
    (headline,) = report["sizes"]
    assert headline["interrupted"] is True
    assert headline["samples"]["pushed"] >= 1
    assert headline["detect_pushed"]["n"] >= 1
    assert report["at_12500"] is None
