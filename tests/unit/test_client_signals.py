"""`pitstop.client.signals`: SIGTERM runs a program's ``finally`` blocks (a second
signal does not cut them short), and a child started through `dying_with_parent` dies
with a parent killed by SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit.processes import running
from pitstop.client.signals import Terminated, exit_code, orderly_exit

PROGRAM = """\
import os, signal, sys, time
from pitstop.client.signals import Terminated, orderly_exit
with orderly_exit():
    try:
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            print("cleanup", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal, during the cleanup
            time.sleep(0.2)
            print("cleanup done", flush=True)
    except Terminated as stop:
        sys.exit(stop.exit_code)
"""


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, -2)]
)
def test_a_signal_runs_the_cleanup_to_its_end(sig: signal.Signals, code: int) -> None:
    program = subprocess.Popen(
        [sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert program.stdout is not None
        assert program.stdout.readline() == "ready\n"
        program.send_signal(sig)
        out, err = program.communicate(timeout=20)
    finally:
        if program.poll() is None:
            program.kill()
            program.wait()
    assert out == "cleanup\ncleanup done\n"
    assert f"SIGTERM again: still shutting down after {sig.name}" in err
    # SIGINT is a KeyboardInterrupt the program does not catch: Python dies by SIGINT.
    assert program.returncode == code
    assert ("KeyboardInterrupt" in err) == (sig == signal.SIGINT)


def test_handlers_come_back_after_the_block() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with orderly_exit():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_exit_codes() -> None:
    assert exit_code(Terminated(signal.SIGTERM)) == 143
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_code(RuntimeError()) == 1
    assert str(Terminated(signal.SIGHUP)) == "stopped by SIGHUP"


def test_a_child_dies_with_its_killed_parent() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time\n"
            "from pitstop.client.signals import dying_with_parent\n"
            "child = subprocess.Popen(dying_with_parent(['sleep', '60']))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        # The wrapper execs the command: the same pid, now `sleep`.
        while Path(f"/proc/{child}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        parent.kill()
        parent.wait(timeout=10)
        while running(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.02)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
