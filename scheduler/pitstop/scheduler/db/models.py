"""The durable truth (docs/architecture.md, "Processes and wires"): nodes, GPUs, jobs,
rank maps, the checkpoint catalog, the append-only event log, Xid history, leases and
torchrun rendezvous state.

Never edit a released migration: change these models, then add a migration.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Enum,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.sql.elements import ColumnElement, SQLColumnExpression

from pitstop.scheduler.domain import JobState, NodeRole, NodeState

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

Timestamp = DateTime(timezone=True)


def _enum(cls: type[Any], name: str) -> Enum:
    # Stored as text with a CHECK constraint: adding a value is a plain migration.
    return Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda e: [m.value for m in e],
    )


NO_KEY_UPDATE: dict[str, Any] = {"key_share": True}
"""How a transaction locks a row it will change (``session.get(..., with_for_update=
NO_KEY_UPDATE)``): FOR NO KEY UPDATE. Inserting a row that references it (a shard of a
job, a command to a node) takes FOR KEY SHARE for the inserting transaction's whole
life; FOR UPDATE would queue a decision behind every such telemetry transaction in
flight, and them behind it. No transaction here changes a key."""


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    # Fetch server-side timestamps with RETURNING, so rows stay readable after commit.
    __mapper_args__ = {"eager_defaults": True}
    type_annotation_map = {dt.datetime: Timestamp, dict[str, Any]: JSONB}


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(253), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(253), default="")
    role: Mapped[NodeRole] = mapped_column(_enum(NodeRole, "node_role"), default=NodeRole.WORKER)
    state: Mapped[NodeState] = mapped_column(
        _enum(NodeState, "node_state"), default=NodeState.READY
    )
    reason: Mapped[str] = mapped_column(Text, default="")
    zone: Mapped[str] = mapped_column(String(128), default="")
    block: Mapped[str] = mapped_column(String(128), default="")
    rack: Mapped[str] = mapped_column(String(128), default="")
    nvlink_domain: Mapped[str] = mapped_column(String(128), default="")
    driver_version: Mapped[str] = mapped_column(String(64), default="")
    gpu_backend: Mapped[str] = mapped_column(String(16), default="")
    agent_version: Mapped[str] = mapped_column(String(64), default="")
    checkpointd_address: Mapped[str] = mapped_column(String(261), default="")
    connected: Mapped[bool] = mapped_column(Boolean, default=False)
    # Last health report as NodeHealth JSON; Redis holds the live copy.
    health: Mapped[dict[str, Any]] = mapped_column(default=dict)
    registered_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    updated_at: Mapped[dt.datetime] = mapped_column(server_default=func.now(), onupdate=func.now())
    last_seen_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # Start time of the agent process that last registered: a new value means the agent
    # restarted (after a repair or reboot), which is what clears UNHEALTHY.
    agent_started_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # Certificates issued to the node before this time are refused (`node revoke`);
    # re-joining with a new token issues one after it.
    revoked_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # When the node entered its state, and for a LOST one how it went (migration 0012):
    # LOSS_STREAM, its host still answered; LOSS_SILENT, neither it nor its network did.
    state_since: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    loss_cause: Mapped[str] = mapped_column(String(16), default="", server_default="")

    gpus: Mapped[list[Gpu]] = relationship(
        back_populates="node", order_by="Gpu.index", cascade="all, delete-orphan"
    )

    __table_args__ = (Index("ix_nodes_state_role", "state", "role"),)


class Gpu(Base):
    __tablename__ = "gpus"

    node_id: Mapped[str] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    pci_bus_id: Mapped[str] = mapped_column(String(32), default="")
    fabric_cluster_uuid: Mapped[str] = mapped_column(String(64), default="")
    fabric_clique_id: Mapped[int] = mapped_column(BigInteger, default=0)

    node: Mapped[Node] = relationship(back_populates="gpus")


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    # The accepted JobSpec, defaults filled in, as protobuf JSON.
    spec: Mapped[dict[str, Any]]
    state: Mapped[JobState] = mapped_column(_enum(JobState, "job_state"))
    reason: Mapped[str] = mapped_column(Text, default="")
    priority: Mapped[int] = mapped_column(Integer, default=0)
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    current_step: Mapped[int] = mapped_column(BigInteger, default=0)
    committed_step: Mapped[int] = mapped_column(BigInteger, default=0)
    durable_step: Mapped[int] = mapped_column(BigInteger, default=0)
    # What the current generation restores from (the deciding transaction chose it).
    restore_step: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The current generation's commands go out from then on (a restart's backoff).
    commands_after: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # When the start or recovery in flight is given up for a full restart: stored with
    # the decision, so whichever process leads next keeps the same deadline.
    deadline: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # Goodput account (seconds by category) and results the ranks reported.
    goodput: Mapped[dict[str, Any]] = mapped_column(default=dict)
    result: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # What its integrity checks did: {"skipped_steps": [...]} (migration 0009).
    integrity: Mapped[dict[str, Any]] = mapped_column(
        default=dict, server_default=text("'{}'::jsonb")
    )
    # Its project (quota and token scope), when it last started running (a preemption's
    # minimum run time counts from then), times preempted, its submitter and the code
    # the submitting client saw (migration 0011).
    project: Mapped[str] = mapped_column(String(63), default="default", server_default="default")
    running_since: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    submitted_by: Mapped[str] = mapped_column(String(128), default="", server_default="")
    submitted_code: Mapped[dict[str, Any]] = mapped_column(
        default=dict, server_default=text("'{}'::jsonb")
    )
    # When the decision that wrote the current generation's commands committed (its
    # nodes that keep their place have no row of that generation: see node_commands).
    decided_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # Since when the job is held through a mass loss (nodes lost all at once: a
    # partition): nothing of it is replaced or restarted meanwhile (migration 0012).
    held_since: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # Idempotency key of the Submit that created the job.
    request_id: Mapped[str | None] = mapped_column(String(128), unique=True, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    updated_at: Mapped[dt.datetime] = mapped_column(server_default=func.now(), onupdate=func.now())

    __table_args__ = (
        Index("ix_jobs_state_priority", "state", "priority"),
        Index("ix_jobs_project", "project"),
    )


class Project(Base):
    """A project's GPU quota (None: unlimited). A project without a row has none; jobs
    name their project in the spec (migration 0011)."""

    __tablename__ = "projects"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    gpu_quota: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    updated_by: Mapped[str] = mapped_column(String(128), default="", server_default="")

    __table_args__ = (CheckConstraint("gpu_quota >= 0", name="gpu_quota"),)


class RunRecord(Base):
    """What one generation of a job ran (code, environment, data digest), as its rank 0
    reported it: a RunRecord message as protobuf JSON (migration 0011)."""

    __tablename__ = "run_records"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    node_id: Mapped[str] = mapped_column(String(253))
    body: Mapped[dict[str, Any]]
    recorded_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())


class RankAssignment(Base):
    """Where a rank of a job runs, from generation `since_generation` up to, not
    including, `until_generation` (None: the job's current generation). A new map is a
    new generation; it closes the rows of the ranks that move and adds their new ones, so
    a recovery writes the failed node's ranks, not the whole map (migration 0008)."""

    __tablename__ = "rank_assignments"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    since_generation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    until_generation: Mapped[int | None] = mapped_column(BigInteger)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    gpu_index: Mapped[int] = mapped_column(Integer)
    local_rank: Mapped[int] = mapped_column(Integer)
    dp: Mapped[int] = mapped_column(Integer)
    pp: Mapped[int] = mapped_column(Integer)
    tp: Mapped[int] = mapped_column(Integer)

    __table_args__ = (
        Index(
            "ix_rank_assignments_current",
            "job_id",
            "rank",
            unique=True,
            postgresql_where=text("until_generation IS NULL"),
        ),
    )

    @classmethod
    def current(cls) -> ColumnElement[bool]:
        """Rows of their job's current generation."""
        return cls.until_generation.is_(None)

    @classmethod
    def in_generation(cls, generation: int | SQLColumnExpression[int]) -> ColumnElement[bool]:
        """Rows of their job's generation `generation` (current or past)."""
        return (cls.since_generation <= generation) & (
            cls.until_generation.is_(None) | (cls.until_generation > generation)
        )


class NodeCommand(Base):
    """Desired state per node of a job: what the node must do to run the job's current
    generation, and the newest generation it acknowledged. The leader re-sends every
    command not yet acknowledged, each tick, until the generation changes again."""

    __tablename__ = "node_commands"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node_id: Mapped[str] = mapped_column(String(253), primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger)
    # start | adopt | reconfigure | leave (see pitstop.scheduler.reconcile.commands)
    action: Mapped[str] = mapped_column(String(16))
    acked_generation: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    sends: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    sent_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # When the decision that wrote this row committed its transaction (PostgreSQL's now()).
    decided_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())


