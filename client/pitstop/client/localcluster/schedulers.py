"""A local cluster's schedulers: starting one again, asking one for its /metrics, and
which one leads."""

from __future__ import annotations

import contextlib
import re
import time
import urllib.request

from pitstop.client.localcluster.errors import ClusterError
from pitstop.client.localcluster.spawning import DaemonSpawner
from pitstop.client.localcluster.statefile import ClusterProcess, ClusterState, locked

_LEADING = re.compile(r"^pitstop_scheduler_leader 1(\.0)?$", re.MULTILINE)


def scheduler_metrics(record: ClusterState, name: str, timeout: float = 2.0) -> str:
    """The text of the scheduler's /metrics (ClusterError when it does not answer)."""
    proc = record.process(name)
    if not proc.metrics:
        raise ClusterError(f"{name} did not say where its metrics are (read {proc.log})")
    url = f"http://{proc.metrics}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return str(reply.read().decode())
    except OSError as exc:
        raise ClusterError(f"{name}: {url} did not answer: {exc}") from exc


def leader(record: ClusterState, timeout: float = 2.0) -> str | None:
    """The name of the scheduler that holds the leader lease now, by its metrics
    (``pitstop_scheduler_leader 1.0``); None when no live one says so."""
    for proc in record.schedulers:
        if not record.is_alive(proc):
            continue
        with contextlib.suppress(ClusterError):
            if _LEADING.search(scheduler_metrics(record, proc.name, timeout)):
                return proc.name
    return None


def start_scheduler(spawner: DaemonSpawner, name: str, timeout: float) -> ClusterProcess:
    """Start the scheduler `name` again on the port it had, with the stores it had;
    see `LocalCluster.start_scheduler`."""
    record = spawner.record
    port = int(record.process(name).address.rsplit(":", 1)[1])
    if record._scheduler_options is None:
        raise ClusterError(
            f"cannot restart {name}: only the process that brought the cluster up knows "
            "its store URLs"
        )
    database_url, redis_url, liveness_timeout = record._scheduler_options
    with locked(record.state_dir, wait=timeout):
        if record._closed or not record.state_file.exists():
            raise ClusterError(f"the cluster in {record.state_dir} is down; {name} is not started")
        return spawner.start_scheduler(
            port, database_url, redis_url, liveness_timeout, time.monotonic() + timeout, name
        )
