"""rank stacks: the Python stacks of a hung job's ranks, per hang incident

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 18:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rank_stacks",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("incident", sa.BigInteger(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("method", sa.String(length=16), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_rank_stacks_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rank_stacks")),
    )
    op.create_index("ix_rank_stacks_job_incident", "rank_stacks", ["job_id", "incident"])


def downgrade() -> None:
    op.drop_index("ix_rank_stacks_job_incident", table_name="rank_stacks")
    op.drop_table("rank_stacks")
