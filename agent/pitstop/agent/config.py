"""Agent configuration: defaults < config file (YAML) < PITSTOP_AGENT_* environment < flags."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from pitstop.agent.gpu import MAX_SIMULATED_GPUS
from pitstop.common.settings import LayeredSettings, check_log_level, load_layered, log_level_number

ENV_PREFIX = "PITSTOP_AGENT_"
DEFAULT_STATE_DIR = Path("/var/lib/pitstop/agent")
SOCKET_NAME = "agent.sock"

# Node labels that name a failure domain, most common first: the well-known zone label;
# GKE's, EKS's and Kueue's topology labels for blocks and racks (sub-blocks, network
# node layers); NVIDIA GPU feature discovery's NVLink clique.
ZONE_LABELS = ("topology.kubernetes.io/zone",)
BLOCK_LABELS = (
    "cloud.google.com/gce-topology-block",
    "topology.k8s.aws/network-node-layer-2",
    "cloud.provider.com/topology-block",
)
RACK_LABELS = (
    "cloud.google.com/gce-topology-subblock",
    "topology.k8s.aws/network-node-layer-3",
    "cloud.provider.com/topology-rack",
)
NVLINK_DOMAIN_LABELS = ("nvidia.com/gpu.clique",)


def check_gpus_spec(spec: str) -> str:
    """Return `spec`, normalised, if it names a GPU backend ("nvml" or "sim:N"); raise
    ValueError otherwise."""
    kind, sep, count = spec.strip().partition(":")
    if kind == "nvml" and not sep:
        return "nvml"
    if kind == "sim" and count.isdecimal() and 1 <= int(count) <= MAX_SIMULATED_GPUS:
        return f"sim:{int(count)}"
    raise ValueError(
        f"{spec!r} is no GPU backend: use nvml or sim:N with N from 1 to {MAX_SIMULATED_GPUS}"
    )


class AgentSettings(LayeredSettings):
    """Everything the agent reads at start. Every field is also PITSTOP_AGENT_<NAME>."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    node_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=253)
    """Node id the scheduler knows this node by (default: the host name)."""
    scheduler: str = Field(default="127.0.0.1:50051", min_length=1)
    """host:port of the scheduler's gRPC API."""
    token: str = Field(default="", repr=False)
    """Bearer token with the agent role; empty when the scheduler runs open (or with tls:
    the node's certificate is its credential)."""
    tls: bool = False
    """Mutual TLS to the scheduler with this node's certificate (`<state_dir>/tls`)."""
    join_token: str = Field(default="", repr=False)
    """One-time token to enroll with when the node has no valid certificate yet."""
    ca_file: Path | None = None
    """The cluster CA's certificate (the scheduler's tls/ca.crt), trusted to enroll."""
    gpus: str = "nvml"
    """GPU backend: "nvml" for the real GPUs, "sim:N" for N simulated ones."""
    zone: str = ""
    block: str = ""
    rack: str = ""
    nvlink_domain: str = ""
    role: Literal["worker", "spare"] = "worker"
    """Role asked for at the node's first registration; the scheduler's record wins later."""
    heartbeat_interval_seconds: float = Field(default=1.0, gt=0)
    """Used until the scheduler says otherwise in Registered."""
    keepalive_seconds: float = Field(default=2.0, ge=0.5)
    """The agent pings its scheduler stream this often (HTTP/2 PING, in gRPC's core)..."""
    keepalive_timeout_seconds: float = Field(default=2.0, gt=0)
    """...and a ping unanswered this long breaks the stream: a scheduler host gone silent
    (no TCP reset) is left within both, and the agent reconnects (to another scheduler
    process behind the same address, where there are several)."""
    state_dir: Path = DEFAULT_STATE_DIR
    socket_path: Path = DEFAULT_STATE_DIR / SOCKET_NAME
    """Unix socket for the ranks; default <state_dir>/agent.sock."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9400, ge=0, le=65535)
    """Port of /metrics and /healthz; 0 picks a free one (printed at start)."""
    checkpointd_address: str = ""
    """host:port of this node's checkpoint daemon, reported in the inventory and probed
    every `checkpointd_probe_seconds`: while it is down the node reports itself degraded."""
    checkpointd_command: str = ""
    """Command line that starts this node's checkpoint daemon listening on
    `checkpointd_address` (split as a shell would; no shell runs it). Given, the agent
    owns the daemon: starts it, restarts it with backoff when it exits or stops
    answering, and stops it when the agent stops. Empty: the daemon is someone else's
    (systemd, the local cluster) and is only probed."""
    checkpointd_probe_seconds: float = Field(default=1.0, gt=0)
    """Seconds between probes of the checkpoint daemon."""
    checkpointd_probe_misses: int = Field(default=3, ge=1)
    """Probes in a row the checkpoint daemon leaves unanswered before it counts as down."""
    checkpointd_hang_seconds: float = Field(default=30.0, gt=0)
    """An owned checkpoint daemon that has not answered for this long while its process
    lives is hung: the agent kills it and starts it again (one still starting gets at
    least 60 s)."""
    advertise_host: str = ""
    """Host name or IP the other nodes reach this node's ranks at: a job whose rank 0
    runs here meets at this host. Default: the host name (set it when the host name
    resolves to loopback or to the wrong network)."""
    preflight_interval_seconds: float = Field(default=300.0, gt=0)
    """A node that runs no ranks checks itself this often (and at the agent's start); a
    failed preflight keeps it from getting ranks (pitstop.agent.preflight)."""
    fork_server: Literal["auto", "off"] | Path = "auto"
    """Where this node's ranks and standby processes are forked from. `auto`: the
    agent's own fork server (its zygote, pitstop.agent.zygote), which imports
    `fork_preload` once and is started again when it dies; `off` (or null): each starts
    as a fresh interpreter; a path: the Unix socket of a fork server already running
    (`python -m pitstop.agent.forkserver`), which the agents of one host may share."""
    fork_preload: str = "torch,pitstop.trainer"
    """Comma-separated modules the agent's own fork server imports before it serves:
    what the node's training scripts import (a forked rank imports the rest itself)."""
    host_backend: Literal["auto", "sysfs", "sim", "off"] = "auto"
    """What reads the host around the GPUs (links, memory, disks, PCIe; see
    docs/host-health.md). `auto`: the simulated host with simulated GPUs, the real one
    (`sysfs`: /sys, /proc, /dev/kmsg) with NVML; `off`: the host is not read."""
    host_links: list[str] = Field(default_factory=lambda: ["*/*"])
    """Which links count (shell patterns over their names): a link that does not is
    neither read nor judged. Default: every InfiniBand/RoCE port ("mlx5_0/1") and no
    Ethernet interface, so a management NIC's flap never drains a node; name a training
    interface ("eth1", "ens*") to judge it too."""
    host_disk_paths: list[Path] = Field(default_factory=list)
    """The paths whose filesystems are watched for room, inodes and read-only: the
    checkpoint daemon's durable and spill paths. Empty: the state directory."""
    host_flap_window_seconds: float = Field(default=60.0, gt=0)
    host_flap_downs: int = Field(default=3, ge=1)
    host_link_error_growth: int = Field(default=100, ge=1)
    host_pcie_correctable_growth: int = Field(default=100, ge=1)
    host_edac_corrected_growth: int = Field(default=100, ge=1)
    host_memory_pressure_percent: float = Field(default=20.0, ge=0, le=100)
    host_disk_free_fraction: float = Field(default=0.05, ge=0, lt=1)
    host_disk_free_bytes: int = Field(default=10 << 30, ge=0)
    """The verdict thresholds (pitstop.health.host.HostThresholds, where each default
    says why; the table in docs/host-health.md)."""
    log_level: str = "INFO"
    allow_fault_injection: bool = False
    """Accept injected faults on the local socket; default true only for simulated GPUs."""
    reconnect_max_seconds: float = Field(default=2.0, gt=0)
    """Longest wait between attempts to reach the scheduler."""
    kubernetes_node_conditions: bool = False
    """Publish the node's health on its Kubernetes Node object: the condition
    `PitstopNodeProblem` and, with `kubernetes_taints`, the taint
    `pitstop.io/node-problem`, re-applied every `kubernetes_publish_seconds`, so other
    schedulers avoid a sick node. Needs the `kubernetes` extra and a service account
    allowed to get and patch nodes and nodes/status (the Helm chart's)."""
    kubernetes_taints: bool = True
    """With `kubernetes_node_conditions`: also taint the node (NoSchedule when a GPU is
    failing, PreferNoSchedule while a node daemon is down; none when healthy). Off where
    another controller (NVSentinel, a remediation operator) owns the node's taints."""
    kubernetes_node_name: str = ""
    """The Kubernetes Node this agent runs on; default: `node_id`."""
    kubernetes_publish_seconds: float = Field(default=10.0, gt=0)
    """Seconds between re-applications of the condition (and taint); a new verdict is
    published within a second."""
    kubernetes_topology_labels: bool = False
    """At start, read the Node's labels and fill `zone`, `block`, `rack` and
    `nvlink_domain` where they are not given: each from the first label of its list
    below that the node carries."""
    kubernetes_zone_labels: list[str] = Field(default_factory=lambda: list(ZONE_LABELS))
    kubernetes_block_labels: list[str] = Field(default_factory=lambda: list(BLOCK_LABELS))
    kubernetes_rack_labels: list[str] = Field(default_factory=lambda: list(RACK_LABELS))
    kubernetes_nvlink_domain_labels: list[str] = Field(
        default_factory=lambda: list(NVLINK_DOMAIN_LABELS)
    )
    config_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        # Defaults that depend on other fields, filled only where no source set them.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("socket_path") in (None, ""):
            data["socket_path"] = Path(data.get("state_dir") or DEFAULT_STATE_DIR) / SOCKET_NAME
        if "fork_server" in data and data["fork_server"] in (None, ""):
            data["fork_server"] = "off"
        if data.get("allow_fault_injection") in (None, ""):
            data["allow_fault_injection"] = str(data.get("gpus", "nvml")).startswith("sim")
        return data

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: str) -> str:
        return check_gpus_spec(value)

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        return check_log_level(value)

    @field_validator("checkpointd_address")
    @classmethod
    def _checkpointd_address(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if value and (not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536):
            raise ValueError(
                f"checkpointd_address {value!r}: use host:port, e.g. 127.0.0.1:7000, or leave "
                "it empty when the node runs no checkpoint daemon"
            )
        return value

    @field_validator("checkpointd_command")
    @classmethod
    def _checkpointd_command(cls, value: str) -> str:
        try:
            shlex.split(value)
        except ValueError as exc:
            raise ValueError(
                f"checkpointd_command {value!r} cannot be split into arguments ({exc}); "
                "balance its quotes"
            ) from None
        return value

    @model_validator(mode="after")
    def _owned_checkpointd_has_an_address(self) -> AgentSettings:
        if self.checkpointd_command.strip() and not self.checkpointd_address:
            raise ValueError(
                "checkpointd_command is given without checkpointd_address: give the "
                "host:port the command makes the daemon listen on, so the agent can probe it"
            )
        return self

    @property
    def checkpointd_argv(self) -> list[str]:
        """`checkpointd_command` split into arguments; empty when the daemon is external."""
        return shlex.split(self.checkpointd_command)

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536:
            raise ValueError(f"scheduler {value!r}: use host:port, e.g. 10.0.0.5:50051")
        return value

    @property
    def log_level_number(self) -> int:
        """The log level as a `logging` number."""
        return log_level_number(self.log_level)


def load_settings(config_file: Path | None = None, **flags: Any) -> AgentSettings:
    """Merge defaults, the YAML config file, PITSTOP_AGENT_* variables and the flags given
    (flags win; a flag given as None is not given)."""
    return load_layered(AgentSettings, config_file, flags)
