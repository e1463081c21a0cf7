"""`pitstop-agent install`: the systemd unit and the example configuration.

The files checked in under deploy/ are exactly what this writes for prefix "/" with the
agent at DEFAULT_EXECUTABLE; a test keeps them identical.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

UNIT_PATH = Path("etc/systemd/system/pitstop-agent.service")
CONFIG_PATH = Path("etc/pitstop/agent.yaml")
CONFIG_FILE = "/" + CONFIG_PATH.as_posix()
ENV_PATH = Path("etc/pitstop/agent.env")
ENV_FILE = "/" + ENV_PATH.as_posix()
DEFAULT_EXECUTABLE = "/usr/local/bin/pitstop-agent"

_UNIT = """\
[Unit]
Description=pitstop agent: GPU health, heartbeats and rank supervision
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
# The node's enrollment (pitstop-agent install --join-token ...): the join token and
# the cluster CA, kept out of the unit and the config, readable by root only.
EnvironmentFile=-{env_file}
ExecStart={executable} run --config {config}
# Stop: SIGTERM to the agent only; it stops its ranks itself (SIGTERM, then SIGKILL
# after their grace) and exits. Whatever is left after TimeoutStopSec gets SIGKILL.
KillMode=mixed
TimeoutStopSec=30
Restart=always
RestartSec=1
# Exit code 2 is a bad configuration: restarting cannot fix it.
RestartPreventExitStatus=2
StateDirectory=pitstop/agent
Environment=PYTHONUNBUFFERED=1
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""

