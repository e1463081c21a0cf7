"""kept checkpoints: an ended job's durable checkpoints, moved out of the catalog

Retention moves an ended job's whole durable checkpoints (step, digest, shard count,
bytes: what its record lists) into ``kept_checkpoints`` and deletes all its rows in
``checkpoints`` and ``checkpoint_shards``. Those tables take and drop a row a step per
rank; the few rows an ended job kept among them each pinned an index page of their own
(a B-tree page is freed only when empty), and the indexes grew with every job run.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 23:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kept_checkpoints",
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("shards", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_kept_checkpoints_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "step", name=op.f("pk_kept_checkpoints")),
    )


def downgrade() -> None:
    op.drop_table("kept_checkpoints")