class GpuBooking(Base):
    """A GPU held by a live job. The primary key makes a double booking impossible, even
    for two schedulers that both believe they lead."""

    __tablename__ = "gpu_bookings"

    node_id: Mapped[str] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)


class Checkpoint(Base):
    """One step of a job in the catalog: committed once every rank has it on two nodes."""

    __tablename__ = "checkpoints"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger)
    committed: Mapped[bool] = mapped_column(Boolean, default=False)
    durable: Mapped[bool] = mapped_column(Boolean, default=False)
    # URL of the durable manifest, written last; empty until the flush completes.
    manifest_url: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())


class CheckpointShard(Base):
    """A rank's shard at a step, on one node (in memory) or in the durable store."""

    __tablename__ = "checkpoint_shards"

    job_id: Mapped[str] = mapped_column(primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Node id holding it in memory, or "" for the durable copy.
    node_id: Mapped[str] = mapped_column(String(253), primary_key=True)
    tier: Mapped[str] = mapped_column(String(16))
    checksum: Mapped[str] = mapped_column(String(128))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())

    __table_args__ = (
        ForeignKeyConstraint(
            ["job_id", "step"], ["checkpoints.job_id", "checkpoints.step"], ondelete="CASCADE"
        ),
        Index("ix_checkpoint_shards_node", "node_id"),
    )


