"""mass loss and bounded decisions: node state times and loss causes, held jobs, decision times

A node records when it entered its state and, when LOST, whether its host still answered
(``loss_cause`` "stream": the agent went away from a live host) or not ("silent": the host
or its network is gone, which many nodes at once is a partition). A job held through a
mass loss records since when, and every job when the decision that wrote its current
commands committed (node_commands keeps rows only for the nodes whose command is not a
reconfigure: a recovery writes a few rows, not the job's every node).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "nodes",
        sa.Column(
            "state_since", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.add_column(
        "nodes", sa.Column("loss_cause", sa.String(16), nullable=False, server_default="")
    )
    op.add_column("jobs", sa.Column("held_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "decided_at")
    op.drop_column("jobs", "held_since")
    op.drop_column("nodes", "loss_cause")
    op.drop_column("nodes", "state_since")
