"""Fixtures of the fault matrix (tests/cluster/test_*.py): the fork servers its daemons
and ranks are forked from and the standalone hash, once for the whole matrix; the
cluster a scenario runs on (`cluster`, or `process_cluster` for scheduler processes the
test kills) and the fixtures a scenario parametrizes to shape it. The harness itself is
tests/kit/faultcluster.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit.faultcluster import (
    EXAMPLE,
    LIVENESS_INTERVALS,
    TIMEOUT,
    Cluster,
    ProcessCluster,
    full_filesystem,
    network_namespace,
)
from kit.forking import ForkClient, ForkServerProcess, forking
from kit.ports import free_port
from kit.schedulers import SchedulerProcess, SchedulerThread, scheduler_settings
from kit.stores import PostgresProcess, StoreUrls, unique
from pitstop.client.cpuload import cpu_load_from_env
from pitstop.client.launch import clean_env


@pytest.fixture(scope="module", autouse=True)
def cpu_load() -> Iterator[None]:
    """PITSTOP_TEST_CPU_LOAD=2 runs the fault matrix beside two busy processes, as on a
    user's loaded machine (see pitstop.client.cpuload); unset, nothing runs beside it."""
    with cpu_load_from_env():
        yield


@pytest.fixture(scope="session")
def fork_server() -> Iterator[Path]:
    """One fork server with torch imported for every agent of every scenario here: the
    ranks and standbys are forked, not each started afresh, which saves the matrix
    several CPU-seconds per process (it tests recoveries, not a cold start; the demo,
    the local cluster's tests and `bench/recovery.py` start them afresh)."""
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="pf-"))
    preload = "torch,torch.distributed,torch._dynamo,torch.optim,pitstop.trainer"
    try:
        with ForkServerProcess(folder / "fork.sock", preload, clean_env()) as server:
            yield server.socket_path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def rank_forks(fork_server: Path) -> Iterator[ForkClient]:
    """This test's own connection to the ranks' fork server (for ranks it starts itself)."""
    client = ForkClient(fork_server)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def daemon_forks() -> Iterator[ForkClient]:
    """A fork server with the agent and the checkpoint daemon imported, and this test's
    connection to it: every scenario starts five of each, forked rather than each
    importing gRPC, pydantic and the rest afresh (as for the ranks: a cluster's start is
    not what the matrix tests; the local cluster's tests start its daemons afresh)."""
    with forking("pitstop.agent.main,pitstop.checkpointd.main", clean_env()) as client:
        yield client


