"""checkpointd configuration: defaults < config file (YAML) < PITSTOP_CHECKPOINTD_*
environment < flags."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from pitstop.common.settings import LayeredSettings, check_log_level, load_layered, log_level_number

ENV_PREFIX = "PITSTOP_CHECKPOINTD_"
DEFAULT_STATE_DIR = Path("/var/lib/pitstop/checkpointd")


def _check_address(what: str, value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {value!r}: use host:port, e.g. 10.0.0.5:50061")
    return value


class CheckpointdSettings(LayeredSettings):
    """Everything checkpointd reads at start. Every field is also
    PITSTOP_CHECKPOINTD_<NAME>."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    node_id: str = Field(default_factory=socket.gethostname, min_length=1, max_length=253)
    """Node id the scheduler knows this node by (default: the host name)."""
    scheduler: str = "127.0.0.1:50051"
    """host:port of the scheduler's gRPC API; empty: no catalog (static buddy only)."""
    token: str = Field(default="", repr=False)
    """Bearer token with the agent role, sent to the scheduler and the buddy and asked of
    every caller; empty when they run open."""
    tls_dir: Path | None = None
    """The node's identity (the agent's <state_dir>/tls, made when it enrolled): given,
    the daemon serves mutual TLS only (a node certificate of the cluster CA required of
    every caller: buddies, ranks, the agent) and presents it to the scheduler and peers."""
    join_token: str = Field(default="", repr=False)
    """A one-time join token: with tls_dir and no valid certificate there yet, the daemon
    enrolls the node with it at start (the agent, sharing tls_dir, then finds it
    enrolled). Better given as PITSTOP_CHECKPOINTD_JOIN_TOKEN than on the command line."""
    ca_file: Path | None = None
    """The cluster CA's certificate (the scheduler's tls/ca.crt), trusted to enroll;
    default: tls_dir/ca.crt."""
    host: str = "0.0.0.0"
    """Address to serve on: the buddy's daemon must reach it."""
    port: int = Field(default=50061, ge=0, le=65535)
    """Port to serve on; 0 picks a free one (printed at start)."""
    memory_budget_bytes: int = Field(default=0, ge=0)
    """Shared memory for snapshots and replicas; 0: half of /dev/shm."""
    state_dir: Path = DEFAULT_STATE_DIR
    durable_url: str = ""
    """fsspec URL of the durable store; default file://<state_dir>/durable."""
    buddy: str = ""
    """host:port of the buddy's checkpointd; empty: ask the scheduler."""
    flush_every_steps: int = Field(default=0, ge=0)
    """Flush durably when step % M == 0; 0: at the Young/Daly interval."""
    failures_per_hour: float = Field(default=0.1, ge=0)
    """The job's failure rate for the Young/Daly interval."""
    max_flush_every_steps: int = Field(default=10_000, ge=1)
    keep_in_memory: int = Field(default=2, ge=1)
    """Newest snapshots kept in memory per rank and tier."""
    keep_durable: int = Field(default=3, ge=1)
    """Newest durable checkpoints kept per job (of those this node wrote)."""
    durable_min_free_bytes: int = Field(default=1 << 30, ge=0)
    """A durable flush to a local filesystem that would leave less than this free is
    refused before it writes (reported, retried until there is room); 1 GiB: room for the
    logs and the spill files the node's other processes write there."""
    retry_max_seconds: float = Field(default=30.0, gt=0)
    """Longest wait between retries of a report, a push or a flush."""
    idle_report_seconds: float = Field(default=30.0, gt=0)
    """With snapshots held and nothing to report, how often the daemon asks the
    scheduler which of their jobs ended (their memory is freed then)."""
    log_level: str = "INFO"
    fault_hold_flush_at_step: int = Field(default=0, ge=0)
    """Fault injection for tests: hold the durable flush of this step after its shards
    and before its manifest, until the daemon stops. 0: never."""
    config_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("durable_url") in (None, ""):
            state_dir = Path(data.get("state_dir") or DEFAULT_STATE_DIR).absolute()
            data["durable_url"] = f"file://{state_dir}/durable"
        return data

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, value: str) -> str:
        return _check_address("scheduler", value) if value else value

    @field_validator("buddy")
    @classmethod
    def _buddy(cls, value: str) -> str:
        return _check_address("buddy", value) if value else value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        return check_log_level(value)

    @property
    def log_level_number(self) -> int:
        """The log level as a `logging` number."""
        return log_level_number(self.log_level)

    def budget_bytes(self, shm_dir: Path) -> int:
        """The memory budget: as configured, or half of `shm_dir`'s size."""
        if self.memory_budget_bytes:
            return self.memory_budget_bytes
        stat = os.statvfs(shm_dir)
        return stat.f_blocks * stat.f_frsize // 2


def load_settings(config_file: Path | None = None, **flags: Any) -> CheckpointdSettings:
    """Merge defaults, the YAML config file, PITSTOP_CHECKPOINTD_* variables and the
    flags given (flags win; a flag given as None is not given)."""
    return load_layered(CheckpointdSettings, config_file, flags)
