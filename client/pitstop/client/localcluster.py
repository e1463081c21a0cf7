"""A local pitstop cluster on this machine: one scheduler, and a checkpoint daemon and an
agent (simulated GPUs) per node, each a detached process with its log in the state dir.

The daemons are started through their console scripts, never imported, so this module
keeps to the client's side of the wire. Everything needed to find the processes again
(pids, logs, addresses) is written to ``<state dir>/cluster.json``: ``pitstop cluster
status`` and ``down`` run in a later process than ``up``.

>>> from pitstop.client.localcluster import LocalCluster
>>> with LocalCluster.up("/tmp/pc", nodes=2, spares=1, port=0) as cluster:  # doctest: +SKIP
...     cluster.kill_node("node-1")
...     cluster.restart_node("node-1")
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, cast

from pitstop.client.client import PitstopClient
from pitstop.client.errors import PitstopError
from pitstop.client.netns import IFACE, NetnsError, Network, check_supported
from pitstop.client.netns import create as create_network
from pitstop.client.netns import destroy as destroy_network
from pitstop.v1 import common_pb2, nodes_pb2

Kind = Literal["scheduler", "checkpointd", "agent"]
Role = Literal["worker", "spare"]
Progress = Callable[[str], None]
_T = TypeVar("_T")

DEFAULT_STATE_DIR = Path(".state/cluster")
DEFAULT_PORT = 50051
DEFAULT_TIMEOUT = 120.0
"""Seconds `up` (and `restart_node`) waits for every node to be ready."""
STOP_TIMEOUT = 20.0
"""Seconds each stage of `down` waits after SIGTERM before SIGKILL."""
KILL_WAIT = 10.0
"""Seconds to wait for processes to vanish after SIGKILL."""
LOCK_WAIT = 60.0
"""Seconds `down` waits for another command (an `up`, a node starting) to let go of the
state dir."""
STATE_FILE = "cluster.json"
LOCK_FILE = "cluster.lock"
CHECKPOINTD_MEMORY_BUDGET_BYTES = 256 << 20
HEARTBEAT_INTERVAL = 0.5
"""Seconds between an agent's heartbeats in the local cluster."""
DEFAULT_LIVENESS_TIMEOUT = 4.0
"""Seconds without a heartbeat before the scheduler declares a node lost. Only a hung
agent (stopped, its stream open) waits for it: a dead agent's stream breaks and its node
is lost at once. 1.25 s (2.5 beats) declared healthy nodes lost while two busy processes
shared a 2-core machine with the cluster; 8 beats leave room for such stalls."""
CLUSTER_ENV = "PITSTOP_LOCAL_CLUSTER"
"""In every daemon's environment: the cluster's state dir. What a daemon starts (ranks,
embedded stores) inherits it, so `down` finds every process the cluster started, even
one that cluster.json does not name (an `up` killed between starting it and writing)."""
DAEMON_ENV = "PITSTOP_LOCAL_CLUSTER_DAEMON"
"""In every daemon's environment: its name, e.g. ``agent-node-1``."""

# Settings the daemons read from the environment, for a small, quick local cluster.
# Variables already in the environment win (the liveness deadline: unless `up` is given
# one).
_HEARTBEAT_ENV = "PITSTOP_HEARTBEAT_INTERVAL_SECONDS"
_LIVENESS_ENV = "PITSTOP_LIVENESS_TIMEOUT_INTERVALS"
SCHEDULER_ENV = {
    _HEARTBEAT_ENV: f"{HEARTBEAT_INTERVAL:g}",
    _LIVENESS_ENV: f"{DEFAULT_LIVENESS_TIMEOUT / HEARTBEAT_INTERVAL:g}",
    "PITSTOP_LIVENESS_STARTUP_GRACE_SECONDS": "0",
}
_MIN_LIVENESS_INTERVALS = 1.5  # the scheduler's own floor
CHECKPOINTD_ENV = {
    "PITSTOP_CHECKPOINTD_MEMORY_BUDGET_BYTES": str(CHECKPOINTD_MEMORY_BUDGET_BYTES),
    "PITSTOP_CHECKPOINTD_RETRY_MAX_SECONDS": "0.5",
}

# The line each daemon prints once it serves (only at the start of a line: a traceback
# quoting the print call must not match).
_SCHEDULER_LINE = re.compile(r"^pitstop-scheduler listening on (\S+:\d+)\s*$")
_CHECKPOINTD_LINE = re.compile(r"^pitstop-checkpointd \S+ listening on (\S+:\d+)\s")
_POLL = 0.05
_READY_POLL = 0.2
_TAIL_LINES = 20
# AF_UNIX paths hold 108 bytes with the terminating NUL.
_MAX_SOCKET_PATH = 100
_UP_STATES = (
    common_pb2.NODE_STATE_READY,
    common_pb2.NODE_STATE_CORDONED,
    common_pb2.NODE_STATE_DRAINING,
)
# What the embedded stores of a scheduler run as; found by their working directory.
_STORE_COMMANDS = {"postgres": signal.SIGINT, "redis-server": signal.SIGTERM}
_OWN_ENTRIES = {STATE_FILE, STATE_FILE + ".tmp", LOCK_FILE, "logs", "scheduler", "nodes", "durable"}


class ClusterError(Exception):
    """Something about the local cluster went wrong; the message says what to do."""


class ClusterAlreadyRunning(ClusterError):
    """`up` found processes of an earlier `up` still running in the state dir."""


class ClusterStartError(ClusterError):
    """A daemon did not come up; the message ends with the tail of its log."""

    def __init__(self, message: str, log: Path | None = None, offset: int = 0) -> None:
        if log is not None:
            tail = log_tail(log, offset)
            message += (
                f"; its log {log} ends with:\n{tail}" if tail else f"; its log {log} is empty"
            )
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class NodeSpec:
    """One node of the cluster: its id, the role it asks for, its rack and GPU count."""

    node_id: str
    role: Role
    rack: str
    gpus: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "role": self.role, "rack": self.rack, "gpus": self.gpus}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeSpec:
        role = str(data["role"])
        if role not in ("worker", "spare"):
            raise ValueError(f"role {role!r}")
        return cls(str(data["node_id"]), cast(Role, role), str(data["rack"]), int(data["gpus"]))


