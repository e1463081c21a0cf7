"""Domain vocabulary shared by the database models, services and the wire conversion."""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any


class NodeRole(enum.StrEnum):
    WORKER = "worker"
    SPARE = "spare"


class NodeState(enum.StrEnum):
    READY = "ready"
    CORDONED = "cordoned"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    LOST = "lost"


class LossCause(enum.StrEnum):
    """How a node was lost, as the process that held its stream found it."""

    NONE = ""
    STREAM = "stream"
    """The stream ended and the host still answered: its agent is gone, the host is up."""
    SILENT = "silent"
    """Neither the stream nor the host answers: a dead host, a cut network; many of them
    at once is a partition (a mass loss), not many failures."""


class JobState(enum.StrEnum):
    PENDING = "pending"
    PLACED = "placed"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class Role(enum.IntEnum):
    """Caller roles, mirroring pitstop.v1.Role. Ordered: admin > operator > viewer."""

    UNSPECIFIED = 0
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3
    AGENT = 4
    PUBLIC = 5


def token_digest(token: str) -> str:
    """The hex SHA-256 of a secret token (surrounding whitespace ignored): all that is
    kept of a join token or an API token, and what a presented one is compared by."""
    return hashlib.sha256(token.strip().encode()).hexdigest()


ISSUABLE_ROLES = (Role.VIEWER, Role.OPERATOR, Role.ADMIN)
"""The roles an API token may be issued with: the agent role is a node certificate's."""


@dataclass(frozen=True)
class IssuedToken:
    """An issued API token as authorization needs it: never the token, only its hash."""

    name: str
    role: Role
    digest: str
    """Hex SHA-256 of the token."""
    expires_at: dt.datetime | None
    """None: it never expires."""
    projects: tuple[str, ...] = ()
    """The projects it may act in; empty: every project."""


@dataclass(frozen=True)
class GpuReport:
    """One GPU as a node's agent reports it when it registers."""

    index: int
    uuid: str
    name: str = ""
    memory_bytes: int = 0
    pci_bus_id: str = ""
    fabric_cluster_uuid: str = ""
    fabric_clique_id: int = 0


@dataclass(frozen=True)
class Registration:
    """What a node's agent says of its node when its stream opens (Register)."""

    node_id: str
    gpus: tuple[GpuReport, ...] = ()
    hostname: str = ""
    driver_version: str = ""
    gpu_backend: str = ""
    agent_version: str = ""
    checkpointd_address: str = ""
    zone: str = ""
    block: str = ""
    rack: str = ""
    nvlink_domain: str = ""
    role: NodeRole = NodeRole.WORKER
    """The role a node new to the scheduler takes (a known node keeps its own)."""
    agent_started_at: dt.datetime | None = None
    """When the agent process started; None if it did not say."""


class HealthVerdict(enum.StrEnum):
    """A node's health verdict, named as its stored health JSON names it."""

    UNSPECIFIED = "HEALTH_VERDICT_UNSPECIFIED"
    HEALTHY = "HEALTH_VERDICT_HEALTHY"
    APPLICATION = "HEALTH_VERDICT_APPLICATION"
    WARNING = "HEALTH_VERDICT_WARNING"
    FATAL = "HEALTH_VERDICT_FATAL"
    DEGRADED = "HEALTH_VERDICT_DEGRADED"


@dataclass(frozen=True)
class HealthReport:
    """A node's health as its agent's heartbeat reported it."""

    verdict: HealthVerdict | None
    """None: a verdict this scheduler does not know."""
    reasons: tuple[str, ...]
    document: dict[str, Any]
    """The whole report as the node keeps it (NodeHealth's JSON form)."""


@dataclass(frozen=True)
class XidReport:
    """An Xid a node's agent reported."""

    xid: int
    gpu_index: int
    gpu_uuid: str = ""
    message: str = ""
    source: str = "unspecified"
    """How the agent learned of it, a short lowercase word ("nvml_event")."""
    time: dt.datetime | None = None
    """When the driver reported it; None if the agent did not say."""


@dataclass(frozen=True, slots=True)
class ShardKey:
    """One rank's shard of one step of a job."""

    job_id: str
    step: int
    rank: int
    generation: int = 0


@dataclass(frozen=True, slots=True)
class ShardHeld:
    """A shard a checkpoint daemon holds (or, durable, wrote to the store)."""

    key: ShardKey
    tier: str
    """"local", "replica" or "durable"."""
    checksum: str = ""
    size_bytes: int = 0


@dataclass(frozen=True)
class ShardReport:
    """One checkpoint daemon's report of what changed in what it holds."""

    node_id: str
    added: tuple[ShardHeld, ...] = ()
    removed: tuple[ShardKey, ...] = ()
    removed_durable: tuple[ShardKey, ...] = ()
    flush_errors: tuple[str, ...] = ()
    fresh_start: bool = False
    """A new daemon: its memory starts empty."""


@dataclass(frozen=True)
class RestorePoint:
    """A job's committed and durable steps, its members, and where each rank's
    in-memory shard of one step lies."""

    committed_step: int
    durable_step: int
    member_node_ids: tuple[str, ...] = ()
    locations: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    """rank -> (node id, its checkpoint daemon's address) of each copy."""