@pytest.fixture(scope="session")
def standalone_hash(rank_forks: ForkClient, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The example run alone in one process, forked from the ranks' fork server (torch
    imported: a fresh Python spent 4-5 CPU-seconds importing it): the hash every run
    must end with."""
    log = tmp_path_factory.mktemp("standalone") / "example.log"
    child = rank_forks.launch([*EXAMPLE, "--log-every", "0"], clean_env(), log)
    returncode = child.wait(TIMEOUT)
    output = log.read_text(errors="replace")
    assert returncode == 0, output[-3000:]
    said = re.findall(r'"final_weights_sha256": "([0-9a-f]{64})"', output)
    assert said, output[-3000:]
    return said[-1]


@pytest.fixture
def spares() -> int:
    """Spare nodes beside the four workers; a test parametrizes it for more."""
    return 1


@pytest.fixture
def full_durable_store() -> bool:
    """Whether the nodes flush to a durable store that is full; parametrized for it."""
    return False


@pytest.fixture
def tls() -> bool:
    """Whether the cluster runs with mutual TLS (nodes enrolled): the secure default, as
    `pitstop cluster up` runs; a test may parametrize it off."""
    return True


@pytest.fixture
def durable_every() -> int:
    """Steps between the durable flushes of a store every node shares (0: each node its
    own, and no flush within a test's run); parametrized for it."""
    return 0


@pytest.fixture
def netns_node() -> str:
    """The node that runs in a network namespace of its own, or several, comma-separated;
    "" for none."""
    return ""


@pytest.fixture
def scheduler_env() -> dict[str, str]:
    """Settings of the scheduler beyond the matrix's (a scenario's own thresholds)."""
    return {}


@pytest.fixture
def gpus() -> int:
    """Simulated GPUs on every node; the 3D job's tests parametrize it."""
    return 1


@pytest.fixture
def cluster(
    stores: StoreUrls,
    spares: int,
    full_durable_store: bool,
    netns_node: str,
    in_process: bool,
    gpus: int,
    durable_every: int,
    tls: bool,
    fork_server: Path,
    daemon_forks: ForkClient,
    scheduler_env: dict[str, str],
) -> Iterator[Cluster]:
    if full_durable_store and os.geteuid() != 0:
        pytest.skip("a full durable store is a tiny tmpfs: mounting it needs root")
    if netns_node and (os.geteuid() != 0 or shutil.which("ip") is None):
        pytest.skip("cutting a node off by its network namespace needs root and iproute2")
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="pr-"))  # short: the agent socket path
    prefix = f"{stores.redis_prefix}{unique('rec')}:"
    checkpointd_env, agent_env = {}, {}
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PITSTOP_E2E_KEEP"):
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        if full_durable_store:
            stack.enter_context(full_filesystem(root / "store"))
            checkpointd_env = {
                "PITSTOP_CHECKPOINTD_DURABLE_URL": f"file://{root / 'store' / 'durable'}",
                "PITSTOP_CHECKPOINTD_FLUSH_EVERY_STEPS": "5",
                # Room for a few flushes of the example is room enough, once it returns.
                "PITSTOP_CHECKPOINTD_DURABLE_MIN_FREE_BYTES": str(4 << 20),
            }
            # The agents watch the store's filesystem, a full one judged by its share
            # free (a whole tmpfs is smaller than the default 10 GiB floor).
            agent_env = {
                "PITSTOP_AGENT_HOST_DISK_PATHS": json.dumps([str(root / "store" / "durable")]),
                "PITSTOP_AGENT_HOST_DISK_FREE_BYTES": "0",
            }
        elif durable_every:
            checkpointd_env = {
                "PITSTOP_CHECKPOINTD_DURABLE_URL": f"file://{root / 'durable'}",
                "PITSTOP_CHECKPOINTD_FLUSH_EVERY_STEPS": str(durable_every),
            }
        network = stack.enter_context(network_namespace(netns_node)) if netns_node else None
        scheduler: SchedulerProcess | SchedulerThread
        if in_process:  # a test that patches the scheduler's code
            scheduler = SchedulerThread(
                scheduler_settings(
                    stores,
                    root / "scheduler",
                    database_url=stores.fresh_database(),
                    redis_prefix=prefix,
                    leader_loops=True,
                    heartbeat_interval_seconds=0.5,
                    step_report_interval_seconds=0.5,
                    liveness_timeout_intervals=LIVENESS_INTERVALS,
                    liveness_startup_grace_seconds=0.0,
                    host="0.0.0.0" if network else "127.0.0.1",
                )
            )
        else:
            # A process of its own, as deployed: the scheduler's event loop shares no
            # interpreter (and no GIL) with the test polling rank logs beside it.
            env = clean_env() | {
                "PITSTOP_DATABASE_URL": stores.fresh_database(),
                "PITSTOP_REDIS_URL": stores.redis_url,
                "PITSTOP_REDIS_PREFIX": prefix,
                "PITSTOP_HEARTBEAT_INTERVAL_SECONDS": "0.5",
                "PITSTOP_STEP_REPORT_INTERVAL_SECONDS": "0.5",
                "PITSTOP_LIVENESS_TIMEOUT_INTERVALS": str(LIVENESS_INTERVALS),
                "PITSTOP_LIVENESS_STARTUP_GRACE_SECONDS": "0",
                # Reachable from a node in a network namespace too.
                "PITSTOP_HOST": "0.0.0.0" if network else "127.0.0.1",
                "GRPC_VERBOSITY": "ERROR",
                **scheduler_env,
            }
            if tls:
                env |= {"PITSTOP_TLS": "true", "PITSTOP_NODE_PORT": "0"}
            scheduler = SchedulerProcess(root, "scheduler", env)
        stack.callback(scheduler.stop)
        built = Cluster(scheduler, root)
        built.fork_server = fork_server
        built.daemons = daemon_forks
        stack.callback(built.stop)  # also when a node fails to start
        built.start(spares, checkpointd_env, network, gpus, agent_env)
        built.redis_url, built.redis_prefix = stores.redis_url, prefix
        built.durable_url = checkpointd_env.get("PITSTOP_CHECKPOINTD_DURABLE_URL", "")
        yield built


@pytest.fixture
def in_process() -> bool:
    """Whether the scheduler runs as a thread of the test (to patch its code) rather than
    as its own process."""
    return False


@pytest.fixture
def standbys() -> int:
    """Standby scheduler processes beside the leader; the nodes talk to the last one."""
    return 0


@pytest.fixture
def own_postgres() -> bool:
    """Whether the schedulers use a PostgreSQL of the test's own, which it may restart."""
    return False


@pytest.fixture
def process_cluster(
    stores: StoreUrls,
    standbys: int,
    own_postgres: bool,
    fork_server: Path,
    daemon_forks: ForkClient,
) -> Iterator[ProcessCluster]:
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="pp-"))  # short: the agent socket path
    running = ProcessCluster(root)
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PITSTOP_E2E_KEEP"):
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        database = stores.fresh_database()
        if own_postgres:
            running.postgres = PostgresProcess(root / "pg")
            stack.callback(lambda: running.postgres.stop() if running.postgres else None)
            database = running.postgres.url
        env = clean_env() | {
            "PITSTOP_DATABASE_URL": database,
            "PITSTOP_REDIS_URL": stores.redis_url,
            "PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('proc')}:",
            "PITSTOP_LEADER_LEASE_SECONDS": "1",
            "PITSTOP_HEARTBEAT_INTERVAL_SECONDS": "0.5",
            "PITSTOP_STEP_REPORT_INTERVAL_SECONDS": "0.5",
            "PITSTOP_LIVENESS_TIMEOUT_INTERVALS": str(LIVENESS_INTERVALS),
            "GRPC_VERBOSITY": "ERROR",
            # Secure, one CA for every scheduler process; each keeps its node port across
            # a restart (the nodes learned it at enrollment).
            "PITSTOP_TLS": "true",
            "PITSTOP_TLS_DIR": str(root / "tls"),
        }
        for i in range(standbys + 1):
            own = env | {"PITSTOP_NODE_PORT": str(free_port())}
            running.schedulers.append(SchedulerProcess(root, f"scheduler-{i}", own))
            stack.callback(running.schedulers[-1].stop)
        running.cluster = Cluster(running.schedulers[-1], root)
        running.cluster.fork_server = fork_server
        running.cluster.daemons = daemon_forks
        stack.callback(running.cluster.stop)
        running.cluster.start()
        yield running
