"""slurm drains: the Slurm adapter's drain and replacement request per failed node

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "slurm_drains",
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("slurm_node", sa.String(length=253), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("drained_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("replacement_job_name", sa.String(length=128), nullable=False, server_default=""),
        sa.Column("replacement_job_id", sa.String(length=32), nullable=False, server_default=""),
        sa.Column("replacement_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("allocation_ended", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_slurm_drains_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_slurm_drains")),
    )


def downgrade() -> None:
    op.drop_table("slurm_drains")
