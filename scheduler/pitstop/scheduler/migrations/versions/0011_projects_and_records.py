"""projects, quotas, preemption and the experiment record

Jobs gain their project, when they last started running (a preemption's minimum run
time counts from it), how often they were preempted, who submitted them and the code
the submitting client saw; projects hold GPU quotas; API tokens may be limited to
projects; run_records keep what each generation of a job ran.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28 20:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("project", sa.String(63), nullable=False, server_default="default")
    )
    op.add_column("jobs", sa.Column("running_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "jobs", sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column(
        "jobs", sa.Column("submitted_by", sa.String(128), nullable=False, server_default="")
    )
    op.add_column(
        "jobs",
        sa.Column(
            "submitted_code",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            server_default=sa.text("'{}'::jsonb"),
        ),
    )
    op.create_index("ix_jobs_project", "jobs", ["project"])
    op.create_table(
        "projects",
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("gpu_quota", sa.Integer(), nullable=True),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("updated_by", sa.String(128), nullable=False, server_default=""),
        sa.CheckConstraint("gpu_quota >= 0", name=op.f("ck_projects_gpu_quota")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_projects")),
    )
    op.add_column(
        "api_tokens",
        sa.Column(
            "projects",
            postgresql.ARRAY(sa.String(63)),
            nullable=False,
            server_default=sa.text("'{}'::varchar[]"),
        ),
    )
    op.create_table(
        "run_records",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("node_id", sa.String(length=253), nullable=False),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_run_records_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "generation", name=op.f("pk_run_records")),
    )


def downgrade() -> None:
    op.drop_table("run_records")
    op.drop_column("api_tokens", "projects")
    op.drop_table("projects")
    op.drop_index("ix_jobs_project", table_name="jobs")
    for column in ("submitted_code", "submitted_by", "preemptions", "running_since", "project"):
        op.drop_column("jobs", column)