@dataclass(frozen=True)
class ClusterProcess:
    """One daemon of the cluster, leader of its own process group (and session)."""

    name: str
    """``scheduler``, ``checkpointd-<node>`` or ``agent-<node>``; also names the log."""
    kind: Kind
    pid: int
    log: Path
    node_id: str = ""
    address: str = ""
    """host:port it serves on (scheduler, checkpointd); empty for agents."""
    socket: str = ""
    """The agent's Unix socket for its ranks; empty for the others."""
    start_ticks: int | None = None
    """Start time from /proc (clock ticks since boot), so a reused pid is not mistaken
    for the daemon; None where /proc is missing."""

    def alive(self) -> bool:
        """Whether the daemon still runs (a zombie or a reused pid does not count)."""
        return pid_alive(self.pid, self.start_ticks)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "node_id": self.node_id,
            "pid": self.pid,
            "log": str(self.log),
            "address": self.address,
            "socket": self.socket,
            "start_ticks": self.start_ticks,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClusterProcess:
        kind = str(data["kind"])
        if kind not in ("scheduler", "checkpointd", "agent"):
            raise ValueError(f"kind {kind!r}")
        ticks = data.get("start_ticks")
        return cls(
            name=str(data["name"]),
            kind=cast(Kind, kind),
            pid=int(data["pid"]),
            log=Path(str(data["log"])),
            node_id=str(data.get("node_id") or ""),
            address=str(data.get("address") or ""),
            socket=str(data.get("socket") or ""),
            start_ticks=None if ticks is None else int(ticks),
        )


def node_layout(nodes: int, spares: int, gpus_per_node: int = 1) -> list[NodeSpec]:
    """Workers ``node-1..N`` round-robin over racks ``r1..r⌈N/2⌉``, spares ``spare-1..S``
    round-robin over the same racks from ``r1``: every spare has a worker in its rack."""
    if nodes < 1:
        raise ClusterError(f"--nodes {nodes}: a cluster needs at least one worker node")
    if spares < 0:
        raise ClusterError(f"--spares {spares}: give 0 or more spares")
    if gpus_per_node < 1:
        raise ClusterError(f"--gpus-per-node {gpus_per_node}: give at least 1")
    racks = max(1, math.ceil(nodes / 2))
    specs = [
        NodeSpec(f"node-{i + 1}", "worker", f"r{i % racks + 1}", gpus_per_node)
        for i in range(nodes)
    ]
    specs += [
        NodeSpec(f"spare-{i + 1}", "spare", f"r{i % racks + 1}", gpus_per_node)
        for i in range(spares)
    ]
    return specs


def binary(name: str) -> str:
    """A pitstop console script: next to the running python first, then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ClusterError(
            f"cannot find {name} next to {sys.executable} or on PATH; "
            "install pitstop (pip install pitstop) in this environment"
        )
    return found


def log_tail(path: Path, offset: int = 0, lines: int = _TAIL_LINES) -> str:
    """The last lines of a log after byte `offset`, indented; empty when there are none."""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - 16384, offset, 0))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(f"  {line}" for line in text.rstrip().splitlines()[-lines:])


# Processes, by pid, without psutil (not a client dependency): Linux /proc where it is.


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


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _signal_rank(pid: int, sig: signal.Signals) -> None:
    """A rank leads its own session: signal its group; anything else only itself."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        pgid = os.getpgid(pid)
        if pgid == pid and pgid != os.getpgrp():
            os.killpg(pgid, sig)
        elif pid != os.getpid():
            os.kill(pid, sig)


def _proc_pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdecimal()]
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def rank_pids(sockets: Mapping[str, str]) -> dict[str, list[int]]:
    """Live rank processes (and what they forked) by node id: every process whose
    environment carries the PITSTOP_AGENT_SOCKET of one of `sockets` (node id -> path)."""
    by_socket = {path: node_id for node_id, path in sockets.items() if path}
    found: dict[str, list[int]] = {node_id: [] for node_id in sockets}
    me = os.getpid()
    for pid in _proc_pids():
        if pid == me:
            continue
        node_id = by_socket.get(_environ(pid).get("PITSTOP_AGENT_SOCKET", ""))
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

    def as_cluster_process(self, log_dir: Path) -> ClusterProcess:
        """This daemon as cluster.json would have recorded it."""
        kind, _, node_id = self.daemon.partition("-")
        if kind not in ("scheduler", "checkpointd", "agent"):
            raise ValueError(f"{self.daemon!r} names no daemon")
        return ClusterProcess(
            name=self.daemon,
            kind=cast(Kind, kind),
            pid=self.pid,
            log=log_dir / f"{self.daemon}.log",
            node_id=node_id,
            start_ticks=start_ticks(self.pid),
        )


def tagged_processes(state_dir: Path) -> list[TaggedProcess]:
    """Every live process started by the cluster in `state_dir` or by one of its daemons,
    whether cluster.json names it or not (found by `CLUSTER_ENV` in /proc/<pid>/environ;
    only processes of this user are readable, and those are the ones a cluster starts)."""
    root = str(state_dir)
    me = os.getpid()
    found = []
    for pid in _proc_pids():
        if pid == me:
            continue
        env = _environ(pid)
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


def _store_processes(scheduler_dir: Path) -> list[tuple[int, signal.Signals]]:
    """Embedded PostgreSQL and Redis servers left behind by a killed scheduler: the
    top processes named postgres or redis-server working in its state dir."""
    root = str(scheduler_dir)
    found: dict[int, tuple[int, signal.Signals]] = {}
    for pid in _proc_pids():
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


def _wait_gone(pids: Iterable[int], timeout: float, alive: Callable[[int], bool]) -> list[int]:
    """Wait until none of `pids` is alive or `timeout` passes; those still alive."""
    deadline = time.monotonic() + timeout
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(_POLL)
        left = [pid for pid in left if alive(pid)]
    return left


