"""Starting a local cluster's daemons: each detached (a session of its own, its output
in ``logs/<name>.log``), tagged with the cluster in its environment, recorded in
cluster.json as soon as it is started, and never two of one name; then waiting for the
line each prints once it serves."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shlex
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from pitstop.client import launch
from pitstop.client.localcluster.errors import ClusterError, ClusterStartError, log_tail
from pitstop.client.localcluster.processes import POLL, start_ticks, tagged_processes
from pitstop.client.localcluster.settings import (
    CHECKPOINTD_ENV,
    CLUSTER_ENV,
    DAEMON_ENV,
    HEARTBEAT_ENV,
    HEARTBEAT_INTERVAL,
    JOIN_TOKEN_TTL_SECONDS,
    LIVENESS_ENV,
    REFRESH_ENV,
    SCHEDULER_ENV,
    liveness_of,
    silent_host_of,
)
from pitstop.client.localcluster.statefile import (
    ClusterProcess,
    ClusterState,
    Kind,
    NodeSpec,
    recorded,
)
from pitstop.client.netns import IFACE
from pitstop.common.tls import NodeIdentity

# The line each daemon prints once it serves (only at the start of a line: a traceback
# quoting the print call must not match).
_SCHEDULER_LINE = re.compile(r"^pitstop-scheduler listening on (\S+:\d+)\s*$")
_CHECKPOINTD_LINE = re.compile(r"^pitstop-checkpointd \S+ listening on (\S+:\d+)\s")
_METRICS_LINE = re.compile(r"^\S+ \S+ INFO \S+: metrics on http://(\S+:\d+)/metrics\s*$")
_DASHBOARD_LINE = re.compile(r"^\S+ \S+ INFO \S+: dashboard on (https?://\S+)\s*$")
_NODE_PORT_LINE = re.compile(r"^pitstop-scheduler nodes connect on (\S+:\d+)\s*$")
# AF_UNIX paths hold 108 bytes with the terminating NUL.
_MAX_SOCKET_PATH = 100


def binary(name: str) -> str:
    """A pitstop console script: next to the running python first, then on PATH."""
    try:
        return launch.binary(name)
    except launch.LaunchError as exc:
        raise ClusterError(str(exc)) from exc


LOCAL_PREFLIGHT_SECONDS = 5.0
"""How often an idle node of a local cluster runs its preflight (pitstop.agent.preflight)."""


@dataclass
class _Starting:
    """A daemon just spawned, and where in its log its own output begins."""

    process: ClusterProcess
    popen: subprocess.Popen[bytes]
    offset: int
    what: str


class ClusterSpawning(ClusterState):
    """Starting daemons, a part of `LocalCluster`."""

    def _daemon_env(self, extra: Mapping[str, str], name: str) -> dict[str, str]:
        # Jobs say `python`: let it be this environment's, where pitstop is installed.
        env = launch.with_python_first(os.environ)
        # A daemon that dies at start leaves a plain traceback, whose last lines (the
        # ones `up` shows) name the error, rather than a boxed one.
        env.setdefault("_TYPER_STANDARD_TRACEBACK", "1")
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
            return self._spawnrecorded(name, kind, argv, env, what, node_id, socket)

    def _refuse_second(self, name: str, what: str) -> None:
        """ClusterError when a daemon called `name` runs: one this object or cluster.json
        records, or one found by its environment."""
        pids = {p.pid for p in self.processes if p.name == name and self.is_alive(p)}
        pids |= {p.pid for p in recorded(self.state_file) if p.name == name and p.alive()}
        pids |= {
            t.pid for t in tagged_processes(self.state_dir) if t.daemon == name and t.is_daemon()
        }
        if pids:
            raise ClusterError(
                f"{what} already runs (pid {', '.join(map(str, sorted(pids)))}); a node's "
                "daemons are never started twice: stop them first (restart_node does)"
            )

    def _spawnrecorded(
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
        name: str = "scheduler",
    ) -> ClusterProcess:
        """Start the scheduler `name` (``scheduler``, or ``scheduler-2``... beside it) and
        return it once it listens (and says where its /metrics are)."""
        env = self._daemon_env(SCHEDULER_ENV, name)
        if liveness_timeout is not None:
            env[HEARTBEAT_ENV] = env[REFRESH_ENV] = f"{HEARTBEAT_INTERVAL:g}"
            env[LIVENESS_ENV] = f"{liveness_timeout / HEARTBEAT_INTERVAL:g}"
        self.liveness_timeout = liveness_of(env)
        self.silent_host_timeout = silent_host_of(env)
        # URLs through the environment, not argv: a password stays out of `ps`.
        if database_url:
            env["PITSTOP_DATABASE_URL"] = database_url
        if redis_url:
            env["PITSTOP_REDIS_URL"] = redis_url
        host = "127.0.0.1" if self.network is None else self.network.gateway
        if self.tls:
            env.update(self._tls_env(name))
        binary("pitstop-scheduler")  # ClusterError, naming it, when it is missing
        argv = launch.scheduler_command(
            state_dir=self.state_dir / name, host=host, port=port, metrics_port=0, dashboard_port=0
        )
        what = "the scheduler" if name == "scheduler" else f"the scheduler {name}"
        starting = self._spawn(name, "scheduler", argv, env, what)
        try:
            (address,) = self._await_lines([starting], _SCHEDULER_LINE, deadline)
            # Logged right after the line above; a scheduler without it still serves.
            metrics = _find_address(starting.process.log, starting.offset, _METRICS_LINE)
            if metrics is None:
                with contextlib.suppress(ClusterStartError):
                    (metrics,) = self._await_lines(
                        [starting], _METRICS_LINE, min(deadline, time.monotonic() + 5.0)
                    )
            # Logged right after the metrics line.
            dashboard = _find_address(starting.process.log, starting.offset, _DASHBOARD_LINE)
            if dashboard is None:
                with contextlib.suppress(ClusterStartError):
                    (dashboard,) = self._await_lines(
                        [starting], _DASHBOARD_LINE, min(deadline, time.monotonic() + 5.0)
                    )
        except ClusterStartError as exc:
            if port and "Failed to bind" in log_tail(starting.process.log, starting.offset):
                raise ClusterStartError(
                    f"the scheduler cannot listen on {host}:{port}: is another cluster or "
                    "scheduler using it? Give another --port (0 picks a free one)"
                ) from exc
            raise
        node_address = ""
        if self.tls:
            (node_address,) = self._await_lines([starting], _NODE_PORT_LINE, deadline)
        if name == "scheduler":
            self.scheduler_address = address
        proc = replace(
            starting.process,
            address=address,
            metrics=metrics or "",
            node_address=node_address,
            dashboard=dashboard or "",
        )
        self._update(proc)
        return proc

    def _tls_env(self, name: str) -> dict[str, str]:
        """A secure scheduler's settings: TLS with the CA in its state dir, the node port
        it had (the nodes learned it at enrollment) or a free one, and the cluster's
        admin token (made on first use, kept 0600) beside any configured ones."""
        token_file = self.admin_token_file
        if not token_file.exists():
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
        token = self.admin_token() or ""
        earlier = next((p for p in self.processes if p.name == name and p.node_address), None)
        node_port = earlier.node_address.rsplit(":", 1)[1] if earlier is not None else "0"
        admin = {
            "name": "local-admin",
            "role": "admin",
            "sha256": hashlib.sha256(token.encode()).hexdigest(),
        }
        try:
            configured = json.loads(os.environ.get("PITSTOP_TOKENS") or "[]")
        except ValueError as exc:
            raise ClusterError(f"PITSTOP_TOKENS is not a JSON list of tokens: {exc}") from exc
        return {
            "PITSTOP_TLS": "true",
            "PITSTOP_NODE_PORT": node_port,
            "PITSTOP_TOKENS": json.dumps([*configured, admin]),
        }

    def _join_tokens(self, specs: Sequence[NodeSpec]) -> dict[str, str]:
        """A one-time join token for each node of `specs` not enrolled yet (with TLS)."""
        if not self.tls:
            return {}
        wanted = [s.node_id for s in specs if not self._identity(s.node_id).enrolled]
        if not wanted:
            return {}
        with self.client(timeout=10.0) as client:
            return {
                node_id: client.create_join_token(JOIN_TOKEN_TTL_SECONDS, node_id).token
                for node_id in wanted
            }

    def _identity(self, node_id: str) -> NodeIdentity:
        """The node's identity: its agent's state dir/tls, shared with its checkpointd."""
        return NodeIdentity(self.state_dir / "nodes" / node_id / "agent" / "tls", node_id)

    def _start_nodes(self, specs: Sequence[NodeSpec], deadline: float) -> list[ClusterProcess]:
        """Checkpoint daemons for `specs` together (enrolling each node that is not yet,
        with TLS), then, once each listens, the agents."""
        tokens = self._join_tokens(specs)
        checkpointds = [
            self._spawn_checkpointd(spec, tokens.get(spec.node_id, "")) for spec in specs
        ]
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

    def _checkpointd_argv(self, spec: NodeSpec, port: int) -> list[str]:
        binary("pitstop-checkpointd")  # ClusterError, naming it, when it is missing
        return launch.checkpointd_command(
            node_id=spec.node_id,
            host=self._node_host(spec.node_id),
            port=port,
            scheduler=self.scheduler_target,
            state_dir=self.state_dir / "nodes" / spec.node_id / "checkpointd",
            # One durable store for the whole cluster, as a shared bucket would be: a
            # spare restores what a dead node flushed.
            durable_url=(self.state_dir / "durable").as_uri(),
            tls_dir=self._identity(spec.node_id).directory if self.tls else None,
        )

    def _spawn_checkpointd(self, spec: NodeSpec, join_token: str = "") -> _Starting:
        # A daemon its agent starts again must come back at the same address: a fixed port.
        port = free_port(self._node_host(spec.node_id)) if self.agent_owns_checkpointd else 0
        argv = self._checkpointd_argv(spec, port)
        env = self._daemon_env(CHECKPOINTD_ENV, f"checkpointd-{spec.node_id}")
        if join_token and self.ca_cert is not None:
            # Through the environment, out of `ps`: the daemon enrolls the node with it.
            env["PITSTOP_CHECKPOINTD_JOIN_TOKEN"] = join_token
            env["PITSTOP_CHECKPOINTD_CA_FILE"] = str(self.ca_cert)
        return self._spawn(
            f"checkpointd-{spec.node_id}",
            "checkpointd",
            self._in_namespace(spec.node_id, argv),
            env,
            f"the checkpoint daemon of {spec.node_id}",
            node_id=spec.node_id,
        )

    def _spawn_agent(self, spec: NodeSpec, checkpointd_address: str) -> _Starting:
        agent_dir = self.state_dir / "nodes" / spec.node_id / "agent"
        socket = self._socket_path(agent_dir, spec.node_id)
        binary("pitstop-agent")  # ClusterError, naming it, when it is missing
        owned = self.agent_owns_checkpointd
        argv = launch.agent_command(
            node_id=spec.node_id,
            scheduler=self.scheduler_target,
            gpus=f"sim:{spec.gpus}",
            zone="z1",
            block="b1",
            rack=spec.rack,
            role=spec.role,
            state_dir=agent_dir,
            socket_path=socket,
            checkpointd_address=checkpointd_address,
            metrics_port=0,
            # Enrolled by its checkpoint daemon, started first.
            tls=True if self.ca_cert is not None else None,
            ca_file=self.ca_cert,
            checkpointd_command=(
                self._owned_checkpointd_command(spec, checkpointd_address) if owned else None
            ),
            advertise_host=self._node_host(spec.node_id) if self.network is not None else None,
        )
        # An idle node checks itself every few seconds (300 on a fleet): a drilled
        # preflight failure (inject-fault --fail-preflight) shows while one watches.
        extra = {
            "PITSTOP_AGENT_PREFLIGHT_INTERVAL_SECONDS": os.environ.get(
                "PITSTOP_AGENT_PREFLIGHT_INTERVAL_SECONDS", str(LOCAL_PREFLIGHT_SECONDS)
            )
        }
        if self.network is not None:
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

    def _owned_checkpointd_command(self, spec: NodeSpec, address: str) -> str:
        """The command the agent starts its checkpoint daemon with: the one the cluster
        started, on the same port, with the daemon's own environment and name (so that
        `down`, `kill_node` and the never-twice check find it as the node's daemon)."""
        name = f"checkpointd-{spec.node_id}"
        daemon_env = self._daemon_env(CHECKPOINTD_ENV, name)
        settings = [f"{key}={daemon_env[key]}" for key in CHECKPOINTD_ENV]
        port = int(address.rsplit(":", 1)[1])
        return shlex.join(
            ["env", f"{DAEMON_ENV}={name}", *settings, *self._checkpointd_argv(spec, port)]
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
            time.sleep(POLL)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (bound once and let go)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


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
