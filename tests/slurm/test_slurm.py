"""pitstop inside a real Slurm cluster (tests/slurm/slurm_cluster.py: munged, slurmctld and
four slurmd in multiple-slurmd mode, two racks in topology.conf). The recipe
deploy/slurm/pitstop.sbatch runs examples/jobs/gpt-slurm.yaml in one allocation of 2
workers and a spare, its scheduler on the batch host with the Slurm adapter on. One
worker's daemons (agent and checkpoint daemon) are killed with kill -9 mid-run: the job
still ends with the final-weights hash of a fault-free standalone run, the node is
drained in Slurm with pitstop's reason, and, its spare taken, the adapter's replacement
allocation lands on the fourth node, which joins as a spare."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
import yaml

from kit.schedulers import SchedulerProcess
from kit.slurm import SlurmCluster, missing, running_slurm
from kit.stores import StoreUrls, unique
from kit.streams import AgentStream
from kit.waits import wait_until
from pitstop.checkpointd.instances import remove_stale_segments
from pitstop.checkpointd.slots import segment_prefix
from pitstop.client.launch import clean_env

SKIP = missing()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "deploy" / "slurm" / "pitstop.sbatch"
SPEC = REPO / "examples" / "jobs" / "gpt-slurm.yaml"
NODES = ["n1", "n2", "n3", "n4"]
SWITCHES = {"rack-a": ["n1", "n2"], "rack-b": ["n3", "n4"]}
WAIT = 150.0
KILL_AT_STEP = 3


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with running_slurm(tmp_path_factory.mktemp("slurm"), NODES, SWITCHES) as cluster:
        yield cluster


@pytest.fixture
def nodes_back(slurm: SlurmCluster) -> Iterator[None]:
    """After a test: its jobs cancelled, its drained nodes resumed, the shared memory of
    the checkpoint daemons it killed unlinked, whatever the test's outcome."""
    yield
    slurm.cancel_all()
    drained = [n.name for n in slurm.sinfo().values() if n.state.startswith("drain")]
    if drained:
        slurm.run(["scontrol", "update", f"nodename={','.join(drained)}", "state=resume"])
    for node in NODES:
        remove_stale_segments(segment_prefix(node))


def fault_free_hash(result: dict[str, str]) -> threading.Thread:
    """The spec's command run alone in one process, unpaced, in the background: the hash
    every run must end with (the example's does not depend on the world size)."""
    command = yaml.safe_load(SPEC.read_text())["command"]
    at = command.index("--step-seconds")
    argv = [sys.executable, *command[1:at] + command[at + 2 :], "--log-every", "0"]
    env = clean_env()

    def run() -> None:
        done = subprocess.run(argv, capture_output=True, env=env, timeout=WAIT, check=True)
        result["hash"] = json.loads(done.stdout.splitlines()[-1])["final_weights_sha256"]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def cli_processes() -> str:
    """The pitstop CLI processes still running (a recipe waiting on one: `pitstop job
    watch` once hung after the job's end), each thread's kernel wait channel."""
    lines = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "bin/pitstop " not in cmdline + " ":
            continue
        tasks = Path(f"/proc/{proc.pid}/task")
        with contextlib.suppress(OSError):
            waits = [(t / "wchan").read_text() for t in sorted(tasks.iterdir())]
            lines.append(f"{proc.pid} {proc.info['status']} {cmdline!r} threads waiting in {waits}")
            lines.append(stacks_of(proc.pid))
    return "pitstop CLI processes:\n" + ("\n".join(lines) or "none")


