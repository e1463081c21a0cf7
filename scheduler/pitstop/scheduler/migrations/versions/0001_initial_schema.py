"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-21 15:53:06.213994
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column(
            "time", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("node_id", sa.String(length=253), nullable=True),
        sa.Column("from_state", sa.String(length=16), nullable=False),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("attributes", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_job_id"), "events", ["job_id"], unique=False)
    op.create_index(op.f("ix_events_node_id"), "events", ["node_id"], unique=False)
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("spec", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "pending",
                "placed",
                "starting",
                "running",
                "recovering",
                "paused",
                "succeeded",
                "failed",
                "cancelled",
                name="job_state",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("current_step", sa.BigInteger(), nullable=False),
        sa.Column("committed_step", sa.BigInteger(), nullable=False),
        sa.Column("durable_step", sa.BigInteger(), nullable=False),
        sa.Column("goodput", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("request_id", name=op.f("uq_jobs_request_id")),
    )
    op.create_index("ix_jobs_state_priority", "jobs", ["state", "priority"], unique=False)
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=253), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leases")),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(length=253), nullable=False),
        sa.Column("hostname", sa.String(length=253), nullable=False),
        sa.Column(
            "role",
            sa.Enum(
                "worker",
                "spare",
                name="node_role",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column(
            "state",
            sa.Enum(
                "ready",
                "cordoned",
                "draining",
                "unhealthy",
                "lost",
                name="node_state",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("zone", sa.String(length=128), nullable=False),
        sa.Column("block", sa.String(length=128), nullable=False),
        sa.Column("rack", sa.String(length=128), nullable=False),
        sa.Column("nvlink_domain", sa.String(length=128), nullable=False),
        sa.Column("driver_version", sa.String(length=64), nullable=False),
        sa.Column("gpu_backend", sa.String(length=16), nullable=False),
        sa.Column("agent_version", sa.String(length=64), nullable=False),
        sa.Column("checkpointd_address", sa.String(length=261), nullable=False),
        sa.Column("connected", sa.Boolean(), nullable=False),
        sa.Column("health", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "registered_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
    )
    op.create_index("ix_nodes_state_role", "nodes", ["state", "role"], unique=False)
    op.create_table(
        "rendezvous",
        sa.Column("run_id", sa.String(length=253), nullable=False),
        sa.Column("state", sa.LargeBinary(), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_rendezvous")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("committed", sa.Boolean(), nullable=False),
        sa.Column("durable", sa.Boolean(), nullable=False),
        sa.Column("manifest_url", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_checkpoints_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "step", name=op.f("pk_checkpoints")),
    )
    op.create_table(
        "gpus",
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("uuid", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("pci_bus_id", sa.String(length=32), nullable=False),
        sa.Column("fabric_cluster_uuid", sa.String(length=64), nullable=False),
        sa.Column("fabric_clique_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_gpus_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("node_id", "index", name=op.f("pk_gpus")),
        sa.UniqueConstraint("uuid", name=op.f("uq_gpus_uuid")),
    )
    op.create_table(
        "rank_assignments",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("local_rank", sa.Integer(), nullable=False),
        sa.Column("dp", sa.Integer(), nullable=False),
        sa.Column("pp", sa.Integer(), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_rank_assignments_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_rank_assignments_node_id_nodes")
        ),
        sa.PrimaryKeyConstraint("job_id", "generation", "rank", name=op.f("pk_rank_assignments")),
    )
    op.create_index(
        op.f("ix_rank_assignments_node_id"), "rank_assignments", ["node_id"], unique=False
    )
    op.create_table(
        "xid_events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=False),
        sa.Column("xid", sa.Integer(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("verdict", sa.String(length=16), nullable=False),
        sa.Column(
            "time", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_xid_events_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_xid_events")),
    )
    op.create_index("ix_xid_events_node_time", "xid_events", ["node_id", "time"], unique=False)
    op.create_table(
        "checkpoint_shards",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("checksum", sa.String(length=128), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id", "step"],
            ["checkpoints.job_id", "checkpoints.step"],
            name=op.f("fk_checkpoint_shards_job_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "job_id", "step", "rank", "node_id", name=op.f("pk_checkpoint_shards")
        ),
    )
    op.create_index("ix_checkpoint_shards_node", "checkpoint_shards", ["node_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_checkpoint_shards_node", table_name="checkpoint_shards")
    op.drop_table("checkpoint_shards")
    op.drop_index("ix_xid_events_node_time", table_name="xid_events")
    op.drop_table("xid_events")
    op.drop_index(op.f("ix_rank_assignments_node_id"), table_name="rank_assignments")
    op.drop_table("rank_assignments")
    op.drop_table("gpus")
    op.drop_table("checkpoints")
    op.drop_table("rendezvous")
    op.drop_index("ix_nodes_state_role", table_name="nodes")
    op.drop_table("nodes")
    op.drop_table("leases")
    op.drop_index("ix_jobs_state_priority", table_name="jobs")
    op.drop_table("jobs")
    op.drop_index(op.f("ix_events_node_id"), table_name="events")
    op.drop_index(op.f("ix_events_job_id"), table_name="events")
    op.drop_table("events")
