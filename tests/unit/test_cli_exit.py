"""The `pitstop` console script ends its process itself once a command is done (no
interpreter teardown, where gRPC's core can hang): what the command printed still
arrives whole, and the exit code is the command's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PITSTOP = Path(sys.executable).parent / "pitstop"

pytestmark = pytest.mark.skipif(not PITSTOP.exists(), reason="the pitstop script is not installed")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PITSTOP), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_command_that_succeeds_exits_0_with_all_of_its_output() -> None:
    done = run("job", "submit", "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: pitstop job submit" in done.stdout
    assert done.stdout.rstrip().endswith("╯")  # the help's last box line: nothing cut off


def test_a_failed_call_exits_1_with_its_one_line_error() -> None:
    done = run("--server", "127.0.0.1:1", "--timeout", "0.5", "job", "list")
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot reach the pitstop scheduler at 127.0.0.1:1")
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_usage_error_keeps_its_exit_code() -> None:
    done = run("job", "show")
    assert done.returncode == 2
    assert "Missing argument" in done.stderr
