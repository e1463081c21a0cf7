"""`LocalCluster`: bringing a local cluster up, waiting for its nodes, failing, cutting
off and restarting them, and bringing it down; `stop_cluster` and `running_cluster` for
whatever runs in a state dir.

A `LocalCluster` is made of parts with one job each: `record` (a `ClusterState`: what
cluster.json records, the processes this object started, the lock on both),
`commands` (each daemon's environment and command line), `spawner` (starts daemons and
waits for the line each prints once it serves) and `stopper` (stops them). Its record's
fields and lookups are its own attributes too (`state_dir`, `processes`, `node()`...)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pitstop.client.client import PitstopClient
from pitstop.client.localcluster.cutoff import cut as _cut
from pitstop.client.localcluster.cutoff import cut_off as _cut_off
from pitstop.client.localcluster.cutoff import heal as _heal
from pitstop.client.localcluster.errors import ClusterError, checked
from pitstop.client.localcluster.nodecommands import NodeCommands
from pitstop.client.localcluster.processes import wait_gone
from pitstop.client.localcluster.readiness import Progress
from pitstop.client.localcluster.readiness import wait_ready as _wait_ready
from pitstop.client.localcluster.recorded import Recorded, refuse_running
from pitstop.client.localcluster.schedulers import leader as _leader
from pitstop.client.localcluster.schedulers import scheduler_metrics as _scheduler_metrics
from pitstop.client.localcluster.schedulers import start_scheduler as _start_scheduler
from pitstop.client.localcluster.settings import (
    DEFAULT_LIVENESS_TIMEOUT,
    DEFAULT_PORT,
    DEFAULT_STATE_DIR,
    DEFAULT_TIMEOUT,
    KEEPALIVE_SECONDS,
    LOCK_WAIT,
    STATE_FILE,
    STOP_TIMEOUT,
    check_up_options,
)
from pitstop.client.localcluster.spawning import DaemonSpawner
from pitstop.client.localcluster.statefile import (
    ClusterProcess,
    ClusterState,
    Kind,
    NodeSpec,
    locked,
    node_layout,
    wipe_state_dir,
)
from pitstop.client.localcluster.stopping import ClusterStopper
from pitstop.client.netns import Network, check_supported
from pitstop.client.netns import create as create_network
from pitstop.v1 import nodes_pb2

__all__ = ["LocalCluster", "Progress", "running_cluster", "stop_cluster"]


class LocalCluster:
    """A running local cluster: its state dir, scheduler address, nodes and processes.

    Get one from :meth:`up` (starts it) or :meth:`load` (finds one that runs). Use it as
    a context manager to bring it :meth:`down` at the end of the block.
    """

    # The record's fields (see ClusterState), read and written through to it.
    state_dir: Recorded[Path] = Recorded()
    scheduler_address: Recorded[str] = Recorded()
    nodes: Recorded[list[NodeSpec]] = Recorded()
    processes: Recorded[list[ClusterProcess]] = Recorded()
    network: Recorded[Network | None] = Recorded()
    liveness_timeout: Recorded[float] = Recorded()
    agent_owns_checkpointd: Recorded[bool] = Recorded()
    tls: Recorded[bool] = Recorded()
    silent_host_timeout: Recorded[float] = Recorded()
    env: Recorded[dict[str, str]] = Recorded()
    state_file: Recorded[Path] = Recorded()
    log_dir: Recorded[Path] = Recorded()
    ca_cert: Recorded[Path | None] = Recorded()
    dashboard_url: Recorded[str] = Recorded()
    admin_token_file: Recorded[Path] = Recorded()
    schedulers: Recorded[list[ClusterProcess]] = Recorded()
    scheduler_target: Recorded[str] = Recorded()

    def __init__(
        self,
        state_dir: Path,
        scheduler_address: str,
        nodes: list[NodeSpec],
        processes: list[ClusterProcess] | None = None,
        network: Network | None = None,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT,
        agent_owns_checkpointd: bool = False,
        tls: bool = True,
        silent_host_timeout: float = 2 * KEEPALIVE_SECONDS,
        env: dict[str, str] | None = None,
    ) -> None:
        self._assemble(
            ClusterState(
                state_dir,
                scheduler_address,
                nodes,
                [] if processes is None else processes,
                network,
                liveness_timeout,
                agent_owns_checkpointd,
                tls,
                silent_host_timeout,
                {} if env is None else env,
            )
        )

    def _assemble(self, record: ClusterState) -> None:
        self.record = record
        self.commands = NodeCommands(record)
        self.spawner = DaemonSpawner(record, self.commands)
        self.stopper = ClusterStopper(record)

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR) -> Self | None:
        """The cluster recorded in `state_dir`, running or not; None when none is."""
        record = ClusterState.load(state_dir)
        if record is None:
            return None
        cluster = cls.__new__(cls)
        cluster._assemble(record)
        return cluster

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalCluster):
            return NotImplemented
        return self.record == other.record

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LocalCluster({self.record!r})"

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
        schedulers: int = 1,
        agent_owns_checkpointd: bool = False,
        insecure: bool = False,
    ) -> Self:
        """Start a scheduler on 127.0.0.1:`port` (0: a free port) with embedded stores
        unless URLs are given, then a checkpointd and an agent for each of `nodes`
        workers and `spares` spares; return once every node is ready in the scheduler.
        With `netns` (root, iproute2) each node runs in a network namespace of its own
        behind a bridge whose address the scheduler listens on, so :meth:`cut` can cut
        one off. `liveness_timeout`: seconds without a heartbeat before a node is lost
        (default: PITSTOP_LIVENESS_TIMEOUT_INTERVALS from the environment, else
        DEFAULT_LIVENESS_TIMEOUT); the one used is in :attr:`liveness_timeout`.
        `schedulers` > 1 starts more scheduler processes (``scheduler-2``, ...) on free
        ports beside the first, on the same stores (give both URLs): one leads, the others
        stand by, and the nodes reach whichever answers (:attr:`scheduler_target`).
        `agent_owns_checkpointd`: see the attribute of that name. The cluster is secure
        (:attr:`tls`) unless `insecure`: a cluster CA, nodes enrolled with one-time join
        tokens, mutual TLS on every node's wire, the API behind an admin token.

        Raises ClusterAlreadyRunning when an earlier cluster in `state_dir` still runs,
        ClusterStartError when a daemon fails or `timeout` passes; then nothing that
        this call started is left running.
        """
        root = Path(state_dir).expanduser().absolute()
        layout = node_layout(nodes, spares, gpus_per_node)
        check_up_options(liveness_timeout, schedulers, database_url, redis_url, insecure)
        say = progress or (lambda _message: None)
        if netns:
            checked(check_supported)
        with locked(root):
            earlier = cls.load(root)
            refuse_running(root, None if earlier is None else earlier.record)
            if earlier is not None:
                earlier.stopper.reap_leftovers()
                (root / STATE_FILE).unlink(missing_ok=True)
            cluster = cls(
                root,
                "",
                layout,
                env=dict(env or {}),
                agent_owns_checkpointd=agent_owns_checkpointd,
                tls=not insecure,
            )
            cluster.record._scheduler_options = (database_url, redis_url, liveness_timeout)
            deadline = time.monotonic() + timeout
            try:
                _start_all(cluster, layout, port, schedulers, netns, deadline, say)
            except BaseException:
                say("stopping what was started")
                # A survivor of SIGKILL keeps cluster.json, for `down` to retry; the
                # error that stopped `up` is the one to report.
                with contextlib.suppress(ClusterError):
                    cluster.stopper.stop_all(STOP_TIMEOUT)
                    (root / STATE_FILE).unlink(missing_ok=True)
                raise
        return cluster

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def admin_token(self) -> str | None:
        """The admin token a client of this cluster sends (None: insecure, the API open)."""
        return self.record.admin_token()

    def client(self, timeout: float = 10.0, max_attempts: int = 5) -> PitstopClient:
        """A client for the cluster's schedulers, as its admin; use it in a ``with`` block."""
        return self.record.client(timeout, max_attempts)

    def node(self, node_id: str) -> NodeSpec:
        """The spec of one node; ClusterError when the cluster has no such node."""
        return self.record.node(node_id)

    def process(self, name: str) -> ClusterProcess:
        """The process named `name`, e.g. ``scheduler`` or ``agent-node-1``."""
        return self.record.process(name)

    def node_processes(self, node_id: str) -> list[ClusterProcess]:
        """The node's agent and checkpointd, agent first."""
        return self.record.node_processes(node_id)

    def daemon_pids(self, node_id: str, kind: Kind) -> list[int]:
        """Live pids of the node's daemon of `kind`, recorded or started by its agent."""
        return self.record.daemon_pids(node_id, kind)

    def is_alive(self, proc: ClusterProcess) -> bool:
        """Whether `proc` runs; reaps it when this object started it."""
        return self.record.is_alive(proc)

    def running(self) -> list[ClusterProcess]:
        """The processes alive now."""
        return self.record.running()

    def rank_pids(self, node_id: str) -> list[int]:
        """Live rank processes the node's agent started (each leads its own session)."""
        return self.record.rank_pids(node_id)

    def _save(self) -> None:
        """Write cluster.json now (the record's own `_save`)."""
        self.record._save()

    def list_nodes(self, timeout: float = 5.0) -> list[nodes_pb2.Node]:
        """The scheduler's nodes (PitstopError when it cannot be reached)."""
        with self.client(timeout=timeout, max_attempts=1) as client:
            return client.list_nodes()

    def wait_ready(
        self,
        node_ids: Iterable[str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        progress: Progress | None = None,
    ) -> list[nodes_pb2.Node]:
        """Wait until each node (all by default) is connected to the scheduler from its
        current agent (the inventory names its current checkpointd) and ready, and
        return them. ClusterStartError when a daemon exits or `timeout` passes."""
        return _wait_ready(self.record, node_ids, timeout, progress)

    # Schedulers

    def start_scheduler(self, name: str, *, timeout: float = DEFAULT_TIMEOUT) -> ClusterProcess:
        """Start the scheduler `name` again (after :meth:`kill_scheduler`, or a crash) on
        the port it had, with the stores it had; return it once it listens. Only from
        the object that brought the cluster up (it alone knows the store URLs);
        ClusterError when it runs or the cluster is down."""
        return _start_scheduler(self.spawner, name, timeout)

    def kill_scheduler(
        self, name: str, sig: signal.Signals = signal.SIGKILL, *, wait: bool = True
    ) -> None:
        """Signal the scheduler `name` (its process group); with `wait`, return once it
        is gone (ClusterError if it outlives KILL_WAIT s, or STOP_TIMEOUT s after
        another signal than SIGKILL)."""
        self.stopper.kill_scheduler(name, sig, wait=wait)

    def scheduler_metrics(self, name: str, timeout: float = 2.0) -> str:
        """The text of the scheduler's /metrics (ClusterError when it does not answer)."""
        return _scheduler_metrics(self.record, name, timeout)

    def leader(self, timeout: float = 2.0) -> str | None:
        """The name of the scheduler that holds the leader lease now, by its metrics
        (``pitstop_scheduler_leader 1.0``); None when no live one says so."""
        return _leader(self.record, timeout)

    def cut(self, node_id: str) -> None:
        """Cut the node off the network, its processes alive (needs ``--netns``)."""
        _cut(self.record, node_id)

    def heal(self, node_id: str) -> None:
        """Bring a node that was cut off back onto the network."""
        _heal(self.record, node_id)

    def cut_off(self) -> list[str]:
        """The nodes cut off now (none without ``--netns``)."""
        return _cut_off(self.record)

    def restart_node(
        self, node_id: str, *, wait: bool = True, timeout: float = DEFAULT_TIMEOUT
    ) -> list[ClusterProcess]:
        """Start a fresh checkpointd and agent for `node_id` (stopping whatever of the
        node still runs first, SIGTERM then SIGKILL); with `wait`, return once the
        scheduler sees the node ready from the new agent. Returns the new processes."""
        old = self.node_processes(node_id)
        stopping = self.kill_node(node_id, signal.SIGTERM, wait=False)
        if wait_gone(stopping, STOP_TIMEOUT, self.record._pid_alive):
            self.kill_node(node_id, signal.SIGKILL)
        self.record._forget_children([p.pid for p in old])
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
        new = _start_node(self, spec, deadline, timeout)
        if wait:
            self.wait_ready([node_id], timeout=max(deadline - time.monotonic(), 0.0))
        return new

    def kill_node(
        self, node_id: str, sig: signal.Signals = signal.SIGKILL, *, wait: bool = True
    ) -> list[int]:
        """Signal the node's agent, its checkpointd and its ranks, as a dying host would;
        see `ClusterStopper.kill_node`."""
        return self.stopper.kill_node(node_id, sig, wait=wait)

    def down(self, *, timeout: float = STOP_TIMEOUT, wipe: bool = False) -> list[ClusterProcess]:
        """Stop the whole cluster, agents first; see `ClusterStopper.down`."""
        return self.stopper.down(timeout=timeout, wipe=wipe)


def _start_all(
    cluster: LocalCluster,
    layout: list[NodeSpec],
    port: int,
    schedulers: int,
    netns: bool,
    deadline: float,
    say: Progress,
) -> None:
    """`up`'s work on the new `cluster`: its network namespaces (with `netns`), its
    schedulers, its nodes; returns once every node is ready."""
    assert cluster.record._scheduler_options is not None
    database_url, redis_url, liveness_timeout = cluster.record._scheduler_options
    if netns:
        say(f"creating {len(layout)} network namespaces")
        cluster.network = checked(lambda: create_network([spec.node_id for spec in layout]))
        cluster.record._save()
    say("starting the scheduler")
    cluster.spawner.start_scheduler(port, database_url, redis_url, liveness_timeout, deadline)
    for number in range(2, schedulers + 1):
        cluster.spawner.start_scheduler(
            0, database_url, redis_url, liveness_timeout, deadline, f"scheduler-{number}"
        )
    say(f"scheduler at {cluster.scheduler_target}; starting {len(layout)} nodes")
    cluster.spawner.start_nodes(layout, deadline)
    cluster.wait_ready(timeout=max(deadline - time.monotonic(), 0.0), progress=say)


def _start_node(
    cluster: LocalCluster, spec: NodeSpec, deadline: float, lock_wait: float
) -> list[ClusterProcess]:
    """`start_node`'s daemons, under the state dir's lock; whatever of them started is
    stopped again when one fails."""
    node_id = spec.node_id
    with locked(cluster.state_dir, wait=lock_wait):
        if cluster.record._closed or not cluster.state_file.exists():
            raise ClusterError(
                f"the cluster in {cluster.state_dir} is down; {node_id} is not started"
            )
        before = {p.pid for p in cluster.node_processes(node_id)}
        try:
            return cluster.spawner.start_nodes([spec], deadline)
        except BaseException:
            cluster.stopper.stop_processes(
                [p for p in cluster.node_processes(node_id) if p.pid not in before]
            )
            raise


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
    with locked(root, wait=LOCK_WAIT):
        strays = ClusterStopper(ClusterState(root, "", [], _closed=True)).stop_all(timeout)
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
