"""The async engine and session factory, and the schema migration run at start."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

log = logging.getLogger(__name__)
logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# Any constant works; it only has to be the same for every scheduler process.
MIGRATION_LOCK_ID = 0x7069747374


def psycopg_url(url: str) -> str:
    """Normalise a postgresql:// URL to SQLAlchemy's psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(
            f"database URL {parsed.render_as_string(hide_password=True)!r} is not PostgreSQL; "
            "pitstop stores its state in PostgreSQL only (postgresql://user@host:5432/db)"
        )
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same URL as plain psycopg (libpq) takes it, without SQLAlchemy's driver name."""
    return (
        make_url(psycopg_url(url))
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )


IDLE_IN_TRANSACTION_SECONDS = 30
"""A transaction left open this long (its process frozen: SIGSTOP, a debugger) is ended
by PostgreSQL, so the locks it holds cannot stall a new leader for ever."""


def create_engine_for(url: str, pool_size: int = 10) -> AsyncEngine:
    """An async engine that checks connections before use, so a restarted PostgreSQL heals."""
    return create_async_engine(
        psycopg_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_timeout=5,
        connect_args={
            "connect_timeout": 3,
            "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_SECONDS}s",
        },
    )


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def migrate(url: str) -> None:
    """Bring the schema to head under an advisory lock, so concurrent schedulers migrate once."""
    engine = create_engine(psycopg_url(url), poolclass=None)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:id)"), {"id": MIGRATION_LOCK_ID})
            try:
                cfg = Config()
                cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
                conn.commit()
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": MIGRATION_LOCK_ID})
                conn.commit()
    finally:
        engine.dispose()
