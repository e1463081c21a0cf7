"""enrollment: one-time join tokens (hashed), node certificate revocation

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "join_tokens",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("node_id", sa.String(length=253), nullable=False, server_default=""),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("created_by", sa.String(length=128), nullable=False, server_default=""),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("used_by", sa.String(length=253), nullable=False, server_default=""),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_join_tokens")),
    )


def downgrade() -> None:
    op.drop_table("join_tokens")
    op.drop_column("nodes", "revoked_at")
