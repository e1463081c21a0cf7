"""The record of a local cluster: ``<state dir>/cluster.json`` (nodes, processes, pids,
logs, addresses, network), read by every later ``pitstop cluster`` command, and the lock
that lets one command at a time change it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self, cast

import grpc

from pitstop.client.client import PitstopClient
from pitstop.client.localcluster.errors import ClusterError
from pitstop.client.localcluster.processes import (
    POLL,
    TaggedProcess,
    pid_alive,
    rank_pids,
    start_ticks,
    tagged_processes,
)
from pitstop.client.localcluster.settings import (
    ADMIN_TOKEN_FILE,
    DEFAULT_LIVENESS_TIMEOUT,
    DEFAULT_STATE_DIR,
    KEEPALIVE_SECONDS,
    LOCK_FILE,
    STATE_FILE,
)
from pitstop.client.netns import Network

Kind = Literal["scheduler", "checkpointd", "agent"]
Role = Literal["worker", "spare"]
_OWN_ENTRIES = {
    STATE_FILE,
    STATE_FILE + ".tmp",
    LOCK_FILE,
    ADMIN_TOKEN_FILE,
    "logs",
    "scheduler",
    "nodes",
    "durable",
}
_MORE_SCHEDULERS = re.compile(r"scheduler-\d+")
"""The state dirs (and names) of the schedulers beside the first: scheduler-2, ..."""


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
    metrics: str = ""
    """host:port of its /metrics (a scheduler's); empty when unknown."""
    node_address: str = ""
    """host:port where a scheduler with TLS takes the nodes' certificates (its node
    port, which the nodes learned at enrollment: a restart must keep it)."""
    dashboard: str = ""
    """URL of its web dashboard (a scheduler's); empty when unknown."""

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
            "metrics": self.metrics,
            "node_address": self.node_address,
            "dashboard": self.dashboard,
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
            metrics=str(data.get("metrics") or ""),
            node_address=str(data.get("node_address") or ""),
            dashboard=str(data.get("dashboard") or ""),
        )

    @classmethod
    def from_tagged(cls, tagged: TaggedProcess, log_dir: Path) -> ClusterProcess:
        """A daemon found by its environment, as cluster.json would have recorded it."""
        kind, _, node_id = tagged.daemon.partition("-")
        if kind not in ("scheduler", "checkpointd", "agent"):
            raise ValueError(f"{tagged.daemon!r} names no daemon")
        if kind == "scheduler":
            node_id = ""  # scheduler-2 is the second scheduler, not a node's
        return cls(
            name=tagged.daemon,
            kind=cast(Kind, kind),
            pid=tagged.pid,
            log=log_dir / f"{tagged.daemon}.log",
            node_id=node_id,
            start_ticks=start_ticks(tagged.pid),
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


@contextlib.contextmanager
def locked(state_dir: Path, wait: float = 0.0) -> Iterator[None]:
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
            time.sleep(POLL)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def recorded(state_file: Path) -> list[ClusterProcess]:
    """The processes a cluster.json records; none when it is missing or unreadable."""
    try:
        data = json.loads(state_file.read_text())
        return [ClusterProcess.from_json(p) for p in data["processes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def wipe_state_dir(state_dir: Path) -> bool:
    """Remove a cluster's state dir; refuses one holding files a cluster does not write.
    Returns whether there was something to remove."""
    root = Path(state_dir).expanduser().absolute()
    if not root.exists():
        return False
    foreign = sorted(
        entry.name
        for entry in root.iterdir()
        if entry.name not in _OWN_ENTRIES and not _MORE_SCHEDULERS.fullmatch(entry.name)
    )
    if foreign:
        raise ClusterError(
            f"{root} holds files a pitstop cluster does not write ({', '.join(foreign[:5])}); "
            "remove it yourself if you mean to"
        )
    shutil.rmtree(root)
    return True


@dataclass
class ClusterState:
    """What a local cluster is, as cluster.json records it (its state dir, scheduler
    address, nodes, processes, network), with what this process holds of it; the
    looking up and the writing of that record. A `LocalCluster` holds one as its
    `record` and shares it with its parts, which do the starting and stopping."""

    state_dir: Path
    scheduler_address: str
    nodes: list[NodeSpec]
    processes: list[ClusterProcess] = field(default_factory=list)
    network: Network | None = None
    """With ``--netns``: each node's network namespace behind one bridge."""
    liveness_timeout: float = field(default=DEFAULT_LIVENESS_TIMEOUT, compare=False)
    """Seconds without a heartbeat before the scheduler declares a node lost (what the
    scheduler was started with)."""
    agent_owns_checkpointd: bool = field(default=False, compare=False)
    """Each agent is given its checkpoint daemon's command and address (a fixed port) and
    starts the daemon again when it dies, as ``--checkpointd-command`` does in
    production; otherwise a dead checkpoint daemon stays dead until its node restarts."""
    tls: bool = field(default=True, compare=False)
    """Secure (the default): the scheduler serves TLS with a cluster CA of its own
    (`ca_cert`), every node enrolls with a one-time join token and speaks mutual TLS,
    and the API wants the admin token in `admin_token_file`. False only when asked for
    (``--insecure``): every wire plaintext, the API open."""
    silent_host_timeout: float = field(default=2 * KEEPALIVE_SECONDS, compare=False)
    """Seconds after which the scheduler has lost a host gone silent (no heartbeat, no
    TCP reset) at the latest: its keepalive interval plus the ping's timeout."""
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
    _scheduler_options: tuple[str | None, str | None, float | None] | None = field(
        default=None, repr=False, compare=False
    )
    """(database URL, Redis URL, liveness timeout) the schedulers were started with, to
    start one again; only the object that brought the cluster up has them (URLs may hold
    passwords: they are never written down)."""

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
                bool(data.get("agent_owns_checkpointd", False)),
                # A record from before TLS was the default ran insecure.
                bool(data.get("tls", False)),
                # A record from before it was written: its scheduler kept 1 s + 1 s.
                float(data.get("silent_host_timeout_seconds", 2.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterError(
                f"{root / STATE_FILE} is damaged ({exc!r}); stop the daemons by hand and delete it"
            ) from exc

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def ca_cert(self) -> Path | None:
        """The cluster CA's certificate, to check the scheduler with (None: insecure)."""
        return self.state_dir / "scheduler" / "tls" / "ca.crt" if self.tls else None

    @property
    def dashboard_url(self) -> str:
        """The web dashboard of the first scheduler ("" when unknown). Sign in with the
        admin token (admin_token_file) when the cluster runs with TLS."""
        return next((p.dashboard for p in self.processes if p.kind == "scheduler"), "")

    @property
    def admin_token_file(self) -> Path:
        """The local cluster's admin API token (mode 0600), when it runs with TLS."""
        return self.state_dir / ADMIN_TOKEN_FILE

    def admin_token(self) -> str | None:
        """The admin token a client of this cluster sends (None: insecure, the API open)."""
        if not self.tls:
            return None
        try:
            return self.admin_token_file.read_text().strip()
        except OSError as exc:
            raise ClusterError(
                f"cannot read the cluster's admin token {self.admin_token_file}: "
                f"{exc.strerror}; run as the user who brought the cluster up"
            ) from exc

    def client(self, timeout: float = 10.0, max_attempts: int = 5) -> PitstopClient:
        """A client for the cluster's schedulers, as its admin (checking the scheduler
        against the cluster CA, with TLS); use it in a ``with`` block."""
        credentials = None
        if self.ca_cert is not None:
            try:
                ca = self.ca_cert.read_bytes()
            except OSError as exc:
                raise ClusterError(
                    f"cannot read the cluster CA certificate {self.ca_cert}: {exc.strerror}; "
                    "is the cluster up?"
                ) from exc
            credentials = grpc.ssl_channel_credentials(root_certificates=ca)
        return PitstopClient(
            self.scheduler_target,
            self.admin_token(),
            timeout,
            credentials=credentials,
            max_attempts=max_attempts,
        )

    @property
    def schedulers(self) -> list[ClusterProcess]:
        """The scheduler processes, the first (``scheduler``) first."""
        return [p for p in self.processes if p.kind == "scheduler"]

    @property
    def scheduler_target(self) -> str:
        """The gRPC target the nodes (and a client) reach the schedulers at: the one
        scheduler's host:port, or, with several, ``ipv4:a:p1,a:p2``, which gRPC's
        channel tries in turn, so a node whose scheduler died talks to another at once,
        as it would through a load balancer."""
        addresses = [p.address for p in self.schedulers if p.address]
        if len(addresses) < 2:
            return self.scheduler_address
        return "ipv4:" + ",".join(addresses)

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

    def daemon_pids(self, node_id: str, kind: Kind) -> list[int]:
        """Live pids of the node's daemon of `kind` (agent or checkpointd): the one
        recorded, and one its agent started again (found by its name in its environment)."""
        self.node(node_id)
        name = f"{kind}-{node_id}"
        pids = [p.pid for p in self.processes if p.name == name and self.is_alive(p)]
        pids += [
            t.pid
            for t in tagged_processes(self.state_dir)
            if t.daemon == name and t.is_daemon() and t.pid not in pids
        ]
        return pids

    def is_alive(self, proc: ClusterProcess) -> bool:
        """Whether `proc` runs; reaps it when this object started it."""
        child = self._children.get(proc.pid)
        if child is not None:
            return child.poll() is None
        return proc.alive()

    def running(self) -> list[ClusterProcess]:
        """The processes alive now."""
        return [p for p in self.processes if self.is_alive(p)]

    def rank_pids(self, node_id: str) -> list[int]:
        """Live rank processes the node's agent started (each leads its own session)."""
        sockets = {p.node_id: p.socket for p in self.processes if p.kind == "agent"}
        if node_id not in sockets:
            self.node(node_id)
            return []
        return rank_pids({node_id: sockets[node_id]})[node_id]

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
            "agent_owns_checkpointd": self.agent_owns_checkpointd,
            "tls": self.tls,
            "silent_host_timeout_seconds": self.silent_host_timeout,
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.state_file)
