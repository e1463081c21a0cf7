"""A test run stopped by SIGTERM (a CI timeout, `kill`) tears its fixtures down, so
nothing they started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

HOLDING = """
import subprocess
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def child():
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


def test_holds(child):
    Path("child.pid").write_text(str(child.pid))
    Path("release").touch()
    while True:  # until the run is stopped
        time.sleep(0.2)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_runs_the_teardown_of_every_fixture(tmp_path: Path) -> None:
    (tmp_path / "test_holding.py").write_text(HOLDING)
    inner = ["-q", "-p", "conftest", "-p", "no:cacheprovider", "-c", os.devnull]
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", *inner, "--rootdir", str(tmp_path), "test_holding.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    child = 0
    try:
        deadline = time.monotonic() + 120  # a hang guard: collecting takes seconds
        while not (tmp_path / "release").exists():
            assert run.poll() is None, run.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the inner test never started"
            time.sleep(0.05)
        child = int((tmp_path / "child.pid").read_text())
        assert alive(child)
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0].decode()
        outlived = alive(child)
    finally:
        run.kill()
        if child and alive(child):  # this test leaves nothing behind either
            os.kill(child, signal.SIGKILL)
    assert "KeyboardInterrupt" in output, output[-3000:]
    assert not outlived, output[-3000:]
