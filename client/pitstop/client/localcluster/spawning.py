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
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from pitstop.client import launch
from pitstop.client.localcluster.errors import ClusterError, ClusterStartError, log_tail
from pitstop.client.localcluster.nodecommands import NodeCommands, binary
from pitstop.client.localcluster.processes import POLL, start_ticks, tagged_processes
from pitstop.client.localcluster.settings import (
    CHECKPOINTD_ENV,
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

# The line each daemon prints once it serves (only at the start of a line: a traceback
# quoting the print call must not match).
_SCHEDULER_LINE = re.compile(r"^pitstop-scheduler listening on (\S+:\d+)\s*$")
_CHECKPOINTD_LINE = re.compile(r"^pitstop-checkpointd \S+ listening on (\S+:\d+)\s")
_METRICS_LINE = re.compile(r"^\S+ \S+ INFO \S+: metrics on http://(\S+:\d+)/metrics\s*$")
_DASHBOARD_LINE = re.compile(r"^\S+ \S+ INFO \S+: dashboard on (https?://\S+)\s*$")
_NODE_PORT_LINE = re.compile(r"^pitstop-scheduler nodes connect on (\S+:\d+)\s*$")

__all__ = ["DaemonSpawner", "Starting", "binary", "find_address", "free_port"]

LOCAL_PREFLIGHT_SECONDS = 5.0
"""How often an idle node of a local cluster runs its preflight (pitstop.agent.preflight)."""


@dataclass
class Starting:
    """A daemon just spawned, and where in its log its own output begins."""

    process: ClusterProcess
    popen: subprocess.Popen[bytes]
    offset: int
    what: str


class DaemonSpawner:
    """Starts the daemons of the cluster `record` and waits for the line each prints
    once it serves; `commands` builds what each is started with."""

    def __init__(self, record: ClusterState, commands: NodeCommands) -> None:
        self.record = record
        self.commands = commands

    def spawn(
        self,
        name: str,
        kind: Kind,
        argv: Sequence[str],
        env: Mapping[str, str],
        what: str,
        *,
        node_id: str = "",
        socket: str = "",
    ) -> Starting:
        """Start a daemon detached: its own session, stdin from /dev/null, stdout and
        stderr appended to logs/<name>.log; record it in cluster.json at once. Refuses
        (ClusterError) once `down` has begun, and when a daemon of that name already
        runs: a node's daemons are never started twice."""
        with self.record._lock:
            if self.record._closed:
                raise ClusterError(
                    f"the cluster in {self.record.state_dir} is going down; {what} is not started"
                )
            self.refuse_second(name, what)
            return self.spawn_recorded(name, kind, argv, env, what, node_id, socket)

    def refuse_second(self, name: str, what: str) -> None:
        """ClusterError when a daemon called `name` runs: one this object or cluster.json
        records, or one found by its environment."""
        pids = {p.pid for p in self.record.processes if p.name == name and self.record.is_alive(p)}
        pids |= {p.pid for p in recorded(self.record.state_file) if p.name == name and p.alive()}
        pids |= {
            t.pid
            for t in tagged_processes(self.record.state_dir)
            if t.daemon == name and t.is_daemon()
        }
        if pids:
            raise ClusterError(
                f"{what} already runs (pid {', '.join(map(str, sorted(pids)))}); a node's "
                "daemons are never started twice: stop them first (restart_node does)"
            )

    def spawn_recorded(
        self,
        name: str,
        kind: Kind,
        argv: Sequence[str],
        env: Mapping[str, str],
        what: str,
        node_id: str,
        socket: str,
    ) -> Starting:
        self.record.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.record.log_dir / f"{name}.log"
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
        self.record._children[popen.pid] = popen
        self.record._offsets[name] = offset
        proc = ClusterProcess(
            name=name,
            kind=kind,
            pid=popen.pid,
            log=log,
            node_id=node_id,
            socket=socket,
            start_ticks=start_ticks(popen.pid),
        )
        self.record.processes = [p for p in self.record.processes if p.name != name] + [proc]
        self.record._save()
        return Starting(proc, popen, offset, what)

    def start_scheduler(
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
        env = self.commands.daemon_env(SCHEDULER_ENV, name)
        if liveness_timeout is not None:
            env[HEARTBEAT_ENV] = env[REFRESH_ENV] = f"{HEARTBEAT_INTERVAL:g}"
            env[LIVENESS_ENV] = f"{liveness_timeout / HEARTBEAT_INTERVAL:g}"
        self.record.liveness_timeout = liveness_of(env)
        self.record.silent_host_timeout = silent_host_of(env)
        # URLs through the environment, not argv: a password stays out of `ps`.
        if database_url:
            env["PITSTOP_DATABASE_URL"] = database_url
        if redis_url:
            env["PITSTOP_REDIS_URL"] = redis_url
        host = "127.0.0.1" if self.record.network is None else self.record.network.gateway
        if self.record.tls:
            env.update(self.tls_env(name))
        binary("pitstop-scheduler")  # ClusterError, naming it, when it is missing
        argv = launch.scheduler_command(
            state_dir=self.record.state_dir / name,
            host=host,
            port=port,
            metrics_port=0,
            dashboard_port=0,
        )
        what = "the scheduler" if name == "scheduler" else f"the scheduler {name}"
        starting = self.spawn(name, "scheduler", argv, env, what)
        try:
            (address,) = self.await_lines([starting], _SCHEDULER_LINE, deadline)
            # Logged right after the line above; a scheduler without it still serves.
            metrics = find_address(starting.process.log, starting.offset, _METRICS_LINE)
            if metrics is None:
                with contextlib.suppress(ClusterStartError):
                    (metrics,) = self.await_lines(
                        [starting], _METRICS_LINE, min(deadline, time.monotonic() + 5.0)
                    )
            # Logged right after the metrics line.
            dashboard = find_address(starting.process.log, starting.offset, _DASHBOARD_LINE)
            if dashboard is None:
                with contextlib.suppress(ClusterStartError):
                    (dashboard,) = self.await_lines(
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
        if self.record.tls:
            (node_address,) = self.await_lines([starting], _NODE_PORT_LINE, deadline)
        if name == "scheduler":
            self.record.scheduler_address = address
        proc = replace(
            starting.process,
            address=address,
            metrics=metrics or "",
            node_address=node_address,
            dashboard=dashboard or "",
        )
        self.record._update(proc)
        return proc

    def tls_env(self, name: str) -> dict[str, str]:
        """A secure scheduler's settings: TLS with the CA in its state dir, the node port
        it had (the nodes learned it at enrollment) or a free one, and the cluster's
        admin token (made on first use, kept 0600) beside any configured ones."""
        token_file = self.record.admin_token_file
        if not token_file.exists():
            self.record.state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
        token = self.record.admin_token() or ""
        earlier = next(
            (p for p in self.record.processes if p.name == name and p.node_address), None
        )
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

    def join_tokens(self, specs: Sequence[NodeSpec]) -> dict[str, str]:
        """A one-time join token for each node of `specs` not enrolled yet (with TLS)."""
        if not self.record.tls:
            return {}
        wanted = [s.node_id for s in specs if not self.commands.identity(s.node_id).enrolled]
        if not wanted:
            return {}
        with self.record.client(timeout=10.0) as client:
            return {
                node_id: client.create_join_token(JOIN_TOKEN_TTL_SECONDS, node_id).token
                for node_id in wanted
            }

    def start_nodes(self, specs: Sequence[NodeSpec], deadline: float) -> list[ClusterProcess]:
        """Checkpoint daemons for `specs` together (enrolling each node that is not yet,
        with TLS), then, once each listens, the agents."""
        tokens = self.join_tokens(specs)
        checkpointds = [
            self.spawn_checkpointd(spec, tokens.get(spec.node_id, "")) for spec in specs
        ]
        addresses = self.await_lines(checkpointds, _CHECKPOINTD_LINE, deadline)
        started: list[ClusterProcess] = []
        for starting, address in zip(checkpointds, addresses, strict=True):
            proc = replace(starting.process, address=address)
            self.record._update(proc)
            started.append(proc)
        agents = [
            self.spawn_agent(spec, proc.address) for spec, proc in zip(specs, started, strict=True)
        ]
        return started + [a.process for a in agents]

    def spawn_checkpointd(self, spec: NodeSpec, join_token: str = "") -> Starting:
        # A daemon its agent starts again must come back at the same address: a fixed port.
        port = (
            free_port(self.commands.node_host(spec.node_id))
            if self.record.agent_owns_checkpointd
            else 0
        )
        argv = self.commands.checkpointd_argv(spec, port)
        env = self.commands.daemon_env(CHECKPOINTD_ENV, f"checkpointd-{spec.node_id}")
        if join_token and self.record.ca_cert is not None:
            # Through the environment, out of `ps`: the daemon enrolls the node with it.
            env["PITSTOP_CHECKPOINTD_JOIN_TOKEN"] = join_token
            env["PITSTOP_CHECKPOINTD_CA_FILE"] = str(self.record.ca_cert)
        return self.spawn(
            f"checkpointd-{spec.node_id}",
            "checkpointd",
            self.commands.in_namespace(spec.node_id, argv),
            env,
            f"the checkpoint daemon of {spec.node_id}",
            node_id=spec.node_id,
        )

    def spawn_agent(self, spec: NodeSpec, checkpointd_address: str) -> Starting:
        socket = self.commands.socket_path(spec.node_id)
        argv = self.commands.agent_argv(spec, socket, checkpointd_address)
        # An idle node checks itself every few seconds (300 on a fleet): a drilled
        # preflight failure (inject-fault --fail-preflight) shows while one watches.
        extra = {
            "PITSTOP_AGENT_PREFLIGHT_INTERVAL_SECONDS": os.environ.get(
                "PITSTOP_AGENT_PREFLIGHT_INTERVAL_SECONDS", str(LOCAL_PREFLIGHT_SECONDS)
            )
        }
        if self.record.network is not None:
            # Gloo would pick the address the host name resolves to, loopback here;
            # the ranks inherit the agent's environment.
            extra["GLOO_SOCKET_IFNAME"] = IFACE
        return self.spawn(
            f"agent-{spec.node_id}",
            "agent",
            self.commands.in_namespace(spec.node_id, argv),
            self.commands.daemon_env(extra, f"agent-{spec.node_id}"),
            f"the agent of {spec.node_id}",
            node_id=spec.node_id,
            socket=str(socket),
        )

    def await_lines(
        self, starting: Sequence[Starting], pattern: re.Pattern[str], deadline: float
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
                address = find_address(item.process.log, item.offset, pattern)
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


def find_address(log: Path, offset: int, pattern: re.Pattern[str]) -> str | None:
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
