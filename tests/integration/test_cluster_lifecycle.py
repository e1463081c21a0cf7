"""Nothing of a local cluster outlives what started it, and no daemon runs twice: the
demo stopped by SIGTERM leaves no process behind; `down` finds a daemon that
cluster.json does not name (an `up` killed between starting a daemon and recording it);
a node whose daemons run is not started again. Real daemons on the test stores.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit.clustercli import cli_environment, cluster_cli, status_json
from kit.dirs import short_tempdir
from kit.processes import processes_under, running
from kit.stores import StoreUrls, unique
from pitstop.client.launch import clean_env
from pitstop.client.localcluster import (
    CLUSTER_ENV,
    DAEMON_ENV,
    ClusterError,
    LocalCluster,
    spawning,
    stop_cluster,
    tagged_processes,
)

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short, under /tmp: the agents' Unix sockets live below it.
    with short_tempdir("pc-") as root:
        yield root
        stop_cluster(root, timeout=5.0)


@pytest.fixture
def cli_env(stores: StoreUrls) -> dict[str, str]:
    return cli_environment(stores)


def up(stores: StoreUrls, state_dir: Path) -> LocalCluster:
    """One worker node, no spare, on the test stores."""
    return LocalCluster.up(
        state_dir,
        nodes=1,
        spares=0,
        port=0,
        database_url=stores.fresh_database(),
        redis_url=stores.redis_url,
        env={"PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('cluster')}:"},
        timeout=90,
    )


def fake_daemon(folder: Path, state_dir: Path, name: str) -> subprocess.Popen[bytes]:
    """A process that looks like the cluster's daemon `name` (its console script's name,
    the cluster's environment) but that no cluster.json records."""
    script = folder / f"pitstop-{name.split('-')[0]}"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(300)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, CLUSTER_ENV: str(state_dir), DAEMON_ENV: name}
    ghost = subprocess.Popen(
        [str(script)], env=env, stdin=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 10
    while ghost.pid not in daemons(state_dir):
        assert time.monotonic() < deadline, f"{name} (pid {ghost.pid}) never ran"
        time.sleep(0.02)
    return ghost


def daemons(state_dir: Path) -> dict[int, str]:
    """The daemons of the cluster in `state_dir` that run now, by pid, recorded or not."""
    return {t.pid: t.daemon for t in tagged_processes(state_dir) if t.is_daemon()}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_down_finds_a_daemon_no_cluster_json_names(
    state_dir: Path, cli_env: dict[str, str], tmp_path: Path
) -> None:
    ghost = fake_daemon(tmp_path, state_dir, "checkpointd-node-1")

    status = status_json(cli_env, state_dir)
    assert status["running"] is True
    assert status["processes"] == [
        {"name": "checkpointd-node-1", "pid": ghost.pid, "alive": True, "recorded": False}
    ]
    human = cluster_cli(cli_env, "status", "--state-dir", str(state_dir))
    assert (
        f"no cluster.json in {state_dir}, but daemons of a cluster there run: "
        f"checkpointd-node-1 (pid {ghost.pid})" in human.stdout
    )
    # Nor does a new cluster start beside it.
    again = cluster_cli(cli_env, "up", "--state-dir", str(state_dir), "--port", "0")
    assert again.returncode == 1
    assert f"(checkpointd-node-1 pid {ghost.pid}); run pitstop cluster down" in again.stderr

    down = cluster_cli(cli_env, "down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert f"stopped 1 process of the cluster in {state_dir}" in down.stdout
    assert ghost.wait(timeout=10) == -signal.SIGTERM
    assert daemons(state_dir) == {}
    after = cluster_cli(cli_env, "down", "--state-dir", str(state_dir))
    assert f"no cluster runs in {state_dir}" in after.stdout


def test_an_up_interrupted_before_it_records_a_daemon_leaves_nothing(
    stores: StoreUrls, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C lands after the checkpoint daemon is started and before cluster.json names
    it: `up` stops it all the same."""
    real = spawning.start_ticks
    started: list[int] = []

    def interrupted(pid: int) -> int | None:
        started.append(pid)
        if len(started) == 2:  # the scheduler's, then the checkpoint daemon's
            raise KeyboardInterrupt
        return real(pid)

    monkeypatch.setattr(spawning, "start_ticks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        up(stores, state_dir)
    checkpointd = started[1]
    assert "starting the checkpoint daemon of node-1" in (
        (state_dir / "logs" / "checkpointd-node-1.log").read_text()
    )
    assert not running(checkpointd)
    assert tagged_processes(state_dir) == []
    assert processes_under(state_dir) == []
    assert not (state_dir / "cluster.json").exists()


def test_a_node_is_never_started_twice(stores: StoreUrls, state_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"liveness timeout 0.3 s: give at least 0.375 s"):
        LocalCluster.up(state_dir, liveness_timeout=0.3)
    cluster = up(stores, state_dir)
    # The hung-node deadline the scheduler got: 8 beats of 0.25 s.
    assert cluster.liveness_timeout == 2.0
    scheduler_env = environ(cluster.process("scheduler").pid)
    assert scheduler_env["PITSTOP_LIVENESS_TIMEOUT_INTERVALS"] == "8"
    assert scheduler_env["PITSTOP_HEARTBEAT_INTERVAL_SECONDS"] == "0.25"
    assert scheduler_env[CLUSTER_ENV] == str(state_dir)
    # A host gone silent: a ping every 0.5 s, unanswered for 0.5 s, and it is lost.
    assert scheduler_env["PITSTOP_KEEPALIVE_SECONDS"] == "0.5"
    assert scheduler_env["PITSTOP_KEEPALIVE_TIMEOUT_SECONDS"] == "0.5"
    assert cluster.silent_host_timeout == 1.0

    checkpointd = cluster.process("checkpointd-node-1").pid
    refused = rf"the checkpoint daemon of node-1 already runs \(pid {checkpointd}\)"
    with pytest.raises(ClusterError, match=refused):
        cluster.start_node("node-1")
    loaded = LocalCluster.load(state_dir)  # another process's view: cluster.json
    assert loaded is not None
    assert (loaded.liveness_timeout, loaded.silent_host_timeout) == (2.0, 1.0)
    with pytest.raises(ClusterError, match=refused):
        loaded.start_node("node-1")
    assert sorted(daemons(state_dir).values()) == [
        "agent-node-1",
        "checkpointd-node-1",
        "scheduler",
    ]

    # Killed, but a daemon of that name runs that cluster.json does not name.
    cluster.kill_node("node-1")
    ghost = fake_daemon(tmp_path, state_dir, "checkpointd-node-1")
    with pytest.raises(ClusterError, match=rf"already runs \(pid {ghost.pid}\)"):
        cluster.start_node("node-1")
    ghost.kill()
    ghost.wait()
    new = cluster.start_node("node-1")
    assert {p.name for p in new} == {"checkpointd-node-1", "agent-node-1"}
    assert sorted(daemons(state_dir).values()) == [
        "agent-node-1",
        "checkpointd-node-1",
        "scheduler",
    ]

    # `down` stops what cluster.json names and what it does not.
    stray = fake_daemon(tmp_path, state_dir, "agent-node-9")
    pids = [p.pid for p in cluster.processes] + [stray.pid]
    stopped = cluster.down(timeout=10)
    assert sorted(p.name for p in stopped) == [
        "agent-node-1",
        "agent-node-9",
        "checkpointd-node-1",
        "scheduler",
    ]
    assert stray.wait(timeout=10) == -signal.SIGTERM
    assert not any(running(pid) for pid in pids)
    assert tagged_processes(state_dir) == []
    assert processes_under(state_dir) == []
    with pytest.raises(ClusterError, match=f"the cluster in {state_dir} is down"):
        cluster.start_node("node-1")


def descendants(root: int) -> set[int]:
    """Every live process below `root`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdecimal():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and running(child):
                found.add(child)
                todo.append(child)
    return found


def test_the_demo_stopped_by_sigterm_leaves_nothing(stores: StoreUrls, state_dir: Path) -> None:
    """SIGTERM mid-run: the demo brings its cluster (daemons, ranks, standbys, embedded
    nothing: the test stores) down, kills its reference run, and exits 143."""
    env = clean_env()
    env.update(
        PITSTOP_DATABASE_URL=stores.fresh_database(),
        PITSTOP_REDIS_URL=stores.redis_url,
        PITSTOP_REDIS_PREFIX=f"{stores.redis_prefix}{unique('demo')}:",
        PYTHONUNBUFFERED="1",
        COLUMNS="200",
    )
    command = [sys.executable, str(DEMO), "--state-dir", str(state_dir), "--workers", "2"]
    command += ["--spares", "1", "--steps", "60", "--step-seconds", "1"]
    demo = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"\bjob\.running\b", "".join(output)):
            assert demo.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "the job never ran:\n" + "".join(output)
            time.sleep(0.2)
        # Every rank has started by now.
        tagged = tagged_processes(state_dir)
        assert len([t for t in tagged if t.rank]) >= 2, tagged
        assert len(daemons(state_dir)) == 7, daemons(state_dir)
        before = descendants(demo.pid) | {t.pid for t in tagged}
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    text = "".join(output)
    assert code == 143, text
    assert "stopped by SIGTERM: the demo stopped, and so did its cluster" in text
    assert "Traceback" not in text
    assert not [pid for pid in before if running(pid)], text
    assert tagged_processes(state_dir) == []
    assert processes_under(state_dir) == []
    assert not (state_dir / "cluster.json").exists()