class KeptCheckpoint(Base):
    """A durable checkpoint of an ended job, as its record lists it. Retention moves an
    ended job's whole durable checkpoints here and deletes its catalog rows: the
    catalog's tables churn a row a step, and an ended job's few kept rows left among
    them would each pin an index page of its own for good."""

    __tablename__ = "kept_checkpoints"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    shards: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)


class Event(Base):
    """Append-only: every state change, its cause and its actor."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    time: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    kind: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    node_id: Mapped[str | None] = mapped_column(String(253), nullable=True, index=True)
    from_state: Mapped[str] = mapped_column(String(16), default="")
    to_state: Mapped[str] = mapped_column(String(16), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    actor: Mapped[str] = mapped_column(String(128), default="")
    attributes: Mapped[dict[str, Any]] = mapped_column(default=dict)


class XidRecord(Base):
    """Xid history per node (``pitstop node show``)."""

    __tablename__ = "xid_events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    gpu_index: Mapped[int] = mapped_column(Integer)
    gpu_uuid: Mapped[str] = mapped_column(String(64), default="")
    xid: Mapped[int] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text, default="")
    source: Mapped[str] = mapped_column(String(16), default="")
    verdict: Mapped[str] = mapped_column(String(16), default="")
    time: Mapped[dt.datetime] = mapped_column(server_default=func.now())

    __table_args__ = (Index("ix_xid_events_node_time", "node_id", "time"),)


class RankStack(Base):
    """The Python stacks of one rank of a job that hung (``pitstop job stacks``), one row
    per rank and hang incident (the id of its job.hang event)."""

    __tablename__ = "rank_stacks"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    incident: Mapped[int] = mapped_column(BigInteger)
    generation: Mapped[int] = mapped_column(BigInteger)
    rank: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(String(253))
    method: Mapped[str] = mapped_column(String(16), default="")
    text: Mapped[str] = mapped_column(Text, default="")
    error: Mapped[str] = mapped_column(Text, default="")
    time: Mapped[dt.datetime] = mapped_column(server_default=func.now())

    __table_args__ = (Index("ix_rank_stacks_job_incident", "job_id", "incident"),)


class JoinToken(Base):
    """A one-time join token, kept as its SHA-256 only: the token itself is shown once."""

    __tablename__ = "join_tokens"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The only node id it enrolls; "" for any one node.
    node_id: Mapped[str] = mapped_column(String(253), default="")
    expires_at: Mapped[dt.datetime]
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128), default="")
    used_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    used_by: Mapped[str] = mapped_column(String(253), default="")


class ApiToken(Base):
    """A bearer token issued to a person or a script (`pitstop token create --role`), kept
    as its SHA-256 only: the token itself is shown once. Rows are never deleted, so a
    revoked token's name stays taken and its history stays readable."""

    __tablename__ = "api_tokens"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    # viewer, operator or admin: the agent role is a node certificate's, never issued.
    role: Mapped[str] = mapped_column(String(16))
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    created_by: Mapped[str] = mapped_column(String(128), default="")
    # None: it never expires.
    expires_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    revoked_by: Mapped[str] = mapped_column(String(128), default="")
    # Projects it may act in; empty: every project (migration 0011).
    projects: Mapped[list[str]] = mapped_column(
        ARRAY(String(63)), default=list, server_default=text("'{}'::varchar[]")
    )

    __table_args__ = (CheckConstraint("role IN ('viewer', 'operator', 'admin')", name="role"),)


class Lease(Base):
    """A leased role (the deciding leader). ``token`` only grows: the fencing token."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(253))
    token: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[dt.datetime]


class RendezvousState(Base):
    """torchrun rendezvous state under compare-and-set tokens."""

    __tablename__ = "rendezvous"

    run_id: Mapped[str] = mapped_column(String(253), primary_key=True)
    state: Mapped[bytes] = mapped_column(LargeBinary)
    token: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[dt.datetime] = mapped_column(server_default=func.now(), onupdate=func.now())


class SlurmDrain(Base):
    """The Slurm adapter's work on one failed node (pitstop.scheduler.slurm): the drain it
    wants Slurm to show, when Slurm was first seen showing it, and the replacement
    allocation asked for in the node's place. The row lives while the node stays
    unhealthy or lost; the name is written before the request is made, so a restarted
    or new leader finds a request in flight by it and never asks twice."""

    __tablename__ = "slurm_drains"

    node_id: Mapped[str] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    slurm_node: Mapped[str] = mapped_column(String(253))
    # The reason the node is drained with in Slurm ("pitstop: lost: ...").
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())
    # When Slurm was first seen showing the node drained; None: the drain is re-sent.
    drained_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # The replacement allocation's Slurm job name ("" until one is wanted) and id ("" until
    # Slurm has accepted it).
    replacement_job_name: Mapped[str] = mapped_column(String(128), default="", server_default="")
    replacement_job_id: Mapped[str] = mapped_column(String(32), default="", server_default="")
    replacement_requested_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    # The node was lost as its Slurm allocation ended (no running job on it, or one the
    # recipe marked ending): no failure, nothing to drain while this row lives.
    allocation_ended: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