EXAMPLE_CONFIG = """\
# pitstop agent configuration.
#
# Every setting is optional; the value shown is the default. Each one can also be set
# as an environment variable PITSTOP_AGENT_<NAME> (e.g. PITSTOP_AGENT_SCHEDULER) or as
# a flag of `pitstop-agent run`. Flags win over the environment, the environment wins
# over this file.

# Node id the scheduler knows this node by. Default: the host name.
# node_id: gpu-node-017

# host:port of the scheduler's gRPC API.
# scheduler: 127.0.0.1:50051

# Bearer token with the agent role; empty when the scheduler runs without tokens.
# Better kept out of this file: set PITSTOP_AGENT_TOKEN in a systemd drop-in.
# token: ""

# Mutual TLS with this node's certificate (kept in <state_dir>/tls); the scheduler runs
# with tls, and the agent connects to its node port, learned when it enrolled.
# tls: false

# One-time join token the node enrolls with when it has no valid certificate yet (an
# admin makes one: pitstop token create --node-id ...). Better kept out of this file:
# set PITSTOP_AGENT_JOIN_TOKEN.
# join_token: ""

# The cluster CA's certificate (the scheduler's tls/ca.crt), trusted when enrolling.
# Unset, it is <state_dir>/tls/ca.crt, where enrollment keeps it.
# ca_file: null

# GPU backend: nvml for this node's NVIDIA GPUs, sim:N for N simulated GPUs.
# gpus: nvml

# Failure-domain labels. Placement spreads data-parallel replicas over them and picks
# the nearest spare (same rack, then block, then zone).
# zone: ""
# block: ""
# rack: ""
# nvlink_domain: ""

# Role asked for at the node's first registration: worker or spare. Afterwards the
# scheduler's record wins (change it with `pitstop node set-role`).
# role: worker

# Seconds between looks at the node (health, step times) until the scheduler sets the
# interval at registration. A heartbeat goes out when what it says changed, and at
# least every refresh interval the scheduler gives.
# heartbeat_interval_seconds: 1.0

# The agent pings its scheduler stream this often (HTTP/2 PING, answered in gRPC's core)
# and drops a stream whose ping is not answered within keepalive_timeout_seconds: a
# scheduler host gone silent is left within both, and the agent reconnects.
# keepalive_seconds: 2.0
# keepalive_timeout_seconds: 2.0

# Where the agent keeps its socket and the ranks' logs.
# state_dir: /var/lib/pitstop/agent

# Unix socket the ranks talk to. Default: <state_dir>/agent.sock.
# socket_path: /var/lib/pitstop/agent/agent.sock

# Address of /metrics (Prometheus) and /healthz. Port 0 picks a free port.
# metrics_host: 127.0.0.1
# metrics_port: 9400

# host:port of this node's checkpoint daemon, reported to the scheduler and probed
# every checkpointd_probe_seconds. While it does not answer the node reports itself
# degraded (verdict WARNING, a reason naming the daemon): the scheduler drains it.
# checkpointd_address: ""

# Command line that starts this node's checkpoint daemon listening on
# checkpointd_address, e.g. "pitstop-checkpointd run --config /etc/pitstop/checkpointd.yaml"
# (split as a shell would; no shell runs it). Given, the agent owns the daemon: starts
# it, restarts it with backoff when it exits or hangs, stops it when the agent stops;
# its output goes to <state_dir>/checkpointd.log. Empty: the daemon runs on its own
# (its own systemd unit) and is only probed.
# checkpointd_command: ""

# Seconds between probes of the checkpoint daemon, and unanswered probes in a row that
# make it down.
# checkpointd_probe_seconds: 1.0
# checkpointd_probe_misses: 3

# An owned checkpoint daemon that has not answered for this many seconds while its
# process lives is killed and started again (one still starting gets at least 60 s).
# checkpointd_hang_seconds: 30.0

# Host name or IP the other nodes reach this node's ranks at (e.g. 10.0.3.17): a job
# whose rank 0 runs here meets at this host. Empty: the host name. Set it when the host
# name resolves to loopback or to a network the other nodes cannot reach.
# advertise_host: ""

# A node that runs no ranks checks itself this often, seconds (and at the agent's
# start): GPU health, a small matrix product on each GPU checked against its known
# result. A failed preflight quarantines the node until it passes and is uncordoned.
# preflight_interval_seconds: 300.0

# Where this node's ranks and standby processes are forked from. auto: the agent's own
# fork server (its zygote), which imports fork_preload once (never initialising CUDA)
# and is started again when it dies; a rank forked from it starts in milliseconds, not
# the seconds a fresh interpreter spends importing torch. off: every process starts as
# a fresh interpreter (for scripts that cannot be forked). A path: the Unix socket of a
# fork server already running (python -m pitstop.agent.forkserver --socket PATH
# --preload torch), which the agents of one host may share. A server forks only what
# starts the same as in a fresh interpreter; anything else (and anything while it is
# not serving yet) starts as a fresh process.
# fork_server: auto
# fork_preload: torch,pitstop.trainer

# The host around the GPUs (docs/host-health.md): InfiniBand/RoCE ports, the host's
# memory (OOM kills, pressure, EDAC), the daemons' disks and the PCIe devices of the GPUs
# and NICs, judged every heartbeat. auto: the simulated host with sim:N GPUs, the real
# one (sysfs: /sys, /proc and /dev/kmsg, which needs root or CAP_SYSLOG) with nvml; off:
# not read. A link down or a fatal PCIe or memory error replaces the node; a flap, link
# errors, a slower link or a degraded PCIe link drain it at the next committed step; a
# full or read-only disk and memory pressure are reported.
# host_backend: auto

# Links that count, as shell patterns over their names (mlx5_0/1 is a port, eth0 an
# interface): others are neither read nor judged. The default takes every InfiniBand
# and RoCE port and no Ethernet interface, so a management NIC never drains the node.
# host_links: ["*/*"]

# Paths whose filesystems are watched (room, inodes, read-only): the checkpoint daemon's
# durable and spill paths. Empty: state_dir.
# host_disk_paths: []

# Verdict thresholds. Counters are judged by their growth over the window: a link that
# went down flap_downs times in it flapped; errors, correctable PCIe errors and
# corrected memory errors warn at their growth below. Memory pressure is PSI's "full"
# avg10 in percent. A disk is low under either free share or free bytes.
# host_flap_window_seconds: 60.0
# host_flap_downs: 3
# host_link_error_growth: 100
# host_pcie_correctable_growth: 100
# host_edac_corrected_growth: 100
# host_memory_pressure_percent: 20.0
# host_disk_free_fraction: 0.05
# host_disk_free_bytes: 10737418240

# DEBUG, INFO, WARNING, ERROR or CRITICAL.
# log_level: INFO

# Accept injected faults (drills, tests). Default: true for sim:N GPUs, false for nvml.
# allow_fault_injection: false

# Longest wait, in seconds, between attempts to reach the scheduler.
# reconnect_max_seconds: 2.0

# Kubernetes (the Helm chart turns these on). Publish the node's health on its Node
# object, as the condition PitstopNodeProblem (False when healthy; True, reason
# PitstopDegraded, PitstopWarning or PitstopFatal, with the reasons as its message;
# Unknown after 3 periods without a verdict) and, with kubernetes_taints, the taint
# pitstop.io/node-problem (PreferNoSchedule while degraded, NoSchedule on a warning or a
# fatal verdict, none when healthy), re-applied every kubernetes_publish_seconds and
# within a second of a new verdict. Needs the kubernetes extra and a service account
# that may get and patch nodes and nodes/status.
# kubernetes_node_conditions: false
# kubernetes_taints: true

# The Node this agent runs on. Empty: node_id.
# kubernetes_node_name: ""
# kubernetes_publish_seconds: 10.0

# At start, fill zone, block, rack and nvlink_domain (those not given) from the Node's
# labels, each from the first of its label keys below that the node carries.
# kubernetes_topology_labels: false
# kubernetes_zone_labels: [topology.kubernetes.io/zone]
# kubernetes_block_labels: [cloud.google.com/gce-topology-block, \
topology.k8s.aws/network-node-layer-2, cloud.provider.com/topology-block]
# kubernetes_rack_labels: [cloud.google.com/gce-topology-subblock, \
topology.k8s.aws/network-node-layer-3, cloud.provider.com/topology-rack]
# kubernetes_nvlink_domain_labels: [nvidia.com/gpu.clique]
"""


