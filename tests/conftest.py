"""Fixtures and pytest hooks only; the helpers tests share are in the test kit
(tests/kit/, imported as `kit`).

Fixtures: the run's stores (`stores`, `db`, `migrated_database`), one scheduler for the
whole run (`scheduler`), a fork server with torch imported (`mesh_forks`), a folder with
a short path (`short_dir`). Hooks: a skip fails where `make test` sets everything up,
SIGTERM tears fixtures down, `cluster` tests stay where `make test` runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from kit.dirs import short_tempdir
from kit.forking import ForkClient, forking
from kit.hardware import NO_HARDWARE
from kit.ranks import RankNotices
from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, open_stores
from pitstop.scheduler.db.engine import create_engine_for, migrate, session_factory

# Where `make test` sets up everything the tests need by itself (root on Debian: the
# Debian packages by apt-get, helm and the Python packages from their registries), a
# skip means that set-up failed: it fails the test, saying so. Only a test that needs
# hardware the machine lacks (an NVIDIA GPU) may skip there; its reason starts with
# NO_HARDWARE.
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
        "scripts/install.sh, scripts/install_helm.sh); see what it printed."
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


@pytest.fixture(scope="session")
def stores() -> Iterator[StoreUrls]:
    with open_stores() as urls:
        yield urls


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path, removed after the test: Unix socket paths are limited
    to 107 bytes."""
    with short_tempdir() as path:
        yield path


@pytest.fixture
async def notices(short_dir: Path) -> AsyncIterator[RankNotices]:
    """The socket fake ranks (tests/integration/fake_rank.py --notify) report to."""
    server = RankNotices(short_dir / "notify.sock")
    await server.start()
    yield server
    await server.close()


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
