"""rank map deltas: a rank's row spans the generations it stays put in

A recovery moved the 8 ranks of one node and wrote every rank of the job again: 100,000
rows (and as many GPU bookings) inside the deciding transaction at full scale. A row now
holds a rank from since_generation up to, not including, until_generation (NULL: the
current generation), so a new generation closes the rows of the ranks that move and
adds their new ones.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 16:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.alter_column("rank_assignments", "generation", new_column_name="since_generation")
    op.add_column("rank_assignments", sa.Column("until_generation", sa.BigInteger(), nullable=True))
    # Every row so far held its rank for its one generation; the job's current one is open.
    op.execute(
        "UPDATE rank_assignments AS ra SET until_generation = ra.since_generation + 1"
        " FROM jobs AS j WHERE j.id = ra.job_id AND ra.since_generation < j.generation"
    )
    op.create_index(
        "ix_rank_assignments_current",
        "rank_assignments",
        ["job_id", "rank"],
        unique=True,
        postgresql_where=sa.text("until_generation IS NULL"),
    )


def downgrade() -> None:
    # One row per rank and generation again.
    op.execute(
        "CREATE TEMPORARY TABLE rank_rows AS SELECT ra.job_id, g AS generation, ra.rank,"
        " ra.node_id, ra.gpu_index, ra.local_rank, ra.dp, ra.pp, ra.tp"
        " FROM rank_assignments AS ra JOIN jobs AS j ON j.id = ra.job_id,"
        " generate_series(ra.since_generation,"
        " coalesce(ra.until_generation, j.generation + 1) - 1) AS g"
    )
    op.execute("DELETE FROM rank_assignments")
    op.drop_index("ix_rank_assignments_current", table_name="rank_assignments")
    op.drop_column("rank_assignments", "until_generation")
    op.alter_column("rank_assignments", "since_generation", new_column_name="generation")
    op.execute(
        "INSERT INTO rank_assignments (job_id, generation, rank, node_id, gpu_index,"
        " local_rank, dp, pp, tp) SELECT job_id, generation, rank, node_id, gpu_index,"
        " local_rank, dp, pp, tp FROM rank_rows"
    )
    op.execute("DROP TABLE rank_rows")
