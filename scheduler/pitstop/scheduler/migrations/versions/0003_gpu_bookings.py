"""gpu bookings

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 16:30:06.274477
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpu_bookings",
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_gpu_bookings_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_gpu_bookings_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("node_id", "gpu_index", name=op.f("pk_gpu_bookings")),
    )
    op.create_index(op.f("ix_gpu_bookings_job_id"), "gpu_bookings", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_gpu_bookings_job_id"), table_name="gpu_bookings")
    op.drop_table("gpu_bookings")