def render_unit(executable: str = DEFAULT_EXECUTABLE) -> str:
    """The systemd unit that runs `executable` with the installed configuration."""
    return _UNIT.format(executable=executable, config=CONFIG_FILE, env_file=ENV_FILE)


def current_executable() -> str:
    """Path of the running `pitstop-agent`, else the one on PATH, else the bare name."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "pitstop-agent" and os.access(argv0, os.X_OK):
        return str(argv0.absolute())
    return shutil.which("pitstop-agent") or "pitstop-agent"


@dataclass
class InstallResult:
    """What `install` wrote, and what it left alone because it already existed."""

    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Enrollment:
    """How the node enrolls at its first start: mutual TLS with a certificate got for a
    one-time join token, checking the scheduler against the cluster CA."""

    join_token: str
    ca_file: Path
    scheduler: str = ""
    """host:port of the scheduler's API; "": the config's."""

    def environment(self) -> str:
        lines = [
            "PITSTOP_AGENT_TLS=true",
            f"PITSTOP_AGENT_JOIN_TOKEN={self.join_token}",
            f"PITSTOP_AGENT_CA_FILE={self.ca_file}",
        ]
        if self.scheduler:
            lines.append(f"PITSTOP_AGENT_SCHEDULER={self.scheduler}")
        return "\n".join(lines) + "\n"


def install(
    prefix: Path, executable: str = DEFAULT_EXECUTABLE, enrollment: Enrollment | None = None
) -> InstallResult:
    """Write the unit (always: it belongs to the package) and the example configuration
    (only when none exists: it belongs to the operator) under `prefix`; with
    `enrollment`, the environment file that enrolls the node (mode 0600, replaced: a
    join token works once)."""
    result = InstallResult()
    unit = prefix / UNIT_PATH
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(render_unit(executable))
    result.written.append(unit)
    config = prefix / CONFIG_PATH
    config.parent.mkdir(parents=True, exist_ok=True)
    try:
        with config.open("x") as out:  # "x": never replace an operator's file
            out.write(EXAMPLE_CONFIG)
    except FileExistsError:
        result.kept.append(config)
    else:
        result.written.append(config)
    if enrollment is not None:
        env = prefix / ENV_PATH
        partial = env.with_suffix(".env.partial")
        partial.unlink(missing_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(enrollment.environment())
        os.replace(partial, env)
        result.written.append(env)
    return result
