"""A local pitstop cluster on this machine: one scheduler, and a checkpoint daemon and an
agent (simulated GPUs) per node, each a detached process with its log in the state dir.

The daemons are started through their console scripts, never imported, so this package
keeps to the client's side of the wire. Everything needed to find the processes again
(pids, logs, addresses) is written to ``<state dir>/cluster.json``: ``pitstop cluster
status`` and ``down`` run in a later process than ``up``. Every daemon also carries the
state dir in its environment (`CLUSTER_ENV`), and so does what it starts: ``down`` finds
a process that cluster.json never recorded.

>>> from pitstop.client.localcluster import LocalCluster
>>> with LocalCluster.up("/tmp/pc", nodes=2, spares=1, port=0) as cluster:  # doctest: +SKIP
...     cluster.kill_node("node-1")
...     cluster.restart_node("node-1")

The parts: `settings` (timeouts, the hung-node deadline, the daemons' environment),
`statefile` (cluster.json, its lock, and `ClusterState`, the record a cluster holds),
`processes` (/proc: pids, ranks, tags), `nodecommands` (each daemon's environment and
command line), `spawning` (`DaemonSpawner`: starts daemons, waits for their lines),
`stopping` (`ClusterStopper`), `readiness` (waiting for nodes), `schedulers`,
`cutoff` (network faults), `recorded` (what `LocalCluster` reads through to its record)
and `cluster` (`LocalCluster`, composed of those parts; `stop_cluster`,
`running_cluster`). Network namespaces are `pitstop.client.netns`; the fault driver of
the demo and the recovery benchmark is `pitstop.client.scenario`.
"""

from pitstop.client.localcluster.cluster import (
    LocalCluster,
    Progress,
    running_cluster,
    stop_cluster,
)
from pitstop.client.localcluster.errors import (
    ClusterAlreadyRunning,
    ClusterError,
    ClusterStartError,
    log_tail,
)
from pitstop.client.localcluster.nodecommands import binary
from pitstop.client.localcluster.processes import (
    TaggedProcess,
    holding_a_rank,
    pid_alive,
    rank_pids,
    start_ticks,
    tagged_processes,
)
from pitstop.client.localcluster.settings import (
    CHECKPOINTD_ENV,
    CHECKPOINTD_MEMORY_BUDGET_BYTES,
    CLUSTER_ENV,
    DAEMON_ENV,
    DEFAULT_LIVENESS_TIMEOUT,
    DEFAULT_PORT,
    DEFAULT_STATE_DIR,
    DEFAULT_TIMEOUT,
    HEARTBEAT_INTERVAL,
    KILL_WAIT,
    LOCK_FILE,
    LOCK_WAIT,
    SCHEDULER_ENV,
    STATE_FILE,
    STOP_TIMEOUT,
    silent_host_of,
)
from pitstop.client.localcluster.spawning import free_port
from pitstop.client.localcluster.statefile import (
    ClusterProcess,
    Kind,
    NodeSpec,
    Role,
    node_layout,
    wipe_state_dir,
)

__all__ = [
    "CHECKPOINTD_ENV",
    "CHECKPOINTD_MEMORY_BUDGET_BYTES",
    "CLUSTER_ENV",
    "DAEMON_ENV",
    "DEFAULT_LIVENESS_TIMEOUT",
    "DEFAULT_PORT",
    "DEFAULT_STATE_DIR",
    "DEFAULT_TIMEOUT",
    "HEARTBEAT_INTERVAL",
    "KILL_WAIT",
    "LOCK_FILE",
    "LOCK_WAIT",
    "SCHEDULER_ENV",
    "STATE_FILE",
    "STOP_TIMEOUT",
    "ClusterAlreadyRunning",
    "ClusterError",
    "ClusterProcess",
    "ClusterStartError",
    "Kind",
    "LocalCluster",
    "NodeSpec",
    "Progress",
    "Role",
    "TaggedProcess",
    "binary",
    "free_port",
    "holding_a_rank",
    "log_tail",
    "node_layout",
    "pid_alive",
    "rank_pids",
    "running_cluster",
    "silent_host_of",
    "start_ticks",
    "stop_cluster",
    "tagged_processes",
    "wipe_state_dir",
]
