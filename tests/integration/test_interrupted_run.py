"""A test run stopped by SIGTERM (a CI timeout, `kill`) tears its fixtures down, so
nothing they started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit.processes import running

TESTS = Path(__file__).resolve().parents[1]

HOLDING = """
import os
import subprocess
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def child():
    process = subprocess.Popen(["sleep", "600"])
    yield process
    time.sleep(float(os.environ["TEARDOWN_S"]))  # a teardown that takes its time
    process.kill()
    process.wait()


def test_holds(child):
    Path("child.pid").write_text(str(child.pid))
    Path("release").touch()
    while True:  # until the run is stopped
        time.sleep(0.2)
"""


# `make test` runs most of the suite on two pytest-xdist workers, where the signal reaches
# the controller and the fixtures live in the workers; xdist's own shutdown would kill a
# worker 10 s on, in the middle of that 8 s teardown, which it starts only after 5 s.
@pytest.mark.parametrize(
    ("workers", "teardown_s"), [([], 0), (["-n", "2"], 8)], ids=["one-process", "xdist"]
)
def test_sigterm_runs_the_teardown_of_every_fixture(
    tmp_path: Path, workers: list[str], teardown_s: int
) -> None:
    (tmp_path / "test_holding.py").write_text(HOLDING)
    inner = ["-q", *workers, "-p", "conftest", "-p", "no:cacheprovider", "-c", os.devnull]
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", *inner, "--rootdir", str(tmp_path), "test_holding.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS), "TEARDOWN_S": str(teardown_s)},
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
        assert running(child)
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=60)[0].decode()
        outlived = running(child)
    finally:
        run.kill()
        if child and running(child):  # this test leaves nothing behind either
            os.kill(child, signal.SIGKILL)
    assert run.returncode == pytest.ExitCode.INTERRUPTED, output[-3000:]
    assert "keyboard" in output.lower(), output[-3000:]
    assert not outlived, output[-3000:]
