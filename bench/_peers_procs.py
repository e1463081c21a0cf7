"""bench/peers.py's processes: the workers a peer's run starts, their log lines read as
they come (steps, final hashes), and the run's constants."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from bench._peers_costs import bury
from pitstop.client.launch import clean_env
from pitstop.client.signals import dying_with_parent

BIN = Path(sys.executable).parent
TORCHFT_TRAIN = Path(__file__).with_name("torchft_train.py")
# The lighthouse as torchft's README and its SLURM example start it (`--min_replicas 1
# --quorum_tick_ms 100 --join_timeout_ms 10000`); its heartbeat timeout is its default,
# said here because it sets torchft's detection time: a replica whose heartbeat is this
# late is dead, and only then may the survivors form a quorum.
HEARTBEAT_TIMEOUT_MS = 5000
JOIN_TIMEOUT_MS = 10000
QUORUM_TICK_MS = 100
LIGHTHOUSE_SOURCE = "torchft README.md, torchft/examples/slurm/README.md"
WAIT_SECONDS = 300.0  # for any one thing the run must do (a step, a restart)
STOP_SECONDS = 10.0


def say_on_stderr(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# Processes and their output ------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One JSON line a process printed, when it was read and which process printed it."""

    at: float
    source: int  # the index of the process in Processes.started
    fields: dict[str, Any]


class Processes:
    """Every process a run starts, each dying with this one and in a session of its own;
    their JSON stdout lines gathered, stamped, in one list. `stop()` kills them all."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.started: list[subprocess.Popen[str]] = []
        self.lines: list[Line] = []
        self._cond = threading.Condition()
        self._readers: dict[int, threading.Thread] = {}

    def start(self, argv: list[str], log: Path, *, follow: bool = True) -> int:
        """Start `argv` (stderr to `log`); its index in `started`."""
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                dying_with_parent(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if follow else subprocess.DEVNULL,
                stderr=stderr,
                text=True,
                env=self.env,
                start_new_session=True,
            )
        self.started.append(proc)
        source = len(self.started) - 1
        if follow:
            reader = threading.Thread(target=self._read, args=(proc.stdout, source), daemon=True)
            reader.start()
            self._readers[source] = reader
        return source

    def exited(self, source: int) -> int:
        """Wait for the process at `source` to end and its output to be read; its exit
        code (subprocess.TimeoutExpired after WAIT_SECONDS)."""
        code = self.started[source].wait(timeout=WAIT_SECONDS)
        if source in self._readers:
            self._readers[source].join(timeout=STOP_SECONDS)
        return code

    def _read(self, stream: IO[str], source: int) -> None:
        for text in stream:
            try:
                fields = json.loads(text)
            except ValueError:
                continue
            if isinstance(fields, dict):
                with self._cond:
                    self.lines.append(Line(time.time(), source, fields))
                    self._cond.notify_all()

    def count(self) -> int:
        with self._cond:
            return len(self.lines)

    def wait(self, accept: Callable[[Line], bool], what: str, start: int = 0) -> Line:
        """The first line from index `start` on that `accept` takes, waiting up to
        WAIT_SECONDS for it (RuntimeError naming `what` when it does not come)."""
        deadline = time.monotonic() + WAIT_SECONDS
        seen = start
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if accept(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{what}: not seen within {WAIT_SECONDS:.0f} s")
                self._cond.wait(left)

    def between(self, start: float, end: float = float("inf")) -> list[Line]:
        """The lines read from `start` to `end` (wall times)."""
        with self._cond:
            return [line for line in self.lines if start <= line.at <= end]

    def stop(self) -> None:
        """Kill every process still running, with its whole session and every process
        under it (a launcher's workers lead sessions of their own; a frozen one is
        killed too); reap them."""
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    bury([child.pid for child in psutil.Process(proc.pid).children(True)])
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_SECONDS)


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    procs = Processes(clean_env(PYTHONUNBUFFERED="1"))
    try:
        yield procs
    finally:
        procs.stop()


def step_line(
    *,
    above: int = 0,
    sources: Collection[int] | None = None,
    quorum_after: float = 0.0,
    read_after: float = 0.0,
    rank: int | None = None,
) -> Callable[[Line], bool]:
    """A test for a line saying a step was taken: a step over `above`, printed by one of
    `sources` (None: any) or by `rank`, of a quorum ready after `quorum_after` (torchft's
    lines say when), read after `read_after`."""

    def accept(line: Line) -> bool:
        fields = line.fields
        return (
            fields.get("step", -1) > above
            and (sources is None or line.source in sources)
            and (rank is None or fields.get("rank") == rank)
            and fields.get("quorum_at", math.inf) > quorum_after
            and line.at > read_after
        )

    return accept


def has_key(key: str) -> Callable[[Line], bool]:
    return lambda line: key in line.fields


def finished(procs: Processes, sources: list[int], what: str) -> None:
    """Wait for the processes at `sources` to exit 0 (RuntimeError else)."""
    for source in sources:
        code = procs.exited(source)
        if code != 0:
            raise RuntimeError(f"{what} (pid {procs.started[source].pid}) exited {code}")


def broke_down(
    name: str,
    exc: Exception,
    rows: list[dict[str, Any]],
    failures: int,
    started: float,
    config: dict[str, Any],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """A peer's run that broke down (a process exited, a step never came): the failures
    it completed and why it stopped, for the caller to report and go on."""
    say(f"{name}: {exc}; {len(rows)} of {failures} failures completed")
    return {
        "failures": rows,
        "seconds": time.monotonic() - started,
        "error": str(exc),
        "config": config,
    }


def final_hashes(procs: Processes, sources: dict[int, int]) -> dict[int, str]:
    """rank -> the final weights' hash printed by its process at `sources[rank]`."""
    return {
        rank: str(line.fields["final_weights_sha256"])
        for line in procs.between(0)
        for rank, source in sources.items()
        if line.source == source and "final_weights_sha256" in line.fields
    }


def hash_note(hashes: dict[int, str], workers: int) -> str:
    if len(hashes) < workers:
        return f"only ranks {sorted(hashes)} of {workers} printed a final hash"
    if len(set(hashes.values())) > 1:
        return f"the ranks ended with different weights: {hashes}"
    return f"all {workers} ended with the same weights"