def stacks_of(pid: int) -> str:
    """Every thread's Python and native stack (py-spy, installed with the agent), so a
    hang says where it is."""
    py_spy = Path(sys.executable).parent / "py-spy"
    try:
        done = subprocess.run(
            [str(py_spy), "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"  (no stacks: {exc})"
    return done.stdout + done.stderr


@pytest.mark.usefixtures("nodes_back")
def test_a_job_in_an_sbatch_allocation_outlives_a_killed_node_which_slurm_drains(
    slurm: SlurmCluster, stores: StoreUrls, tmp_path: Path
) -> None:
    started = time.monotonic()
    reference: dict[str, str] = {}
    standalone = fault_free_hash(reference)
    database = stores.fresh_database()
    shared, nodes = tmp_path / "shared", tmp_path / "nodes"
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{slurm.env['PATH']}",
        "PITSTOP_DATABASE_URL": database,
        "PITSTOP_REDIS_URL": stores.redis_url,
        "PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('slurm')}:",
        "PITSTOP_SLURM_SHARED_DIR": str(shared),
        "PITSTOP_SLURM_NODE_DIR": str(nodes),
        "PITSTOP_AGENT_GPUS": "sim:1",
        "PITSTOP_AGENT_METRICS_PORT": "0",
        "PITSTOP_HEARTBEAT_INTERVAL_SECONDS": "0.25",
        "PITSTOP_LIVENESS_TIMEOUT_INTERVALS": "8",
        "PITSTOP_LIVENESS_STARTUP_GRACE_SECONDS": "0",
        "GRPC_VERBOSITY": "ERROR",
    }
    out = tmp_path / "pitstop.out"
    batch = slurm.sbatch(["--nodes=3", f"--output={out}", str(RECIPE), str(SPEC)], env)

    def explain() -> str:
        logs = [*sorted((shared / "logs").glob("*.log")), shared / "scheduler.log", out]
        tails = [
            f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
            for p in logs
            if p.exists()
        ]
        return "\n".join([f"Slurm: {slurm.jobs()} {slurm.sinfo()}", *tails])

    def query(sql: str) -> list[tuple[Any, ...]]:
        """Rows of the recipe's scheduler's database (none before it made its tables)."""
        with psycopg.connect(database, autocommit=True) as conn:
            try:
                return conn.execute(sql).fetchall()
            except psycopg.errors.UndefinedTable:
                return []

    def stepping() -> bool:
        found = query("SELECT current_step FROM jobs")
        return bool(found) and found[0][0] >= KILL_AT_STEP

    wait_until(stepping, f"the job at step {KILL_AT_STEP}", WAIT, poll=0.2, explain=explain)
    for daemon in ("agent", "checkpointd"):
        os.kill(int((nodes / "n2" / f"{daemon}.pid").read_text()), signal.SIGKILL)

    drained = wait_until(
        lambda: (
            (n := slurm.sinfo()["n2"]).state.startswith("drain")
            and n.reason.startswith("pitstop: lost")
            and n
        ),
        "n2 drained in Slurm with pitstop's reason",
        WAIT,
        poll=0.2,
        explain=explain,
    )
    replacement = wait_until(
        lambda: query("SELECT id FROM nodes WHERE id = 'n4' AND role = 'spare' AND connected"),
        "a replacement node joined as a spare",
        WAIT,
        poll=0.2,
        explain=explain,
    )
    try:
        ended = slurm.wait_job(batch, WAIT)
    except TimeoutError as exc:  # say what the recipe still waits on
        pytest.fail(f"{exc}\n{cli_processes()}\n{explain()}")
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), explain()
    job = json.loads((shared / "job.json").read_text())
    standalone.join(WAIT)
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    assert job["result"]["final_weights_sha256"] == reference["hash"]
    # the spare (n3, rack-b) took n2's rank: the job ran on n1 and n3 in the end
    assert {r["node_id"] for r in job["rank_map"]["ranks"]} == {"n1", "n3"}

    assert drained.reason.startswith("pitstop: lost:")
    events = query(
        "SELECT kind, node_id, reason, attributes FROM events WHERE kind IN "
        "('node.slurm_drained', 'node.slurm_replacement_requested') ORDER BY id"
    )
    assert [(k, n) for k, n, _, _ in events] == [
        ("node.slurm_drained", "n2"),
        ("node.slurm_replacement_requested", "n2"),
    ]
    assert events[0][2] == drained.reason
    replacement_job = events[1][3]["slurm_job_id"]
    assert slurm.job(replacement_job)["NodeList"] == "n4"
    assert replacement == [("n4",)]
    # the allocation's end (its daemons stopped) drained nothing more
    assert {n.name for n in slurm.sinfo().values() if n.state.startswith("drain")} == {"n2"}
    labels = dict(query("SELECT id, rack || '/' || block FROM nodes"))
    assert labels == {
        "n1": "rack-a/top",
        "n2": "rack-a/top",
        "n3": "rack-b/top",
        "n4": "rack-b/top",
    }
    print(f"pitstop in Slurm: {time.monotonic() - started:.1f} s")


