"""``pitstop cluster up|status|cut|heal|down`` as a person runs it: the real CLI binary starting the
real daemons (scheduler, checkpoint daemons, agents) detached, on the test stores.

Each test gets its own state dir, database and Redis prefix; whatever a test leaves
running is brought down by the fixture.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kit.clustercli import cli_environment, cluster_cli, pitstop_cli, status_json
from kit.dirs import short_tempdir
from kit.processes import processes_under, running
from kit.stores import StoreUrls, unique
from kit.waits import wait_until
from pitstop.client.localcluster import LocalCluster, node_layout
from pitstop.v1 import jobs_pb2


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short, under /tmp: the agents' Unix sockets live below it.
    with short_tempdir("pc-") as root:
        yield root
        cluster = LocalCluster.load(root)
        if cluster is not None:
            cluster.down(timeout=5.0)


@pytest.fixture
def cli_env(stores: StoreUrls) -> dict[str, str]:
    return cli_environment(stores)


def plaintext_refused(address: str) -> bool:
    """Whether a plaintext gRPC call to `address` fails its handshake: the port takes the
    connection (it is no refused one) and answers nothing but UNAVAILABLE."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5):
        pass  # something listens there
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            call(b"", timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def up_args(stores: StoreUrls, state_dir: Path, nodes: int, spares: int, *extra: str) -> list[str]:
    """``up`` on the test stores, a fresh database and a free port."""
    return [
        "up",
        "--nodes",
        str(nodes),
        "--spares",
        str(spares),
        "--state-dir",
        str(state_dir),
        "--port",
        "0",
        "--database-url",
        stores.fresh_database(),
        "--redis-url",
        stores.redis_url,
        *extra,
    ]


def plaintext_http_refused(url: str) -> bool:
    """Plain HTTP to the dashboard's TLS port gets no page."""
    plain = url.replace("https://", "http://")
    try:
        with urllib.request.urlopen(f"{plain}api/fleet", timeout=5):
            return False
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
        return True


def test_up_status_down(stores: StoreUrls, state_dir: Path, cli_env: dict[str, str]) -> None:
    command = up_args(stores, state_dir, 2, 1, "--timeout", "90")
    up = cluster_cli(cli_env, *command)
    assert up.returncode == 0, up.stdout + up.stderr
    exported = re.search(r"^export PITSTOP_SERVER=(\S+)$", up.stdout, re.MULTILINE)
    assert exported, up.stdout
    address = exported.group(1)

    # The CLI has exited; the daemons keep running, each in a session of its own.
    status = status_json(cli_env, state_dir)
    assert status["running"] is True
    assert status["scheduler_address"] == address
    assert status["error"] is None
    assert status["network"] is None  # no --netns
    assert {(n["id"], n["role"], n["state"], n["connected"]) for n in status["nodes"]} == {
        ("node-1", "worker", "ready", True),
        ("node-2", "worker", "ready", True),
        ("spare-1", "spare", "ready", True),
    }
    processes = status["processes"]
    nodes = ("node-1", "node-2", "spare-1")

    # Secure by default: every gRPC port (the API, the nodes' port, each checkpoint
    # daemon) answers a plaintext client with nothing but a failed handshake; the CLI
    # works with the CA and the admin token the up printed, and not without the token.
    assert status["tls"] is True
    ports = [p["address"] for p in processes if p["address"]]
    ports += [p["node_address"] for p in processes if p["node_address"]]
    assert len(ports) == 5, processes  # scheduler, its node port, three checkpoint daemons
    for port in ports:
        assert plaintext_refused(port), port
    ca = re.search(r"^export PITSTOP_CA_CERT=(\S+)$", up.stdout, re.MULTILINE)
    token = re.search(r'^export PITSTOP_TOKEN="\$\(cat (\S+)\)"$', up.stdout, re.MULTILINE)
    assert ca, up.stdout
    assert token, up.stdout
    assert (Path(token.group(1)).stat().st_mode & 0o777) == 0o600
    secure_env = cli_env | {
        "PITSTOP_SERVER": address,
        "PITSTOP_CA_CERT": ca.group(1),
        "PITSTOP_TOKEN": Path(token.group(1)).read_text().strip(),
    }
    listed = pitstop_cli(secure_env, "node", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {n["id"] for n in json.loads(listed.stdout)} == set(nodes)
    anonymous = pitstop_cli(
        {k: v for k, v in secure_env.items() if k != "PITSTOP_TOKEN"}, "node", "list"
    )
    assert anonymous.returncode == 1
    assert "UNAUTHENTICATED" in anonymous.stderr
    plain = pitstop_cli(cli_env | {"PITSTOP_SERVER": address}, "--timeout", "3", "node", "list")
    assert plain.returncode == 1
    assert "pass --ca-cert" in plain.stderr
    # The dashboard: printed by `up`, in the status, on TLS, and only for a token holder.
    dashboard = status["dashboard_url"]
    assert dashboard.startswith("https://127.0.0.1:"), status
    assert f"dashboard: {dashboard} " in up.stdout
    assert plaintext_http_refused(dashboard)
    assert sorted(p["name"] for p in processes) == sorted(
        ["scheduler"] + [f"{kind}-{node}" for kind in ("checkpointd", "agent") for node in nodes]
    )
    assert all(p["alive"] for p in processes), processes
    pids = [p["pid"] for p in processes]
    assert all(running(pid) and os.getsid(pid) == pid for pid in pids)
    for p in processes:
        assert Path(p["log"]).is_file()

    # A second up in the same dir is refused, naming the scheduler, and changes nothing.
    scheduler_pid = next(p["pid"] for p in processes if p["kind"] == "scheduler")
    again = cluster_cli(cli_env, *command)
    assert again.returncode == 1
    assert (
        f"error: a cluster is already running in {state_dir} (scheduler pid {scheduler_pid}); "
        "run pitstop cluster down" in again.stderr
    )
    assert all(running(pid) for pid in pids)

    human = cluster_cli(cli_env, "status", "--state-dir", str(state_dir))
    assert human.returncode == 0, human.stderr
    assert f"scheduler at {address}" in human.stdout
    assert "agent-spare-1" in human.stdout

    # Cutting a node off needs namespaces: the error says how to get them.
    cut = cluster_cli(cli_env, "cut", "node-2", "--state-dir", str(state_dir))
    assert cut.returncode == 1
    assert "runs without network namespaces; bring it up with pitstop cluster up --netns" in (
        cut.stderr
    )

    down = cluster_cli(cli_env, "down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert "stopped 7 processes" in down.stdout
    assert not [pid for pid in pids if running(pid)]
    assert processes_under(state_dir) == []
    assert not (state_dir / "cluster.json").exists()

    after = status_json(cli_env, state_dir)
    assert after["running"] is False
    assert after["processes"] == []
    assert after["network"] is None
    human = cluster_cli(cli_env, "status", "--state-dir", str(state_dir))
    assert f"no cluster runs in {state_dir}" in human.stdout

    # Idempotent: nothing to stop is no error.
    again_down = cluster_cli(cli_env, "down", "--state-dir", str(state_dir), "--wipe")
    assert again_down.returncode == 0, again_down.stderr
    assert f"no cluster runs in {state_dir}" in again_down.stdout
    assert not state_dir.exists()


def net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def node_states(env: dict[str, str], state_dir: Path) -> dict[str, tuple[str, bool]]:
    return {n["id"]: (n["state"], n["connected"]) for n in status_json(env, state_dir)["nodes"]}


def ip_names(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and ip"
)
def test_netns_cut_and_heal(stores: StoreUrls, state_dir: Path, cli_env: dict[str, str]) -> None:
    """``up --netns``: each node in a namespace of its own behind a bridge. A node cut off
    lives on but is declared lost; healed, it comes back ready; ``down`` removes the
    namespaces and the bridge."""
    up = cluster_cli(cli_env, *up_args(stores, state_dir, 2, 0, "--netns", "--timeout", "90"))
    assert up.returncode == 0, up.stdout + up.stderr
    assert "each node in a network namespace of its own" in up.stdout
    status = status_json(cli_env, state_dir)
    network = status["network"]
    assert network["cut_off"] == []
    links = {link["node_id"]: link for link in network["links"]}
    assert set(links) == {"node-1", "node-2"}
    assert status["scheduler_address"].startswith(network["gateway"] + ":")
    pids = {p["name"]: p["pid"] for p in status["processes"]}
    spaces = {name: net_namespace(pid) for name, pid in pids.items()}
    assert spaces["scheduler"] == net_namespace(os.getpid())
    assert spaces["agent-node-1"] == spaces["checkpointd-node-1"]
    assert len({spaces["scheduler"], spaces["agent-node-1"], spaces["agent-node-2"]}) == 3
    addresses = {p["name"]: p["address"] for p in status["processes"]}
    assert addresses["checkpointd-node-2"].startswith(links["node-2"]["address"] + ":")

    cut = cluster_cli(cli_env, "cut", "node-2", "--state-dir", str(state_dir))
    assert cut.returncode == 0, cut.stderr
    wait_until(
        lambda: node_states(cli_env, state_dir)["node-2"] == ("lost", False), "node-2 to be lost"
    )
    assert all(running(pid) for pid in pids.values())  # cut off, not dead
    assert node_states(cli_env, state_dir)["node-1"] == ("ready", True)
    assert status_json(cli_env, state_dir)["network"]["cut_off"] == ["node-2"]

    heal = cluster_cli(cli_env, "heal", "node-2", "--state-dir", str(state_dir))
    assert heal.returncode == 0, heal.stderr
    wait_until(
        lambda: node_states(cli_env, state_dir)["node-2"] == ("ready", True),
        "node-2 to come back",
    )
    assert status_json(cli_env, state_dir)["network"]["cut_off"] == []

    down = cluster_cli(cli_env, "down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert not any(running(pid) for pid in pids.values())
    namespaces = ip_names("netns", "list")
    assert not [link["namespace"] for link in links.values() if link["namespace"] in namespaces]
    assert network["bridge"] not in ip_names("-o", "link", "show")


def test_failed_start_leaves_nothing_running(
    stores: StoreUrls, state_dir: Path, cli_env: dict[str, str]
) -> None:
    # The checkpoint daemons refuse this budget; the scheduler is up by then.
    cli_env["PITSTOP_CHECKPOINTD_MEMORY_BUDGET_BYTES"] = "-1"
    up = cluster_cli(cli_env, *up_args(stores, state_dir, 1, 0))
    assert up.returncode == 1
    assert "error: the checkpoint daemon of node-1 exited with code 2" in up.stderr
    assert "checkpointd-node-1.log ends with:" in up.stderr
    assert "memory_budget_bytes" in up.stderr  # the tail of its log says why
    assert "listening on" in (state_dir / "logs" / "scheduler.log").read_text()
    assert processes_under(state_dir) == []
    assert not (state_dir / "cluster.json").exists()
    assert cluster_cli(cli_env, "status", "--state-dir", str(state_dir)).stdout.startswith(
        "no cluster runs"
    )


def test_kill_and_restart_a_node(stores: StoreUrls, state_dir: Path) -> None:
    """The Python API the fault tests use: kill a node's daemons and its ranks as a dying
    host would, start it again, and bring everything down, ranks included."""
    env = {"PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('cluster')}:"}
    with LocalCluster.up(
        state_dir,
        nodes=1,
        spares=1,
        port=0,
        database_url=stores.fresh_database(),
        redis_url=stores.redis_url,
        env=env,
        timeout=90,
    ) as cluster:
        assert LocalCluster.load(state_dir) == LocalCluster(
            cluster.state_dir, cluster.scheduler_address, cluster.nodes, cluster.processes
        )
        spec = jobs_pb2.JobSpec(
            name=unique("sleeper"),
            command=[sys.executable, "-c", "import time; time.sleep(600)"],
            dp=1,
            gpus_per_node=1,
        )
        with cluster.client() as client:
            client.submit_job(spec)
        # The rank never reports a step; it is started when the agent has spawned it.
        wait_until(lambda: bool(cluster.rank_pids("node-1")), "the rank to start on node-1")
        (rank,) = cluster.rank_pids("node-1")
        old = {p.name: p for p in cluster.node_processes("node-1")}

        killed = cluster.kill_node("node-1")
        assert sorted(killed) == sorted(
            [old["agent-node-1"].pid, old["checkpointd-node-1"].pid, rank]
        )
        assert not any(running(pid) for pid in killed)
        assert cluster.process("scheduler").alive()

        new = cluster.restart_node("node-1")
        assert {p.name for p in new} == set(old)
        assert not {p.pid for p in new} & {p.pid for p in old.values()}
        (node,) = [n for n in cluster.list_nodes() if n.id == "node-1"]
        assert node.connected
        assert node.inventory.checkpointd_address == cluster.process("checkpointd-node-1").address
        recorded = LocalCluster.load(state_dir)
        assert recorded is not None
        assert recorded.processes == cluster.processes
        pids = [p.pid for p in cluster.processes]
    assert not any(running(pid) for pid in pids)
    assert processes_under(state_dir) == []
    assert LocalCluster.load(state_dir) is None


def test_node_layout_gives_every_spare_a_rack_peer() -> None:
    layout = node_layout(4, 3, gpus_per_node=2)
    assert [(n.node_id, n.role, n.rack) for n in layout] == [
        ("node-1", "worker", "r1"),
        ("node-2", "worker", "r2"),
        ("node-3", "worker", "r1"),
        ("node-4", "worker", "r2"),
        ("spare-1", "spare", "r1"),
        ("spare-2", "spare", "r2"),
        ("spare-3", "spare", "r1"),
    ]
    assert {n.gpus for n in layout} == {2}
    assert {n.rack for n in node_layout(1, 1)} == {"r1"}
