"""Real schedulers for tests: one served from a thread of the test process
(`SchedulerThread`, on `scheduler_settings`), or a `pitstop-scheduler` process
(`SchedulerProcess`, `tls_scheduler`) a test can kill -9 and start again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc

from kit.ports import free_port
from kit.processes import terminate
from kit.stores import StoreUrls, unique
from kit.streams import AgentStream
from pitstop.client.launch import clean_env, scheduler_command
from pitstop.common.tls import channel_options
from pitstop.scheduler.config import SchedulerSettings
from pitstop.scheduler.server import Scheduler, start_scheduler


class SchedulerThread:
    """A real scheduler served from its own event loop in a background thread, so sync
    tests (the CLI, grpc stubs) and async tests can both talk to it."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.scheduler: Scheduler = self._call(start_scheduler(settings), timeout=120)
        self._channels: list[grpc.Channel] = []
        self._open_streams: list[AgentStream] = []

    def _call(self, coro: Any, timeout: float = 30) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    @property
    def address(self) -> str:
        return self.scheduler.address

    def channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address)
        self._channels.append(channel)
        return channel

    def open_stream(self, node_id: str, gpus: int = 8, **labels: Any) -> AgentStream:
        """An agent stream that stays open until the scheduler stops. `labels`: zone,
        block, rack (z1, b1, r1), role (worker) and the exits it reports again."""
        stream = AgentStream(self.channel(), node_id, gpus, **labels)
        self._open_streams.append(stream)
        return stream

    def register_node(self, node_id: str, gpus: int = 8, **labels: str) -> None:
        """Make a node exist the way production does: an agent stream sends Register. The
        stream stays open until the scheduler stops, so the node stays connected (the
        session scheduler's heartbeat interval is long enough that none is needed)."""
        self.open_stream(node_id, gpus, **labels)

    @contextlib.contextmanager
    def agent_stream(self, node_id: str, gpus: int = 8, **labels: str) -> Iterator[AgentStream]:
        """An agent stream closed when the block ends."""
        stream = AgentStream(self.channel(), node_id, gpus, **labels)
        try:
            yield stream
        finally:
            stream.close()

    def stop(self) -> None:
        self._call(self.scheduler.stop(grace=1.0), timeout=60)
        for stream in self._open_streams:
            stream.close()
        for channel in self._channels:
            channel.close()
        # What the server left (a Watch handler still streaming, say) ends on this loop
        # now: a coroutine collected later, on another thread, fails its test.
        self._call(cancel_leftover_tasks(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def cancel_leftover_tasks() -> None:
    """Cancel every task of the running loop but this one, wait for them to end, and
    close the async generators left open."""
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in leftover:
        task.cancel()
    await asyncio.gather(*leftover, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()  # a Watch's generator, say


def hand_driven_leader(
    stores: StoreUrls,
    tmp_path: Path,
    *,
    database: str | None = None,
    prefix: str | None = None,
    **overrides: Any,
) -> SchedulerThread:
    """A leading scheduler in a thread, on a database and Redis prefix of its own (fresh
    ones unless given), for tests that drive agent streams by hand: those send no
    heartbeats, so no node's deadline may expire meanwhile."""
    return SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path / unique("scheduler"),
            database_url=database or stores.fresh_database(),
            redis_prefix=prefix or f"{stores.redis_prefix}{unique('leader')}:",
            leader_loops=True,
            heartbeat_interval_seconds=60.0,
            liveness_startup_grace_seconds=60.0,
            **overrides,
        )
    )


AGENTS_LIVENESS_INTERVALS = 5.0
"""Heartbeats a real agent may miss before it is lost (2.5 s at 0.5 s a beat; at 1.25 s
a node was declared lost in a CI run while its agent started four ranks on the loaded
2-core machine)."""


def agents_leader(
    stores: StoreUrls, tmp_path: Path, name: str, **overrides: Any
) -> SchedulerThread:
    """A leading scheduler in a thread, on a database and Redis prefix of its own, for
    real agents: heartbeats every 0.5 s, AGENTS_LIVENESS_INTERVALS of them, no start-up
    grace; `overrides`: any other setting."""
    return SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path / "scheduler",
            database_url=stores.fresh_database(),
            redis_prefix=f"{stores.redis_prefix}{unique(name)}:",
            leader_loops=True,
            heartbeat_interval_seconds=0.5,
            liveness_timeout_intervals=AGENTS_LIVENESS_INTERVALS,
            liveness_startup_grace_seconds=0.0,
            **overrides,
        )
    )