REPLACE = """#!/bin/bash
# Stands in for sbatch: submits the replacement (a placeholder job), then never answers,
# so that the scheduler running it dies between the request and its record.
echo "$$" >>{submissions}
sbatch --nodes=1 --output=/dev/null --wrap "sleep 600"
exec sleep 600
"""


@pytest.mark.usefixtures("nodes_back")
def test_the_drain_and_the_replacement_survive_scheduler_restarts(
    slurm: SlurmCluster, stores: StoreUrls, tmp_path: Path
) -> None:
    """n3 is lost while slurmctld is down (the adapter cannot drain it); the scheduler is
    killed; a new one, Slurm back, drains it and asks for a replacement, and is killed
    before it records the request; a third finds the request in Slurm by its name and
    does not ask again."""
    hold = slurm.sbatch(["--nodelist=n3", "--output=/dev/null", "--wrap", "sleep 600"])
    submissions = tmp_path / "submissions"
    script = tmp_path / "replace.sh"
    script.write_text(REPLACE.format(submissions=submissions))
    script.chmod(0o755)
    database = stores.fresh_database()
    env = clean_env(slurm.env) | {
        "PITSTOP_DATABASE_URL": database,
        "PITSTOP_REDIS_URL": stores.redis_url,
        "PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('slurm')}:",
        "PITSTOP_SLURM_ADAPTER": "true",
        "PITSTOP_SLURM_RECONCILE_SECONDS": "0.3",
        "PITSTOP_SLURM_COMMAND_TIMEOUT_SECONDS": "600",
        "PITSTOP_SLURM_REPLACEMENT_COMMAND": str(script),
        "PITSTOP_SLURM_REPLACEMENT_JOB_PREFIX": "restarts",
        "GRPC_VERBOSITY": "NONE",
    }
    schedulers: list[SchedulerProcess] = []

    def scheduler(name: str) -> SchedulerProcess:
        schedulers.append(SchedulerProcess(tmp_path, name, env))
        return schedulers[-1]

    def query(sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(database, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def explain() -> str:
        logs = [tmp_path / f"{s.name}.log" for s in schedulers]
        return "\n".join(
            [f"Slurm: {slurm.jobs()} {slurm.sinfo()}"]
            + [f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in logs]
        )

    try:
        wait_until(
            lambda: slurm.job(hold).get("JobState") == "RUNNING",
            "n3 allocated",
            WAIT,
            poll=0.2,
            explain=explain,
        )
        slurm.stop_controller()
        first = scheduler("first")
        AgentStream(first.channel(), "n3", 1, "z1", "b1", "r1", "worker").close()
        wait_until(
            lambda: "Slurm did not answer" in (tmp_path / "first.log").read_text(),
            "the adapter found Slurm unreachable",
            WAIT,
            poll=0.2,
            explain=explain,
        )
        first.kill()
        slurm.start_controller()
        second = scheduler("second")
        wait_until(
            lambda: (
                submissions.exists()
                and [n for n in slurm.jobs().values() if n.startswith("restarts-n3-")]
            ),
            "n3 drained and its replacement submitted",
            WAIT,
            poll=0.2,
            explain=explain,
        )
        second.kill()
        os.kill(int(submissions.read_text().split()[0]), signal.SIGKILL)  # its sbatch stand-in
        third = scheduler("third")
        requested = wait_until(
            lambda: query(
                "SELECT reason FROM events WHERE kind = 'node.slurm_replacement_requested'"
            ),
            "the replacement recorded",
            WAIT,
            poll=0.2,
            explain=explain,
        )
        third.stop()
        seen = slurm.sinfo()["n3"]
        assert (seen.state, seen.reason) == ("draining", "pitstop: lost: agent stream closed")
        assert len(submissions.read_text().split()) == 1  # asked for once, over three leaders
        replacements = [n for n in slurm.jobs().values() if n.startswith("restarts-n3-")]
        assert len(replacements) == 1
        assert "found in Slurm by its name" in requested[0][0]
        drained = query("SELECT reason FROM events WHERE kind = 'node.slurm_drained'")
        assert drained == [("pitstop: lost: agent stream closed",)]
    finally:
        for process in schedulers:
            process.stop()
