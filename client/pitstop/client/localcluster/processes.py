"""Processes by pid, without psutil (not a client dependency): Linux /proc where it is.
Finding a cluster's ranks (by their agent's socket), its daemons and whatever they
started (by `CLUSTER_ENV`), a killed scheduler's embedded stores (by their working
directory); signalling and waiting for them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pitstop.client.localcluster.settings import CLUSTER_ENV, DAEMON_ENV

POLL = 0.05
"""Seconds between looks while waiting for processes."""
# What the embedded stores of a scheduler run as; found by their working directory.
_STORE_COMMANDS = {"postgres": signal.SIGINT, "redis-server": signal.SIGTERM}


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process; None without /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def start_ticks(pid: int) -> int | None:
    """When a process started (clock ticks since boot); None without /proc."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def pid_alive(pid: int, ticks: int | None = None) -> bool:
    """Whether `pid` runs (not a zombie) and, when `ticks` is given, started then."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, started = stat
    if state in ("Z", "X"):
        return False
    return ticks is None or started == ticks


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def signal_rank(pid: int, sig: signal.Signals) -> None:
    """A rank leads its own session: signal its group; anything else only itself."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        pgid = os.getpgid(pid)
        if pgid == pid and pgid != os.getpgrp():
            os.killpg(pgid, sig)
        elif pid != os.getpid():
            os.kill(pid, sig)


def proc_pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdecimal()]
    except OSError:
        return []


FORK_SERVER_DIR_ENV = "PITSTOP_FORK_SERVER_DIR"
"""A process forked by an agent's fork server shows the server's environment in /proc,
which names this folder; the server keeps the process's own there as `<pid>.env`."""


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with ({} when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    forked = env.get(FORK_SERVER_DIR_ENV, "")
    if forked:
        with contextlib.suppress(OSError, ValueError):
            own = json.loads(Path(forked, f"{pid}.env").read_text())
            if isinstance(own, dict):
                return {str(k): str(v) for k, v in own.items()}
    return env


def rank_pids(sockets: Mapping[str, str]) -> dict[str, list[int]]:
    """Live rank processes (and what they forked) by node id: every process whose
    environment carries the PITSTOP_AGENT_SOCKET of one of `sockets` (node id -> path)."""
    by_socket = {path: node_id for node_id, path in sockets.items() if path}
    found: dict[str, list[int]] = {node_id: [] for node_id in sockets}
    me = os.getpid()
    for pid in proc_pids():
        if pid == me:
            continue
        node_id = by_socket.get(environ(pid).get("PITSTOP_AGENT_SOCKET", ""))
        if node_id is not None and pid_alive(pid):
            found[node_id].append(pid)
    return found


@dataclass(frozen=True)
class TaggedProcess:
    """A live process whose environment names a cluster's state dir (`CLUSTER_ENV`): a
    daemon the cluster started, or something a daemon started."""

    pid: int
    daemon: str
    """The `DAEMON_ENV` it carries: the daemon it is, or the one that started it."""
    argv: tuple[str, ...]
    rank: bool
    """It carries an agent's PITSTOP_AGENT_SOCKET: a rank (or standby) an agent started."""
    session_leader: bool

    def is_daemon(self) -> bool:
        """Whether it is the daemon `daemon` names, not something that daemon started:
        not a rank, and running that daemon's console script."""
        kind = self.daemon.split("-", 1)[0]
        script = f"pitstop-{kind}"
        return not self.rank and any(Path(arg).name == script for arg in self.argv[:8])


RANK_LOG = re.compile(r"^rank-\d+\.log$")
"""The log an agent gives a rank's output (a standby's is standby-gpuN.log until it is
handed a rank: then the file is renamed to its rank's)."""


def holding_a_rank(pids: Iterable[int]) -> list[int]:
    """Of rank processes (see `rank_pids`), those that hold a rank now: each leads its own
    session and writes to a rank's log. A standby waiting beside the ranks writes to its
    own, and what a rank forked does not lead a session."""
    found = []
    for pid in pids:
        try:
            stdout = os.readlink(f"/proc/{pid}/fd/1")
            leader = os.getsid(pid) == pid
        except OSError:
            continue
        if leader and RANK_LOG.match(Path(stdout).name):
            found.append(pid)
    return found


def tagged_processes(state_dir: Path) -> list[TaggedProcess]:
    """Every live process started by the cluster in `state_dir` or by one of its daemons,
    whether cluster.json names it or not (found by `CLUSTER_ENV` in /proc/<pid>/environ;
    only processes of this user are readable, and those are the ones a cluster starts)."""
    root = str(state_dir)
    me = os.getpid()
    found = []
    for pid in proc_pids():
        if pid == me:
            continue
        env = environ(pid)
        if env.get(CLUSTER_ENV) != root or not pid_alive(pid):
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            leader = os.getsid(pid) == pid
        except OSError:
            continue
        found.append(
            TaggedProcess(
                pid=pid,
                daemon=env.get(DAEMON_ENV, ""),
                argv=tuple(arg.decode(errors="replace") for arg in argv if arg),
                rank="PITSTOP_AGENT_SOCKET" in env,
                session_leader=leader,
            )
        )
    return found


def store_processes(scheduler_dir: Path) -> list[tuple[int, signal.Signals]]:
    """Embedded PostgreSQL and Redis servers left behind by a killed scheduler: the
    top processes named postgres or redis-server working in its state dir."""
    root = str(scheduler_dir)
    found: dict[int, tuple[int, signal.Signals]] = {}
    for pid in proc_pids():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm not in _STORE_COMMANDS:
                continue
            cwd = os.readlink(f"/proc/{pid}/cwd")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + os.sep):
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            found[pid] = (ppid, _STORE_COMMANDS[comm])
    return [(pid, sig) for pid, (ppid, sig) in found.items() if ppid not in found]


def wait_gone(pids: Iterable[int], timeout: float, alive: Callable[[int], bool]) -> list[int]:
    """Wait until none of `pids` is alive or `timeout` passes; those still alive."""
    deadline = time.monotonic() + timeout
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(POLL)
        left = [pid for pid in left if alive(pid)]
    return left