def scheduler_settings(stores: StoreUrls, state_dir: Path, **overrides: Any) -> SchedulerSettings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "state_dir": state_dir,
        "database_url": stores.database_url,
        "redis_url": stores.redis_url,
        "redis_prefix": stores.redis_prefix,
        "shutdown_grace_seconds": 1.0,
        # A host on this machine answers the probe of an ended stream within a
        # millisecond; the fleet default (1 s, a keepalive interval) would hold every
        # stream a test ends, and a node with no address to ask, that long.
        "loss_probe_seconds": 0.2,
        # Exact counts of telemetry are asserted: a test machine this busy must not have
        # the process shed it (test_load_shedding sets its own).
        "shed_lag_seconds": 5.0,
        # Deciding loops only where a test asks for them, on a database of its own.
        "leader_loops": False,
        "metrics_port": None,
        "dashboard_port": None,
        **overrides,
    }
    return SchedulerSettings(**values)


def tls_scheduler(stores: StoreUrls, root: Path, tokens: list[dict[str, str]]) -> SchedulerProcess:
    """A scheduler process with TLS on (its CA made in its state directory), a database
    of its own, both ports picked free, and these API tokens."""
    env = clean_env(
        PITSTOP_DATABASE_URL=stores.fresh_database(),
        PITSTOP_REDIS_URL=stores.redis_url,
        PITSTOP_REDIS_PREFIX=f"{stores.redis_prefix}{unique('tls')}:",
        PITSTOP_TLS="true",
        PITSTOP_NODE_PORT="0",
        PITSTOP_TOKENS=json.dumps(tokens),
        GRPC_VERBOSITY="NONE",
    )
    return SchedulerProcess(root, "scheduler", env)


class SchedulerProcess:
    """A `pitstop-scheduler` process, configured by `env` (PITSTOP_* settings), that a
    test can kill -9 and start again on the same port. Its stderr goes to
    ``root/<name>.log``."""

    def __init__(self, root: Path, name: str, env: dict[str, str], port: int = 0) -> None:
        self.root, self.name, self.env, self.port = root, name, env, port
        self.metrics_port = free_port()
        self.log = root / f"{name}.log"
        self._channels: list[grpc.Channel] = []
        self.start()

    def start(self) -> None:
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                scheduler_command(
                    state_dir=self.root / self.name,
                    port=self.port,
                    metrics_port=self.metrics_port,
                    dashboard_port=0,
                ),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, self.log.read_text()
        self.address = line.rsplit(" ", 1)[1].strip()
        self.port = int(self.address.rsplit(":", 1)[1])  # a restart reuses it
        self.node_address = ""
        if self.env.get("PITSTOP_TLS", "").lower() in ("1", "true"):
            line = self.proc.stdout.readline()
            assert "nodes connect on" in line, self.log.read_text()
            self.node_address = line.rsplit(" ", 1)[1].strip()

    @property
    def ca(self) -> Path | None:
        """The cluster CA's certificate, when the scheduler runs with TLS."""
        if not self.node_address:
            return None
        shared = self.env.get("PITSTOP_TLS_DIR")
        return (Path(shared) if shared else self.root / self.name / "tls") / "ca.crt"

    def channel(self) -> grpc.Channel:
        """A channel to the API: server TLS checked against the cluster CA when it is on."""
        if self.ca is None:
            channel = grpc.insecure_channel(self.address)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes())
            channel = grpc.secure_channel(self.address, credentials, options=channel_options())
        self._channels.append(channel)
        return channel

    def leading(self) -> bool:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        return "pitstop_scheduler_leader 1.0" in text

    def kill(self) -> None:
        """kill -9: no shutdown, no lease given back, streams cut."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, and SIGKILL after 30 s: a scheduler that will not stop is not left
        running after the test."""
        terminate(self.proc)
        for channel in self._channels:
            channel.close()
