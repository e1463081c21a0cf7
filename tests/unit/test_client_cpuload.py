"""The bounded CPU load (`pitstop.client.cpuload`, `scripts/cpuload.py`): its bounds, and
that its busy processes never outlive it: not its time, not its block, not a SIGTERM,
not a SIGKILL of the process that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kit.processes import running
from kit.waits import wait_until
from pitstop.client.cpuload import (
    ENV,
    MAX_PROCS,
    MAX_SECONDS,
    CpuLoad,
    CpuLoadError,
    cpu_load,
    cpu_load_from_env,
    procs_from_env,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpuload.py"


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.parametrize(
    ("procs", "seconds", "message"),
    [
        (-1, 10, "procs -1: give 0 to 64 busy processes"),
        (MAX_PROCS + 1, 10, "procs 65: give 0 to 64"),
        (2, 0, "seconds 0: give more than 0 and at most 7200 (2 h)"),
        (2, MAX_SECONDS + 1, "seconds 7201: give more than 0 and at most 7200"),
    ],
)
def test_bounds(procs: int, seconds: float, message: str) -> None:
    with pytest.raises(CpuLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CpuLoad(procs, seconds)


@pytest.mark.parametrize(("value", "procs"), [(None, 0), ("", 0), (" 0 ", 0), ("2", 2), ("3", 3)])
def test_procs_from_env(value: str | None, procs: int) -> None:
    env = {} if value is None else {ENV: value}
    assert procs_from_env(env) == procs
    assert cpu_load_from_env(env).procs == procs


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("two", "PITSTOP_TEST_CPU_LOAD='two': give the number of busy processes"),
        ("99", "PITSTOP_TEST_CPU_LOAD='99': procs 99: give 0 to 64"),
    ],
)
def test_procs_from_env_names_the_variable(value: str, message: str) -> None:
    with pytest.raises(CpuLoadError, match=message):
        procs_from_env({ENV: value})


def test_a_block_spins_and_stops_its_processes() -> None:
    with cpu_load(procs=2, seconds=60) as load:
        pids = load.pids
        assert len(pids) == 2
        assert load.running() == pids
        before = {pid: cpu_ticks(pid) for pid in pids}
        wait_until(
            lambda: all(cpu_ticks(pid) > before[pid] + 10 for pid in pids),
            "the processes to spin",
            10.0,
            poll=0.02,
        )
    assert not any(running(pid) for pid in pids)
    assert load.running() == []


def test_a_load_ends_when_its_time_is_up() -> None:
    load = CpuLoad(procs=1, seconds=0.3).start()
    try:
        assert load.wait(timeout=15)
        assert load.running() == []
    finally:
        load.stop()


def test_no_procs_is_no_load() -> None:
    with cpu_load_from_env({}) as load:
        assert load.pids == []


def test_the_processes_die_with_a_killed_parent() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pitstop.client.cpuload import CpuLoad\n"
            "load = CpuLoad(2, 60).start()\n"
            "print(*load.pids, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2
        assert all(running(pid) for pid in pids)
        parent.kill()
        parent.wait(timeout=10)
        wait_until(
            lambda: not any(running(pid) for pid in pids),
            "the busy processes to die",
            10.0,
            poll=0.02,
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_script_stops_cleanly_on_a_signal(sig: signal.Signals) -> None:
    script = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--procs", "2", "--seconds", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert script.stdout is not None
        line = script.stdout.readline()
        assert line.startswith("cpuload: 2 busy processes for 60 s (pids "), line
        pids = [int(p) for p in line.split("(pids ")[1].split(")")[0].split(", ")]
        assert all(running(pid) for pid in pids)
        script.send_signal(sig)
        out, err = script.communicate(timeout=20)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
    assert script.returncode == 0, err
    assert "stopped" in out
    assert "Traceback" not in err
    assert not any(running(pid) for pid in pids)


def test_the_script_refuses_more_than_two_hours() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "9000"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "error: --seconds 9000: give more than 0 and at most 7200 (2 h)" in done.stderr


def test_the_script_ends_when_its_time_is_up() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--procs", "1", "--seconds", "0.5"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "cpuload: done after" in done.stdout
    assert os.getpid() > 0