@contextlib.contextmanager
def _locked(state_dir: Path, wait: float = 0.0) -> Iterator[None]:
    """Hold the state dir's lock, waiting up to `wait` s for it: one `up`, `down` or node
    start at a time, across processes and across the threads of one process (each
    holder opens the file anew, and flock locks conflict between open files)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait
    with (state_dir / LOCK_FILE).open("a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                waited = f" for {wait:.0f} s" if wait else ""
                raise ClusterError(
                    f"another pitstop cluster command is busy with {state_dir}{waited}; "
                    "wait for it to end"
                ) from None
            time.sleep(_POLL)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class _Starting:
    """A daemon just spawned, and where in its log its own output begins."""

    process: ClusterProcess
    popen: subprocess.Popen[bytes]
    offset: int
    what: str


@dataclass
class LocalCluster:
    """A running local cluster: its state dir, scheduler address, nodes and processes.

    Get one from :meth:`up` (starts it) or :meth:`load` (finds one that runs). Use it as
    a context manager to bring it :meth:`down` at the end of the block.
    """

    state_dir: Path
    scheduler_address: str
    nodes: list[NodeSpec]
    processes: list[ClusterProcess] = field(default_factory=list)
    network: Network | None = None
    """With ``--netns``: each node's network namespace behind one bridge."""
    liveness_timeout: float = field(default=DEFAULT_LIVENESS_TIMEOUT, compare=False)
    """Seconds without a heartbeat before the scheduler declares a node lost (what the
    scheduler was started with)."""
    env: dict[str, str] = field(default_factory=dict, compare=False)
    """Extra environment (over os.environ) for every daemon started from this object;
    not recorded in cluster.json, so a loaded cluster starts nodes without it."""
    _children: dict[int, subprocess.Popen[bytes]] = field(
        default_factory=dict, repr=False, compare=False
    )
    """Popen handles of the daemons this object started, to reap them."""
    _offsets: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    """Where in each log the current daemon's output begins."""
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    """Guards `processes` and cluster.json against threads starting nodes beside `down`."""
    _closed: bool = field(default=False, repr=False, compare=False)
    """`down` has begun: this object starts nothing more and writes no cluster.json."""

    # Starting

    @classmethod
    def up(
        cls,
        state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
        *,
        nodes: int = 2,
        spares: int = 1,
        port: int = DEFAULT_PORT,
        database_url: str | None = None,
        redis_url: str | None = None,
        gpus_per_node: int = 1,
        netns: bool = False,
        env: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        liveness_timeout: float | None = None,
        progress: Progress | None = None,
    ) -> Self:
        """Start a scheduler on 127.0.0.1:`port` (0: a free port) with embedded stores
        unless URLs are given, then a checkpointd and an agent for each of `nodes`
        workers and `spares` spares; return once every node is ready in the scheduler.
        With `netns` (root, iproute2) each node runs in a network namespace of its own
        behind a bridge whose address the scheduler listens on, so :meth:`cut` can cut
        one off. `liveness_timeout`: seconds without a heartbeat before a node is lost
        (default: PITSTOP_LIVENESS_TIMEOUT_INTERVALS from the environment, else
        DEFAULT_LIVENESS_TIMEOUT); the one used is in :attr:`liveness_timeout`.

        Raises ClusterAlreadyRunning when an earlier cluster in `state_dir` still runs,
        ClusterStartError when a daemon fails or `timeout` passes; then nothing that
        this call started is left running.
        """
        root = Path(state_dir).expanduser().absolute()
        layout = node_layout(nodes, spares, gpus_per_node)
        if liveness_timeout is not None:
            _check_liveness(liveness_timeout)
        say = progress or (lambda _message: None)
        if netns:
            _checked(check_supported)
        with _locked(root):
            earlier = cls.load(root)
            running = [] if earlier is None else earlier.running()
            recorded = {p.pid for p in running}
            running += [
                t.as_cluster_process(root / "logs")
                for t in tagged_processes(root)
                if t.is_daemon() and t.pid not in recorded
            ]
            if running:
                first = next((p for p in running if p.kind == "scheduler"), running[0])
                raise ClusterAlreadyRunning(
                    f"a cluster is already running in {root} ({first.name} pid {first.pid}); "
                    f"run pitstop cluster down --state-dir {root} first"
                )
            if earlier is not None:
                earlier._reap_leftovers()
                (root / STATE_FILE).unlink(missing_ok=True)
            cluster = cls(root, "", layout, env=dict(env or {}))
            deadline = time.monotonic() + timeout
            try:
                if netns:
                    say(f"creating {len(layout)} network namespaces")
                    cluster.network = _checked(
                        lambda: create_network([spec.node_id for spec in layout])
                    )
                    cluster._save()
                say("starting the scheduler")
                cluster._start_scheduler(port, database_url, redis_url, liveness_timeout, deadline)
                say(f"scheduler at {cluster.scheduler_address}; starting {len(layout)} nodes")
                cluster._start_nodes(layout, deadline)
                cluster.wait_ready(timeout=max(deadline - time.monotonic(), 0.0), progress=say)
            except BaseException:
                say("stopping what was started")
                # A survivor of SIGKILL keeps cluster.json, for `down` to retry; the
                # error that stopped `up` is the one to report.
                with contextlib.suppress(ClusterError):
                    cluster._stop_all(STOP_TIMEOUT)
                    (root / STATE_FILE).unlink(missing_ok=True)
                raise
        return cluster

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR) -> Self | None:
        """The cluster recorded in `state_dir`, running or not; None when none is."""
        root = Path(state_dir).expanduser().absolute()
        try:
            data = json.loads((root / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ClusterError(
                f"cannot read {root / STATE_FILE}: {exc}; stop the daemons by hand and delete it"
            ) from exc
        try:
            return cls(
                root,
                str(data["scheduler_address"]),
                [NodeSpec.from_json(n) for n in data["nodes"]],
                [ClusterProcess.from_json(p) for p in data["processes"]],
                Network.from_json(data["network"]) if data.get("network") else None,
                float(data.get("liveness_timeout_seconds", DEFAULT_LIVENESS_TIMEOUT)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterError(
                f"{root / STATE_FILE} is damaged ({exc!r}); stop the daemons by hand and delete it"
            ) from exc

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    # Looking

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def node(self, node_id: str) -> NodeSpec:
        """The spec of one node; ClusterError when the cluster has no such node."""
        for spec in self.nodes:
            if spec.node_id == node_id:
                return spec
        known = ", ".join(spec.node_id for spec in self.nodes)
        raise ClusterError(f"the cluster has no node {node_id!r}; its nodes are {known}")

    def process(self, name: str) -> ClusterProcess:
        """The process named `name`, e.g. ``scheduler`` or ``agent-node-1``."""
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise ClusterError(f"the cluster has no process {name!r}")

    def node_processes(self, node_id: str) -> list[ClusterProcess]:
        """The node's agent and checkpointd, agent first."""
        self.node(node_id)
        return [
            p
            for kind in ("agent", "checkpointd")
            for p in self.processes
            if p.node_id == node_id and p.kind == kind
        ]

    def is_alive(self, proc: ClusterProcess) -> bool:
        """Whether `proc` runs; reaps it when this object started it."""
        child = self._children.get(proc.pid)
        if child is not None:
            return child.poll() is None
        return proc.alive()

    def running(self) -> list[ClusterProcess]:
        """The processes alive now."""
        return [p for p in self.processes if self.is_alive(p)]

    def client(self, timeout: float = 10.0) -> PitstopClient:
        """A client for the cluster's scheduler; use it in a ``with`` block."""
        return PitstopClient(self.scheduler_address, timeout=timeout)

    def list_nodes(self, timeout: float = 5.0) -> list[nodes_pb2.Node]:
        """The scheduler's nodes (PitstopError when it cannot be reached)."""
        with PitstopClient(self.scheduler_address, timeout=timeout, max_attempts=1) as client:
            return client.list_nodes()

    def rank_pids(self, node_id: str) -> list[int]:
        """Live rank processes the node's agent started (each leads its own session)."""
        sockets = {p.node_id: p.socket for p in self.processes if p.kind == "agent"}
        if node_id not in sockets:
            self.node(node_id)
            return []
        return rank_pids({node_id: sockets[node_id]})[node_id]

    def wait_ready(
        self,
        node_ids: Iterable[str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        progress: Progress | None = None,
    ) -> list[nodes_pb2.Node]:
        """Wait until each node (all by default) is connected to the scheduler from its
        current agent (the inventory names its current checkpointd) and ready, and
        return them. ClusterStartError when a daemon exits or `timeout` passes."""
        wanted = (
            [self.node(n).node_id for n in node_ids]
            if node_ids is not None
            else [spec.node_id for spec in self.nodes]
        )
        addresses = {p.node_id: p.address for p in self.processes if p.kind == "checkpointd"}
        deadline = time.monotonic() + timeout
        seen: dict[str, nodes_pb2.Node] = {}
        last_error = ""
        shown = ""
        with PitstopClient(self.scheduler_address, timeout=2.0, max_attempts=1) as client:
            while True:
                self._check_alive(wanted)
                try:
                    seen = {n.id: n for n in client.list_nodes() if n.id in wanted}
                    last_error = ""
                except PitstopError as exc:
                    last_error = str(exc)
                ready = [n for n in wanted if n in seen and _is_up(seen[n], addresses.get(n, ""))]
                if len(ready) == len(wanted):
                    return [seen[n] for n in wanted]
                if progress is not None:
                    pending = [n for n in wanted if n not in ready]
                    line = (
                        f"{len(ready)}/{len(wanted)} nodes ready; waiting for {', '.join(pending)}"
                    )
                    if line != shown:
                        progress(line)
                        shown = line
                if time.monotonic() >= deadline:
                    raise ClusterStartError(
                        self._not_ready(wanted, seen, addresses, timeout, last_error)
                    )
                time.sleep(_READY_POLL)

    # Faults

    def kill_node(
        self, node_id: str, sig: signal.Signals = signal.SIGKILL, *, wait: bool = True
    ) -> list[int]:
        """Signal the node's agent, its checkpointd and its ranks (each a process group
        of its own), as a dying host would; return the pids signalled. With `wait`,
        return only once they are gone (ClusterError if they outlive KILL_WAIT s after
        SIGKILL; after another signal, wait for them to exit on their own)."""
        ranks = self.rank_pids(node_id)
        daemons = [p for p in self.node_processes(node_id) if self.is_alive(p)]
        for proc in daemons:
            _signal_group(proc.pid, sig)
        for pid in ranks:
            _signal_rank(pid, sig)
        pids = [p.pid for p in daemons] + ranks
        if wait:
            limit = KILL_WAIT if sig == signal.SIGKILL else STOP_TIMEOUT
            left = _wait_gone(pids, limit, self._pid_alive)
            if left:
                raise ClusterError(
                    f"node {node_id}: pids {', '.join(map(str, left))} outlived "
                    f"{sig.name} by {limit:.0f} s"
                )
        return pids

    def cut(self, node_id: str) -> None:
        """Cut the node off the network, its processes alive (needs ``--netns``)."""
        _checked(lambda: self._network().cut(self.node(node_id).node_id))

    def heal(self, node_id: str) -> None:
        """Bring a node that was cut off back onto the network."""
        _checked(lambda: self._network().heal(self.node(node_id).node_id))

    def cut_off(self) -> list[str]:
        """The nodes cut off now (none without ``--netns``)."""
        network = self.network
        if network is None:
            return []
        return [link.node_id for link in network.links if network.is_cut(link.node_id)]

    def _network(self) -> Network:
        if self.network is None:
            raise ClusterError(
                f"the cluster in {self.state_dir} runs without network namespaces; "
                "bring it up with pitstop cluster up --netns (as root) to cut nodes off"
            )
        return self.network

    def restart_node(
        self, node_id: str, *, wait: bool = True, timeout: float = DEFAULT_TIMEOUT
    ) -> list[ClusterProcess]:
        """Start a fresh checkpointd and agent for `node_id` (stopping whatever of the
        node still runs first, SIGTERM then SIGKILL); with `wait`, return once the
        scheduler sees the node ready from the new agent. Returns the new processes."""
        old = self.node_processes(node_id)
        stopping = self.kill_node(node_id, signal.SIGTERM, wait=False)
        if _wait_gone(stopping, STOP_TIMEOUT, self._pid_alive):
            self.kill_node(node_id, signal.SIGKILL)
        self._forget_children([p.pid for p in old])
        return self.start_node(node_id, wait=wait, timeout=timeout)

    def start_node(
        self, node_id: str, *, wait: bool = True, timeout: float = DEFAULT_TIMEOUT
    ) -> list[ClusterProcess]:
        """Start the checkpointd and agent of `node_id`, whose daemons are not running;
        with `wait`, return once the scheduler sees the node ready from the new agent.
        Returns the new processes. ClusterError when one of its daemons runs (never two
        of a node: :meth:`restart_node` stops them first) or the cluster is down."""
        spec = self.node(node_id)
        deadline = time.monotonic() + timeout
        with _locked(self.state_dir, wait=timeout):
            if self._closed or not self.state_file.exists():
                raise ClusterError(
                    f"the cluster in {self.state_dir} is down; {node_id} is not started"
                )
            before = {p.pid for p in self.node_processes(node_id)}
            try:
                new = self._start_nodes([spec], deadline)
            except BaseException:
                self._stop_processes(
                    [p for p in self.node_processes(node_id) if p.pid not in before]
                )
                raise
        if wait:
            self.wait_ready([node_id], timeout=max(deadline - time.monotonic(), 0.0))
        return new

    # Stopping

    def down(self, *, timeout: float = STOP_TIMEOUT, wipe: bool = False) -> list[ClusterProcess]:
        """Stop the agents, then the checkpoint daemons, then the scheduler: SIGTERM
        to each process group, SIGKILL after `timeout` s. Ranks left behind and the
        scheduler's embedded stores go too, and so does any process the cluster started
        that cluster.json does not name (found by `CLUSTER_ENV`). From then on this object
        starts nothing (a thread restarting a node is refused). Removes cluster.json, and
        with `wipe` the whole state dir. Returns the daemons that were running, recorded
        or not. ClusterError when a process survives SIGKILL (cluster.json is kept then)."""
        with self._lock:
            self._closed = True
        with _locked(self.state_dir, wait=LOCK_WAIT):
            was_running = self.running()
            strays = self._stop_all(timeout)
            self.state_file.unlink(missing_ok=True)
        if wipe:
            wipe_state_dir(self.state_dir)
        return was_running + strays

    def _stop_all(self, timeout: float) -> list[ClusterProcess]:
        """Stop every recorded process, stage by stage, then the unrecorded ones; returns
        the unrecorded daemons that were found."""
        sockets = {p.node_id: p.socket for p in self.processes if p.kind == "agent"}
        ranks = [pid for pids in rank_pids(sockets).values() for pid in pids]
        killed_checkpointds: list[ClusterProcess] = []
        for kind in ("agent", "checkpointd", "scheduler"):
            stage = [p for p in self.processes if p.kind == kind]
            dead_before = [p for p in stage if not self.is_alive(p)]
            killed = self._stop_processes(stage, timeout)
            if kind == "agent":
                for pid in ranks:
                    _signal_rank(pid, signal.SIGKILL)
                ranks = _wait_gone(ranks, KILL_WAIT, self._pid_alive)
            if kind == "checkpointd":
                killed_checkpointds = dead_before + killed
            if kind == "scheduler":
                self._stop_stores(timeout)
        strays = self._stop_strays(timeout)
        self._cleanup_segments(killed_checkpointds + [p for p in strays if p.kind == "checkpointd"])
        left = [p for p in self.processes if self.is_alive(p)]
        if left or ranks:
            names = [f"{p.name} (pid {p.pid})" for p in left] + [f"rank pid {r}" for r in ranks]
            raise ClusterError(
                f"{', '.join(names)} survived SIGKILL (stuck in the kernel?); "
                f"{self.state_file} is kept"
            )
        self._forget_children(list(self._children))
        self._remove_network()
        return strays

    def _stop_strays(self, timeout: float) -> list[ClusterProcess]:
        """Whatever still runs with this cluster's `CLUSTER_ENV`: a daemon cluster.json
        does not name, and what it started. Session leaders (daemons, ranks) get SIGTERM
        to their group first, SIGKILL after `timeout`; returns the daemons among them."""
        found = tagged_processes(self.state_dir)
        if not found:
            return []
        strays = [t.as_cluster_process(self.log_dir) for t in found if t.is_daemon()]
        leaders = [t.pid for t in found if t.session_leader]
        for pid in leaders:
            _signal_group(pid, signal.SIGTERM)
        _wait_gone(leaders, timeout, pid_alive)
        left = tagged_processes(self.state_dir)
        for tagged in left:
            if tagged.session_leader:
                _signal_group(tagged.pid, signal.SIGKILL)
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(tagged.pid, signal.SIGKILL)
        still = _wait_gone([t.pid for t in left], KILL_WAIT, pid_alive)
        if still:
            raise ClusterError(
                f"pids {', '.join(map(str, still))} of the cluster in {self.state_dir} "
                "survived SIGKILL (stuck in the kernel?)"
            )
        if strays:  # an unrecorded scheduler may have left its embedded stores
            self._stop_stores(timeout)
        return strays

    def _remove_network(self) -> None:
        """Remove the namespaces and the bridge (once nothing runs in them)."""
        if self.network is None:
            return
        problems = destroy_network(self.network)
        if problems:
            raise ClusterError(
                f"could not remove the cluster's network namespaces: {'; '.join(problems)}; "
                f"{self.state_file} is kept, run pitstop cluster down again"
            )

    def _stop_processes(
        self, procs: Sequence[ClusterProcess], timeout: float = STOP_TIMEOUT
    ) -> list[ClusterProcess]:
        """SIGTERM each running process's group, SIGKILL after `timeout`; returns the
        processes that needed SIGKILL."""
        running = [p for p in procs if self.is_alive(p)]
        for proc in running:
            _signal_group(proc.pid, signal.SIGTERM)
        left = set(_wait_gone([p.pid for p in running], timeout, self._pid_alive))
        killed = [p for p in running if p.pid in left]
        for proc in killed:
            _signal_group(proc.pid, signal.SIGKILL)
        _wait_gone([p.pid for p in killed], KILL_WAIT, self._pid_alive)
        return killed

    def _stop_stores(self, timeout: float) -> None:
        """Embedded PostgreSQL and Redis of a scheduler that did not stop them (it was
        killed): they run in sessions of their own, outside its process group."""
        stores = _store_processes(self.state_dir / "scheduler")
        for pid, sig in stores:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        left = _wait_gone([pid for pid, _ in stores], timeout, pid_alive)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _cleanup_segments(self, procs: Sequence[ClusterProcess]) -> None:
        """Shared-memory segments a killed checkpointd left in /dev/shm (a daemon that
        stops on SIGTERM removes its own)."""
        for proc in procs:
            with contextlib.suppress(OSError, subprocess.SubprocessError, ClusterError):
                subprocess.run(
                    [binary("pitstop-checkpointd"), "cleanup", "--node-id", proc.node_id],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=30,
                    check=False,
                )

    def _reap_leftovers(self) -> None:
        """After a cluster whose daemons are all gone (killed, host rebooted): its ranks
        and embedded stores, if anything of them is left."""
        sockets = {p.node_id: p.socket for p in self.processes if p.kind == "agent"}
        for pids in rank_pids(sockets).values():
            for pid in pids:
                _signal_rank(pid, signal.SIGKILL)
        self._stop_stores(KILL_WAIT)
        self._stop_strays(KILL_WAIT)
        self._remove_network()

    # Spawning

    def _daemon_env(self, extra: Mapping[str, str], name: str) -> dict[str, str]:
        env = dict(os.environ)
        # A daemon that dies at start leaves a plain traceback, whose last lines (the
        # ones `up` shows) name the error, rather than a boxed one.
        env.setdefault("_TYPER_STANDARD_TRACEBACK", "1")
        # Jobs say `python`: let it be this environment's, where pitstop is installed.
        here = str(Path(sys.executable).parent)
        path = env.get("PATH", os.defpath)
        if path.split(os.pathsep)[0] != here:
            env["PATH"] = here + os.pathsep + path
        env.update(self.env)
        for key, value in extra.items():
            env.setdefault(key, value)
        env[CLUSTER_ENV] = str(self.state_dir)
        env[DAEMON_ENV] = name
        return env

    def _spawn(
        self,
        name: str,
        kind: Kind,
        argv: Sequence[str],
        env: Mapping[str, str],
        what: str,
        *,
        node_id: str = "",
        socket: str = "",
    ) -> _Starting:
        """Start a daemon detached: its own session, stdin from /dev/null, stdout and
        stderr appended to logs/<name>.log; record it in cluster.json at once. Refuses
        (ClusterError) once `down` has begun, and when a daemon of that name already
        runs: a node's daemons are never started twice."""
        with self._lock:
            if self._closed:
                raise ClusterError(
                    f"the cluster in {self.state_dir} is going down; {what} is not started"
                )
            self._refuse_second(name, what)
            return self._spawn_recorded(name, kind, argv, env, what, node_id, socket)

    def _refuse_second(self, name: str, what: str) -> None:
        """ClusterError when a daemon called `name` runs: one this object or cluster.json
        records, or one found by its environment."""
        pids = {p.pid for p in self.processes if p.name == name and self.is_alive(p)}
        pids |= {p.pid for p in _recorded(self.state_file) if p.name == name and p.alive()}
        pids |= {
            t.pid for t in tagged_processes(self.state_dir) if t.daemon == name and t.is_daemon()
        }
        if pids:
            raise ClusterError(
                f"{what} already runs (pid {', '.join(map(str, sorted(pids)))}); a node's "
                "daemons are never started twice: stop them first (restart_node does)"
            )

    def _spawn_recorded(
        self,
        name: str,
        kind: Kind,
        argv: Sequence[str],
        env: Mapping[str, str],
        what: str,
        node_id: str,
        socket: str,
    ) -> _Starting:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with log.open("ab") as out:
            out.write(f"--- pitstop cluster: starting {what} at {stamp} ---\n".encode())
            out.flush()
            offset = out.tell()
            try:
                popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    start_new_session=True,
                )
            except OSError as exc:
                raise ClusterStartError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
        self._children[popen.pid] = popen
        self._offsets[name] = offset
        proc = ClusterProcess(
            name=name,
            kind=kind,
            pid=popen.pid,
            log=log,
            node_id=node_id,
            socket=socket,
            start_ticks=start_ticks(popen.pid),
        )
        self.processes = [p for p in self.processes if p.name != name] + [proc]
        self._save()
        return _Starting(proc, popen, offset, what)

    def _start_scheduler(
        self,
        port: int,
        database_url: str | None,
        redis_url: str | None,
        liveness_timeout: float | None,
        deadline: float,
    ) -> None:
        env = self._daemon_env(SCHEDULER_ENV, "scheduler")
        if liveness_timeout is not None:
            env[_HEARTBEAT_ENV] = f"{HEARTBEAT_INTERVAL:g}"
            env[_LIVENESS_ENV] = f"{liveness_timeout / HEARTBEAT_INTERVAL:g}"
        self.liveness_timeout = _liveness_of(env)
        # URLs through the environment, not argv: a password stays out of `ps`.
        if database_url:
            env["PITSTOP_DATABASE_URL"] = database_url
        if redis_url:
            env["PITSTOP_REDIS_URL"] = redis_url
        host = "127.0.0.1" if self.network is None else self.network.gateway
        argv = [
            binary("pitstop-scheduler"),
            "--state-dir",
            str(self.state_dir / "scheduler"),
            "--host",
            host,
            "--port",
            str(port),
            "--metrics-port",
            "0",
        ]
        starting = self._spawn("scheduler", "scheduler", argv, env, "the scheduler")
        try:
            (self.scheduler_address,) = self._await_lines([starting], _SCHEDULER_LINE, deadline)
        except ClusterStartError as exc:
            if port and "Failed to bind" in log_tail(starting.process.log, starting.offset):
                raise ClusterStartError(
                    f"the scheduler cannot listen on {host}:{port}: is another cluster or "
                    "scheduler using it? Give another --port (0 picks a free one)"
                ) from exc
            raise
        self._update(replace(starting.process, address=self.scheduler_address))

    def _start_nodes(self, specs: Sequence[NodeSpec], deadline: float) -> list[ClusterProcess]:
        """Checkpoint daemons for `specs` together, then, once each listens, the agents."""
        checkpointds = [self._spawn_checkpointd(spec) for spec in specs]
        addresses = self._await_lines(checkpointds, _CHECKPOINTD_LINE, deadline)
        started: list[ClusterProcess] = []
        for starting, address in zip(checkpointds, addresses, strict=True):
            proc = replace(starting.process, address=address)
            self._update(proc)
            started.append(proc)
        agents = [
            self._spawn_agent(spec, proc.address) for spec, proc in zip(specs, started, strict=True)
        ]
        return started + [a.process for a in agents]

    def _in_namespace(self, node_id: str, argv: list[str]) -> list[str]:
        """`argv` run in the node's network namespace, if it has one."""
        return argv if self.network is None else [*self.network.exec_prefix(node_id), *argv]

    def _node_host(self, node_id: str) -> str:
        """The address the node's daemons listen on and its ranks are reached at."""
        return "127.0.0.1" if self.network is None else self.network.link(node_id).address

    def _spawn_checkpointd(self, spec: NodeSpec) -> _Starting:
        argv = [
            binary("pitstop-checkpointd"),
            "run",
            "--node-id",
            spec.node_id,
            "--host",
            self._node_host(spec.node_id),
            "--port",
            "0",
            "--scheduler",
            self.scheduler_address,
            "--state-dir",
            str(self.state_dir / "nodes" / spec.node_id / "checkpointd"),
            # One durable store for the whole cluster, as a shared bucket would be: a
            # spare restores what a dead node flushed.
            "--durable-url",
            (self.state_dir / "durable").as_uri(),
        ]
        return self._spawn(
            f"checkpointd-{spec.node_id}",
            "checkpointd",
            self._in_namespace(spec.node_id, argv),
            self._daemon_env(CHECKPOINTD_ENV, f"checkpointd-{spec.node_id}"),
            f"the checkpoint daemon of {spec.node_id}",
            node_id=spec.node_id,
        )

    def _spawn_agent(self, spec: NodeSpec, checkpointd_address: str) -> _Starting:
        agent_dir = self.state_dir / "nodes" / spec.node_id / "agent"
        socket = self._socket_path(agent_dir, spec.node_id)
        argv = [
            binary("pitstop-agent"),
            "run",
            "--node-id",
            spec.node_id,
            "--scheduler",
            self.scheduler_address,
            "--gpus",
            f"sim:{spec.gpus}",
            "--zone",
            "z1",
            "--block",
            "b1",
            "--rack",
            spec.rack,
            "--role",
            spec.role,
            "--state-dir",
            str(agent_dir),
            "--socket-path",
            str(socket),
            "--checkpointd-address",
            checkpointd_address,
            "--metrics-port",
            "0",
        ]
        extra = {}
        if self.network is not None:
            argv += ["--advertise-host", self._node_host(spec.node_id)]
            # Gloo would pick the address the host name resolves to, loopback here;
            # the ranks inherit the agent's environment.
            extra["GLOO_SOCKET_IFNAME"] = IFACE
        return self._spawn(
            f"agent-{spec.node_id}",
            "agent",
            self._in_namespace(spec.node_id, argv),
            self._daemon_env(extra, f"agent-{spec.node_id}"),
            f"the agent of {spec.node_id}",
            node_id=spec.node_id,
            socket=str(socket),
        )

    def _socket_path(self, agent_dir: Path, node_id: str) -> Path:
        """The agent's socket in its state dir, or, when that path is too long for a
        Unix socket, in a private folder under the temp dir named for this cluster."""
        socket = agent_dir / "agent.sock"
        if len(str(socket)) <= _MAX_SOCKET_PATH:
            return socket
        digest = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]
        folder = Path(tempfile.gettempdir()) / f"pitstop-{digest}"
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder / f"{node_id}.sock"

    def _await_lines(
        self, starting: Sequence[_Starting], pattern: re.Pattern[str], deadline: float
    ) -> list[str]:
        """The address each daemon printed on the line `pattern` matches, read from its
        log (no pipe stays open to a daemon). ClusterStartError when one exits first or
        `deadline` passes."""
        found: dict[int, str] = {}
        while True:
            for index, item in enumerate(starting):
                if index in found:
                    continue
                # Poll before reading: a daemon that printed and then exited is found.
                code = item.popen.poll()
                address = _find_address(item.process.log, item.offset, pattern)
                if address is not None:
                    found[index] = address
                elif code is not None:
                    raise ClusterStartError(
                        f"{item.what} exited with code {code} before it was listening",
                        item.process.log,
                        item.offset,
                    )
            if len(found) == len(starting):
                return [found[i] for i in range(len(starting))]
            if time.monotonic() >= deadline:
                late = next(s for i, s in enumerate(starting) if i not in found)
                raise ClusterStartError(
                    f"{late.what} was not listening in time", late.process.log, late.offset
                )
            time.sleep(_POLL)

    def _check_alive(self, node_ids: Sequence[str]) -> None:
        for proc in self.processes:
            if (proc.kind == "scheduler" or proc.node_id in node_ids) and not self.is_alive(proc):
                child = self._children.get(proc.pid)
                code = "" if child is None else f" with code {child.returncode}"
                raise ClusterStartError(
                    f"{proc.name} (pid {proc.pid}) exited{code}",
                    proc.log,
                    self._offsets.get(proc.name, 0),
                )

    def _not_ready(
        self,
        wanted: Sequence[str],
        seen: Mapping[str, nodes_pb2.Node],
        addresses: Mapping[str, str],
        timeout: float,
        last_error: str,
    ) -> str:
        problems = []
        for node_id in wanted:
            node = seen.get(node_id)
            log = self.log_dir / f"agent-{node_id}.log"
            if (
                node is None
                or not node.connected
                or (node.inventory.checkpointd_address != addresses.get(node_id, ""))
            ):
                problems.append(f"{node_id} never registered (read {log})")
            elif not _is_up(node, addresses.get(node_id, "")):
                state = common_pb2.NodeState.Name(node.state).removeprefix("NODE_STATE_").lower()
                reason = f": {node.reason}" if node.reason else ""
                problems.append(f"{node_id} is {state}{reason} (read {log})")
        message = f"nodes not ready after {timeout:.0f} s: {'; '.join(problems)}"
        if last_error:
            message += (
                f"; the scheduler at {self.scheduler_address} did not answer ({last_error}); "
                f"read {self.log_dir / 'scheduler.log'}"
            )
        return message

    def _pid_alive(self, pid: int) -> bool:
        child = self._children.get(pid)
        if child is not None:
            return child.poll() is None
        for proc in self.processes:
            if proc.pid == pid:
                return proc.alive()
        return pid_alive(pid)

    def _forget_children(self, pids: Iterable[int]) -> None:
        """Drop the Popen handles of processes that have exited (reaped)."""
        for pid in list(pids):
            child = self._children.get(pid)
            if child is not None and child.poll() is not None:
                del self._children[pid]

    def _update(self, proc: ClusterProcess) -> None:
        with self._lock:
            self.processes = [proc if p.name == proc.name else p for p in self.processes]
            self._save()

    def _save(self) -> None:
        """Write cluster.json atomically: `down` must find whatever has been started.
        Once `down` has begun, nothing: it must not bring the file back."""
        if self._closed:
            return
        data = {
            "version": 1,
            "state_dir": str(self.state_dir),
            "scheduler_address": self.scheduler_address,
            "nodes": [spec.to_json() for spec in self.nodes],
            "processes": [p.to_json() for p in self.processes],
            "network": None if self.network is None else self.network.to_json(),
            "liveness_timeout_seconds": self.liveness_timeout,
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.state_file)


def _recorded(state_file: Path) -> list[ClusterProcess]:
    """The processes a cluster.json records; none when it is missing or unreadable."""
    try:
        data = json.loads(state_file.read_text())
        return [ClusterProcess.from_json(p) for p in data["processes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _check_liveness(seconds: float) -> None:
    floor = _MIN_LIVENESS_INTERVALS * HEARTBEAT_INTERVAL
    if not seconds >= floor:
        raise ClusterError(
            f"liveness timeout {seconds:g} s: give at least {floor:g} s "
            f"({_MIN_LIVENESS_INTERVALS:g} heartbeats of {HEARTBEAT_INTERVAL:g} s)"
        )


def _liveness_of(env: Mapping[str, str]) -> float:
    """The liveness deadline a scheduler started with `env` uses, in seconds."""
    try:
        return float(env[_HEARTBEAT_ENV]) * float(env[_LIVENESS_ENV])
    except (KeyError, ValueError):
        raise ClusterError(
            f"{_HEARTBEAT_ENV}={env.get(_HEARTBEAT_ENV)!r} and "
            f"{_LIVENESS_ENV}={env.get(_LIVENESS_ENV)!r}: give numbers"
        ) from None


def _checked(action: Callable[[], _T]) -> _T:
    """`action()`, its NetnsError raised as a ClusterError."""
    try:
        return action()
    except NetnsError as exc:
        raise ClusterError(str(exc)) from exc


def _find_address(log: Path, offset: int, pattern: re.Pattern[str]) -> str | None:
    """The address in the first complete line after `offset` that `pattern` matches."""
    try:
        with log.open("rb") as out:
            out.seek(offset)
            text = out.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines(keepends=True):
        match = pattern.match(line)
        if match and line.endswith("\n"):
            return match.group(1)
    return None


def _is_up(node: nodes_pb2.Node, checkpointd_address: str) -> bool:
    """Connected from the agent started with our checkpointd, and healthy."""
    return (
        node.connected
        and node.state in _UP_STATES
        and (not checkpointd_address or node.inventory.checkpointd_address == checkpointd_address)
    )


def wipe_state_dir(state_dir: Path) -> bool:
    """Remove a cluster's state dir; refuses one holding files a cluster does not write.
    Returns whether there was something to remove."""
    root = Path(state_dir).expanduser().absolute()
    if not root.exists():
        return False
    foreign = sorted(entry.name for entry in root.iterdir() if entry.name not in _OWN_ENTRIES)
    if foreign:
        raise ClusterError(
            f"{root} holds files a pitstop cluster does not write ({', '.join(foreign[:5])}); "
            "remove it yourself if you mean to"
        )
    shutil.rmtree(root)
    return True


def stop_cluster(
    state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
    *,
    timeout: float = STOP_TIMEOUT,
    wipe: bool = False,
) -> list[ClusterProcess] | None:
    """:meth:`LocalCluster.down` for whatever runs in `state_dir`: the cluster its
    cluster.json records, and any process a cluster there started without recording it
    (an `up` killed mid-way). Returns the daemons stopped; None when there was no
    cluster.json and nothing of a cluster ran. With `wipe`, removes the state dir."""
    root = Path(state_dir).expanduser().absolute()
    if not root.exists():
        return None
    cluster = LocalCluster.load(root)
    if cluster is not None:
        return cluster.down(timeout=timeout, wipe=wipe)
    with _locked(root, wait=LOCK_WAIT):
        strays = LocalCluster(root, "", [], _closed=True)._stop_all(timeout)
    if wipe:
        wipe_state_dir(root)
    return strays or None


@contextlib.contextmanager
def running_cluster(
    state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR, *, keep: bool = False, **options: Any
) -> Iterator[LocalCluster]:
    """A cluster brought :meth:`~LocalCluster.up` (with `options`) for the block and down
    at its end, whatever ends it: an exception, Ctrl-C, or SIGTERM under
    `pitstop.client.signals.orderly_exit`. With `keep`, a block that ends by itself or
    by an Exception leaves the cluster running (for a look at it); an interrupt still
    brings it down. Whatever `up` started before an interrupt is found and stopped too."""
    cluster: LocalCluster | None = None
    leave_running = False
    try:
        cluster = LocalCluster.up(state_dir, **options)
        yield cluster
        leave_running = keep
    except Exception:
        leave_running = keep and cluster is not None
        raise
    finally:
        if not leave_running:
            if cluster is not None:
                cluster.down()
            else:  # interrupted inside up, or between its return and here
                stop_cluster(state_dir)
