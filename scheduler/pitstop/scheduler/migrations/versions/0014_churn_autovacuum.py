"""churn autovacuum: the tables that take and drop rows every step vacuumed as they go

``checkpoints`` and ``checkpoint_shards`` take a row a step (a step per rank) and drop
it a few steps later; ``nodes``, ``gpu_bookings``, ``rank_assignments``, ``leases`` and
``rendezvous`` are updated as jobs and heartbeats come and go. PostgreSQL's default
autovacuum waits for 20% of a table's rows to be dead: these tables are small, so the
space their dead rows hold is reused only after they and their indexes have grown to a
multiple of their live size, and the database reaches its steady size half an hour
into a run. A fixed threshold of dead rows keeps them near their live size from the
first minutes (a vacuum of a table this small takes milliseconds).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 06:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

CHURNING = (
    "checkpoints",
    "checkpoint_shards",
    "nodes",
    "gpu_bookings",
    "rank_assignments",
    "leases",
    "rendezvous",
)
SETTINGS = {"autovacuum_vacuum_scale_factor": "0", "autovacuum_vacuum_threshold": "500"}


def upgrade() -> None:
    settings = ", ".join(f"{key} = {value}" for key, value in SETTINGS.items())
    for table in CHURNING:
        op.execute(f"ALTER TABLE {table} SET ({settings})")


def downgrade() -> None:
    for table in CHURNING:
        op.execute(f"ALTER TABLE {table} RESET ({', '.join(SETTINGS)})")
