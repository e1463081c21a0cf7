"""Waiting for a local cluster's nodes: each connected to the scheduler from its current
agent and ready, or the reason why not (a daemon that exited, a node never registered,
one that came up unhealthy)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from pitstop.client.errors import PitstopError
from pitstop.client.localcluster.errors import ClusterStartError
from pitstop.client.localcluster.settings import DEFAULT_TIMEOUT
from pitstop.client.localcluster.statefile import ClusterState
from pitstop.v1 import common_pb2, nodes_pb2

Progress = Callable[[str], None]
_READY_POLL = 0.2
_UP_STATES = (
    common_pb2.NODE_STATE_READY,
    common_pb2.NODE_STATE_CORDONED,
    common_pb2.NODE_STATE_DRAINING,
)


def wait_ready(
    record: ClusterState,
    node_ids: Iterable[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Progress | None = None,
) -> list[nodes_pb2.Node]:
    """Wait until each node (all by default) is connected to the scheduler from its
    current agent (the inventory names its current checkpointd) and ready, and
    return them. ClusterStartError when a daemon exits or `timeout` passes."""
    wanted = (
        [record.node(n).node_id for n in node_ids]
        if node_ids is not None
        else [spec.node_id for spec in record.nodes]
    )
    addresses = {p.node_id: p.address for p in record.processes if p.kind == "checkpointd"}
    deadline = time.monotonic() + timeout
    seen: dict[str, nodes_pb2.Node] = {}
    last_error = ""
    shown = ""
    with record.client(timeout=2.0, max_attempts=1) as client:
        while True:
            check_alive(record, wanted)
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
                line = f"{len(ready)}/{len(wanted)} nodes ready; waiting for {', '.join(pending)}"
                if line != shown:
                    progress(line)
                    shown = line
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    _not_ready(record, wanted, seen, addresses, timeout, last_error)
                )
            time.sleep(_READY_POLL)


def check_alive(record: ClusterState, node_ids: Sequence[str]) -> None:
    """ClusterStartError when a daemon of `node_ids` has exited, or every scheduler."""
    # With several schedulers, one may be down (killed on purpose) while another serves.
    schedulers_down = not any(record.is_alive(p) for p in record.schedulers)
    for proc in record.processes:
        watched = schedulers_down if proc.kind == "scheduler" else proc.node_id in node_ids
        if watched and not record.is_alive(proc):
            child = record._children.get(proc.pid)
            code = "" if child is None else f" with code {child.returncode}"
            raise ClusterStartError(
                f"{proc.name} (pid {proc.pid}) exited{code}",
                proc.log,
                record._offsets.get(proc.name, 0),
            )


def _not_ready(
    record: ClusterState,
    wanted: Sequence[str],
    seen: Mapping[str, nodes_pb2.Node],
    addresses: Mapping[str, str],
    timeout: float,
    last_error: str,
) -> str:
    problems = []
    for node_id in wanted:
        node = seen.get(node_id)
        log = record.log_dir / f"agent-{node_id}.log"
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
            f"; the scheduler at {record.scheduler_address} did not answer ({last_error}); "
            f"read {record.log_dir / 'scheduler.log'}"
        )
    return message


def _is_up(node: nodes_pb2.Node, checkpointd_address: str) -> bool:
    """Connected from the agent started with our checkpointd, and healthy."""
    return (
        node.connected
        and node.state in _UP_STATES
        and (not checkpointd_address or node.inventory.checkpointd_address == checkpointd_address)
    )
