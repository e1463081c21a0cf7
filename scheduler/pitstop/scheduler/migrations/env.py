"""Alembic environment: runs on the connection the scheduler hands it (see db.engine.migrate)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from pitstop.scheduler.db.models import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        # `alembic` run by hand: sqlalchemy.url comes from the ini or -x options.
        engine = engine_from_config(
            config.get_section(config.config_ini_section) or {},
            prefix="sqlalchemy.",
            poolclass=pool.NullPool,
        )
        with engine.connect() as conn:
            context.configure(connection=conn, target_metadata=target_metadata)
            with context.begin_transaction():
                context.run_migrations()
        return
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


run()
