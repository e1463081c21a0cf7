"""`LocalCluster`: bringing a local cluster up, waiting for its nodes, failing, cutting
off and restarting them, and bringing it down; `stop_cluster` and `running_cluster` for
whatever runs in a state dir."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pitstop.client.errors import PitstopError
from pitstop.client.localcluster.errors import (
    ClusterAlreadyRunning,
    ClusterError,
    ClusterStartError,
    checked,
)
from pitstop.client.localcluster.processes import (
    signal_group,
    tagged_processes,
    wait_gone,
)
from pitstop.client.localcluster.settings import (
    DEFAULT_PORT,
    DEFAULT_STATE_DIR,
    DEFAULT_TIMEOUT,
    KILL_WAIT,
    LOCK_WAIT,
    STATE_FILE,
    STOP_TIMEOUT,
    check_liveness,
)
from pitstop.client.localcluster.spawning import ClusterSpawning
from pitstop.client.localcluster.statefile import (
    ClusterProcess,
    locked,
    node_layout,
    wipe_state_dir,
)
from pitstop.client.localcluster.stopping import ClusterStopping
from pitstop.client.netns import Network, check_supported
from pitstop.client.netns import create as create_network
from pitstop.v1 import common_pb2, nodes_pb2

Progress = Callable[[str], None]
_LEADING = re.compile(r"^pitstop_scheduler_leader 1(\.0)?$", re.MULTILINE)
_READY_POLL = 0.2
_UP_STATES = (
    common_pb2.NODE_STATE_READY,
    common_pb2.NODE_STATE_CORDONED,
    common_pb2.NODE_STATE_DRAINING,
)


class LocalCluster(ClusterSpawning, ClusterStopping):
    """A running local cluster: its state dir, scheduler address, nodes and processes.

    Get one from :meth:`up` (starts it) or :meth:`load` (finds one that runs). Use it as
    a context manager to bring it :meth:`down` at the end of the block.
    """

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
        if liveness_timeout is not None:
            check_liveness(liveness_timeout)
        if schedulers < 1:
            raise ClusterError(f"schedulers={schedulers}: a cluster needs at least one")
        if schedulers > 1 and not (database_url and redis_url):
            raise ClusterError(
                f"schedulers={schedulers}: several schedulers share one PostgreSQL and one "
                "Redis; give database_url and redis_url (embedded stores are per process)"
            )
        if schedulers > 1 and not insecure:
            raise ClusterError(
                f"schedulers={schedulers}: a local cluster of several schedulers runs insecure "
                "only (each would need the CA and a node port of its own); ask for it with "
                "insecure=True"
            )
        say = progress or (lambda _message: None)
        if netns:
            checked(check_supported)
        with locked(root):
            earlier = cls.load(root)
            running = [] if earlier is None else earlier.running()
            recorded = {p.pid for p in running}
            running += [
                ClusterProcess.from_tagged(t, root / "logs")
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
            cluster = cls(
                root,
                "",
                layout,
                env=dict(env or {}),
                agent_owns_checkpointd=agent_owns_checkpointd,
                tls=not insecure,
            )
            cluster._scheduler_options = (database_url, redis_url, liveness_timeout)
            deadline = time.monotonic() + timeout
            try:
                if netns:
                    say(f"creating {len(layout)} network namespaces")
                    cluster.network = checked(
                        lambda: create_network([spec.node_id for spec in layout])
                    )
                    cluster._save()
                say("starting the scheduler")
                cluster._start_scheduler(port, database_url, redis_url, liveness_timeout, deadline)
                for number in range(2, schedulers + 1):
                    cluster._start_scheduler(
                        0,
                        database_url,
                        redis_url,
                        liveness_timeout,
                        deadline,
                        f"scheduler-{number}",
                    )
                say(f"scheduler at {cluster.scheduler_target}; starting {len(layout)} nodes")
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

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def list_nodes(self, timeout: float = 5.0) -> list[nodes_pb2.Node]:
        """The scheduler's nodes (PitstopError when it cannot be reached)."""
        with self.client(timeout=timeout, max_attempts=1) as client:
            return client.list_nodes()

    # Schedulers

    def start_scheduler(self, name: str, *, timeout: float = DEFAULT_TIMEOUT) -> ClusterProcess:
        """Start the scheduler `name` again (after :meth:`kill_scheduler`, or a crash) on
        the port it had, with the stores it had; return it once it listens. Only from
        the object that brought the cluster up (it alone knows the store URLs);
        ClusterError when it runs or the cluster is down."""
        port = int(self.process(name).address.rsplit(":", 1)[1])
        if self._scheduler_options is None:
            raise ClusterError(
                f"cannot restart {name}: only the process that brought the cluster up knows "
                "its store URLs"
            )
        database_url, redis_url, liveness_timeout = self._scheduler_options
        with locked(self.state_dir, wait=timeout):
            if self._closed or not self.state_file.exists():
                raise ClusterError(
                    f"the cluster in {self.state_dir} is down; {name} is not started"
                )
            return self._start_scheduler(
                port,
                database_url,
                redis_url,
                liveness_timeout,
                time.monotonic() + timeout,
                name,
            )

    def kill_scheduler(
        self, name: str, sig: signal.Signals = signal.SIGKILL, *, wait: bool = True
    ) -> None:
        """Signal the scheduler `name` (its process group); with `wait`, return once it
        is gone (ClusterError if it outlives KILL_WAIT s, or STOP_TIMEOUT s after
        another signal than SIGKILL)."""
        proc = self.process(name)
        if not self.is_alive(proc):
            return
        signal_group(proc.pid, sig)
        if wait:
            limit = KILL_WAIT if sig == signal.SIGKILL else STOP_TIMEOUT
            if wait_gone([proc.pid], limit, self._pid_alive):
                raise ClusterError(f"{name} (pid {proc.pid}) outlived {sig.name} by {limit:.0f} s")
        self._forget_children([proc.pid])

    def scheduler_metrics(self, name: str, timeout: float = 2.0) -> str:
        """The text of the scheduler's /metrics (ClusterError when it does not answer)."""
        proc = self.process(name)
        if not proc.metrics:
            raise ClusterError(f"{name} did not say where its metrics are (read {proc.log})")
        url = f"http://{proc.metrics}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return str(reply.read().decode())
        except OSError as exc:
            raise ClusterError(f"{name}: {url} did not answer: {exc}") from exc

    def leader(self, timeout: float = 2.0) -> str | None:
        """The name of the scheduler that holds the leader lease now, by its metrics
        (``pitstop_scheduler_leader 1.0``); None when no live one says so."""
        for proc in self.schedulers:
            if not self.is_alive(proc):
                continue
            with contextlib.suppress(ClusterError):
                if _LEADING.search(self.scheduler_metrics(proc.name, timeout)):
                    return proc.name
        return None

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
        with self.client(timeout=2.0, max_attempts=1) as client:
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

    def cut(self, node_id: str) -> None:
        """Cut the node off the network, its processes alive (needs ``--netns``)."""
        checked(lambda: self._network().cut(self.node(node_id).node_id))

    def heal(self, node_id: str) -> None:
        """Bring a node that was cut off back onto the network."""
        checked(lambda: self._network().heal(self.node(node_id).node_id))

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
        if wait_gone(stopping, STOP_TIMEOUT, self._pid_alive):
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
        with locked(self.state_dir, wait=timeout):
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

    def _check_alive(self, node_ids: Sequence[str]) -> None:
        # With several schedulers, one may be down (killed on purpose) while another serves.
        schedulers_down = not any(self.is_alive(p) for p in self.schedulers)
        for proc in self.processes:
            watched = schedulers_down if proc.kind == "scheduler" else proc.node_id in node_ids
            if watched and not self.is_alive(proc):
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


def _is_up(node: nodes_pb2.Node, checkpointd_address: str) -> bool:
    """Connected from the agent started with our checkpointd, and healthy."""
    return (
        node.connected
        and node.state in _UP_STATES
        and (not checkpointd_address or node.inventory.checkpointd_address == checkpointd_address)
    )


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
