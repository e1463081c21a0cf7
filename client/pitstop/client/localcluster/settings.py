"""The local cluster's defaults: timeouts, the hung-node deadline, the environment its
daemons get, and the tags that let `down` find every process a cluster started."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pitstop.client.localcluster.errors import ClusterError

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
ADMIN_TOKEN_FILE = "admin.token"
"""The local cluster's admin API token (mode 0600), in its state dir, with TLS on."""
JOIN_TOKEN_TTL_SECONDS = 600
"""How long the join token each node of a local cluster enrolls with lasts."""
LOCK_FILE = "cluster.lock"
CHECKPOINTD_MEMORY_BUDGET_BYTES = 256 << 20
HEARTBEAT_INTERVAL = 0.25
"""Seconds between an agent's heartbeats in the local cluster."""
DEFAULT_LIVENESS_TIMEOUT = 2.0
"""Seconds without a heartbeat before the scheduler declares a node lost. Only a hung
agent (stopped, its stream open) waits for it: a dead agent's stream breaks and its node
is lost at once. 1.25 s (2.5 beats of 0.5 s) declared healthy nodes lost while two busy
processes shared a 2-core machine with the cluster, when a starved scheduler's late
scan still counted against the nodes; it no longer does (the scan forgives its own
stalls), and 8 beats leave room for an agent's."""
CLUSTER_ENV = "PITSTOP_LOCAL_CLUSTER"
"""In every daemon's environment: the cluster's state dir. What a daemon starts (ranks,
embedded stores) inherits it, so `down` finds every process the cluster started, even
one that cluster.json does not name (an `up` killed between starting it and writing)."""
DAEMON_ENV = "PITSTOP_LOCAL_CLUSTER_DAEMON"
"""In every daemon's environment: its name, e.g. ``agent-node-1``."""

# Settings the daemons read from the environment, for a small, quick local cluster.
# Variables already in the environment win (the liveness deadline: unless `up` is given
# one).
HEARTBEAT_ENV = "PITSTOP_HEARTBEAT_INTERVAL_SECONDS"
REFRESH_ENV = "PITSTOP_REFRESH_INTERVAL_SECONDS"
LIVENESS_ENV = "PITSTOP_LIVENESS_TIMEOUT_INTERVALS"
KEEPALIVE_ENV = "PITSTOP_KEEPALIVE_SECONDS"
KEEPALIVE_TIMEOUT_ENV = "PITSTOP_KEEPALIVE_TIMEOUT_SECONDS"
KEEPALIVE_SECONDS = 0.5
"""Seconds between the scheduler's pings on each agent stream of a local cluster, and
how long one may go unanswered: a host gone silent (frozen, cut off; no TCP reset) is
lost within their sum, 1 s. A fleet's scheduler keeps its defaults of 1 s and 1 s: at
thousands of nodes on two shared cores a starved process missed 1 s timeouts (see
docs/scale.md); a handful of nodes sends a few pings a second."""
SCHEDULER_KEEPALIVE_DEFAULT = "1"  # the scheduler's keepalive_seconds and _timeout_, unset
# A handful of nodes: every look is a heartbeat (the scheduler's default refresh of 5 s
# is for fleets), so the liveness deadline stays that of the heartbeats.
SCHEDULER_ENV = {
    HEARTBEAT_ENV: f"{HEARTBEAT_INTERVAL:g}",
    REFRESH_ENV: f"{HEARTBEAT_INTERVAL:g}",
    LIVENESS_ENV: f"{DEFAULT_LIVENESS_TIMEOUT / HEARTBEAT_INTERVAL:g}",
    KEEPALIVE_ENV: f"{KEEPALIVE_SECONDS:g}",
    KEEPALIVE_TIMEOUT_ENV: f"{KEEPALIVE_SECONDS:g}",
    "PITSTOP_LIVENESS_STARTUP_GRACE_SECONDS": "0",
    # Steps reported at every look too: a handful of nodes, a dashboard to watch.
    "PITSTOP_STEP_REPORT_INTERVAL_SECONDS": f"{HEARTBEAT_INTERVAL:g}",
}
MIN_LIVENESS_INTERVALS = 1.5  # the scheduler's own floor
SCHEDULER_REFRESH_DEFAULT = "5"  # the scheduler's refresh_interval_seconds, unset
CHECKPOINTD_ENV = {
    "PITSTOP_CHECKPOINTD_MEMORY_BUDGET_BYTES": str(CHECKPOINTD_MEMORY_BUDGET_BYTES),
    "PITSTOP_CHECKPOINTD_RETRY_MAX_SECONDS": "0.5",
}


def check_liveness(seconds: float) -> None:
    floor = MIN_LIVENESS_INTERVALS * HEARTBEAT_INTERVAL
    if not seconds >= floor:
        raise ClusterError(
            f"liveness timeout {seconds:g} s: give at least {floor:g} s "
            f"({MIN_LIVENESS_INTERVALS:g} heartbeats of {HEARTBEAT_INTERVAL:g} s)"
        )


def silent_host_of(env: Mapping[str, str]) -> float:
    """Seconds after which a scheduler started with `env` has lost a host gone silent at
    the latest: one keepalive interval, then the ping's timeout."""
    try:
        return float(env.get(KEEPALIVE_ENV, SCHEDULER_KEEPALIVE_DEFAULT)) + float(
            env.get(KEEPALIVE_TIMEOUT_ENV, SCHEDULER_KEEPALIVE_DEFAULT)
        )
    except ValueError:
        raise ClusterError(
            f"{KEEPALIVE_ENV}={env.get(KEEPALIVE_ENV)!r} and "
            f"{KEEPALIVE_TIMEOUT_ENV}={env.get(KEEPALIVE_TIMEOUT_ENV)!r}: give numbers"
        ) from None


def liveness_of(env: Mapping[str, str]) -> float:
    """The liveness deadline a scheduler started with `env` uses, in seconds."""
    try:
        beat = float(env[HEARTBEAT_ENV])
        refresh = float(env.get(REFRESH_ENV, SCHEDULER_REFRESH_DEFAULT))
        return max(refresh, beat) * float(env[LIVENESS_ENV])
    except (KeyError, ValueError):
        raise ClusterError(
            f"{HEARTBEAT_ENV}={env.get(HEARTBEAT_ENV)!r}, "
            f"{REFRESH_ENV}={env.get(REFRESH_ENV)!r} and "
            f"{LIVENESS_ENV}={env.get(LIVENESS_ENV)!r}: give numbers"
        ) from None


def check_up_options(
    liveness_timeout: float | None,
    schedulers: int,
    database_url: str | None,
    redis_url: str | None,
    insecure: bool,
) -> None:
    """ClusterError when `LocalCluster.up` is asked for what it cannot start."""
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
