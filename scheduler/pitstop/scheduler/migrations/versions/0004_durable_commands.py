"""durable recovery: per-node commands, restore step, deadlines

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 17:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("restore_step", sa.BigInteger(), nullable=False, server_default="0")
    )
    op.add_column("jobs", sa.Column("commands_after", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("deadline", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "node_commands",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("acked_generation", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("sends", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "decided_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_node_commands_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "node_id", name=op.f("pk_node_commands")),
    )


def downgrade() -> None:
    op.drop_table("node_commands")
    op.drop_column("jobs", "deadline")
    op.drop_column("jobs", "commands_after")
    op.drop_column("jobs", "restore_step")
