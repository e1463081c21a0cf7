"""The example job (pitstop.trainer.example, dp=4, one rank per node) under a real
scheduler, real agents and real checkpoint daemons, one of each per node, plus a spare.
Fault-free, with a Pause and Resume through the CLI mid-run, and with a rank killed, a
whole node killed or a fatal Xid injected at a random step, the job succeeds with the same
final-weights hash as the example run standalone in one process (the hash does not depend
on the world size)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import SchedulerThread, StoreUrls, follow_events, scheduler_settings, unique
from typer.testing import CliRunner

from pitstop.agent.config import SOCKET_NAME
from pitstop.client.cli import app
from pitstop.client.localcluster import rank_pids
from pitstop.v1 import common_pb2, jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc

pytestmark = pytest.mark.cluster

STEPS = 60
STEP_SECONDS = 0.12  # paced, so a fault lands mid-run
WORKERS = ["n0", "n1", "n2", "n3"]
SPARE = "sp"
TIMEOUT = 90.0
EXAMPLE = [sys.executable, "-m", "pitstop.trainer.example", "--steps", str(STEPS)]
BIN = Path(sys.executable).parent
STEP_LINE = re.compile(rb'^\{"rank": (\d+), "step": (\d+), ')


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}


@pytest.fixture(scope="module")
def standalone_hash() -> str:
    """The example run alone in one process: the hash every run must end with."""
    done = subprocess.run(
        [*EXAMPLE, "--log-every", "0"],
        capture_output=True,
        env=clean_env(),
        timeout=TIMEOUT,
        check=True,
    )
    return str(json.loads(done.stdout.splitlines()[-1])["final_weights_sha256"])


@dataclass
class Node:
    """One node: its checkpoint daemon and its agent, each a process group of its own."""

    node_id: str
    root: Path
    rack: str
    role: str
    scheduler: str
    checkpointd: subprocess.Popen[str] | None = None
    agent: subprocess.Popen[bytes] | None = None
    checkpointd_address: str = ""
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    def start(self) -> None:
        command = [
            str(BIN / "pitstop-checkpointd"),
            "run",
            "--node-id",
            self.node_id,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--scheduler",
            self.scheduler,
            "--state-dir",
            str(self.root / "checkpointd"),
            "--log-level",
            "WARNING",
        ]
        env = clean_env()
        env["PITSTOP_CHECKPOINTD_MEMORY_BUDGET_BYTES"] = str(256 << 20)
        env["PITSTOP_CHECKPOINTD_FLUSH_EVERY_STEPS"] = "1000"
        env["PITSTOP_CHECKPOINTD_RETRY_MAX_SECONDS"] = "0.5"
        self.checkpointd = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.checkpointd_address = self._wait_for_line("listening on").split("listening on ")[1]
        self.checkpointd_address = self.checkpointd_address.split()[0]
        self.agent = subprocess.Popen(
            [
                str(BIN / "pitstop-agent"),
                "run",
                "--node-id",
                self.node_id,
                "--scheduler",
                self.scheduler,
                "--gpus",
                "sim:1",
                "--zone",
                "z1",
                "--block",
                "b1",
                "--rack",
                self.rack,
                "--role",
                self.role,
                "--state-dir",
                str(self.root / "agent"),
                "--checkpointd-address",
                self.checkpointd_address,
                "--metrics-port",
                "0",
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.DEVNULL,
            env=clean_env(),
            start_new_session=True,
        )

    def _read(self) -> None:
        assert self.checkpointd is not None
        assert self.checkpointd.stdout is not None
        for line in self.checkpointd.stdout:
            self.lines.put(line.rstrip())

    def _wait_for_line(self, text: str) -> str:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"checkpointd of {self.node_id} never said {text!r}") from None
            if text in line:
                return line

    def rank_log(self, job_id: str, rank: int) -> Path:
        return self.root / "agent" / "ranks" / job_id / f"rank-{rank}.log"

    def stop(self) -> None:
        for proc in (self.agent, self.checkpointd):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.agent, self.checkpointd):
            if proc is None:
                continue
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def killpg(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


class Cluster:
    """A deciding scheduler, four worker nodes in four racks and a spare."""

    def __init__(self, scheduler: SchedulerThread, root: Path) -> None:
        self.scheduler = scheduler
        self.events = follow_events(scheduler.address, timeout=4 * TIMEOUT)
        self.jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
        self.node_api = nodes_pb2_grpc.NodeServiceStub(scheduler.channel())
        self.event_api = nodes_pb2_grpc.EventServiceStub(scheduler.channel())
        self.nodes: dict[str, Node] = {}
        specs = [(n, f"r{i}", "worker") for i, n in enumerate(WORKERS)]
        specs.append((SPARE, "r0", "spare"))
        for node_id, rack, role in specs:
            node = Node(node_id, root / node_id, rack, role, scheduler.address)
            self.nodes[node_id] = node
            node.start()
        missing = set(self.nodes)
        while missing:
            missing.discard(self.wait(lambda e: e.kind == "node.registered").node_id)

    def wait(self, match: Any) -> Any:
        for event in self.events:
            if match(event):
                return event
        raise AssertionError("the event stream ended before the awaited event")

    def job_event(self, job_id: str, *kinds: str) -> Any:
        return self.wait(lambda e: e.job_id == job_id and e.kind in kinds)

    redis_url = ""
    redis_prefix = ""

    def submit(self, *extra: str, min_dp: int = 4) -> jobs_pb2.Job:
        spec = jobs_pb2.JobSpec(
            name=unique("gpt"),
            command=[*EXAMPLE, "--log-every", "1", *extra],
            dp=4,
            min_dp=min_dp,
            gpus_per_node=1,
            spares=1,
            max_restarts=3,
            env={"PYTHONUNBUFFERED": "1", "PITSTOP_COLLECTIVE_TIMEOUT": "5"},
        )
        job = self.jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
        self.job_event(job.id, "job.running")
        return self.get(job.id)

    def get(self, job_id: str) -> jobs_pb2.Job:
        return self.jobs.Get(jobs_pb2.GetJobRequest(job_id=job_id))

    def finish(self, job_id: str) -> jobs_pb2.Job:
        done = self.job_event(job_id, "job.succeeded", "job.failed", "job.cancelled")
        job = self.get(job_id)
        assert done.kind == "job.succeeded", (done, job, self.logs(job_id))
        return job

    def node_of(self, job: jobs_pb2.Job, rank: int) -> Node:
        (node_id,) = [a.node_id for a in job.rank_map.ranks if a.rank == rank]
        return self.nodes[node_id]

    def wait_for_step(self, job: jobs_pb2.Job, rank: int, step: int) -> None:
        """Until `rank` has logged `step` (its log is read as it grows)."""
        path = self.node_of(job, rank).rank_log(job.id, rank)
        deadline = time.monotonic() + TIMEOUT
        seen = 0
        while time.monotonic() < deadline:
            text = path.read_bytes() if path.exists() else b""
            seen = max(
                [0, *(int(m.group(2)) for m in map(STEP_LINE.match, text.splitlines()) if m)]
            )
            if seen >= step:
                return
            time.sleep(0.02)  # polls the log; the condition is the step, not the time
        raise AssertionError(f"rank {rank} reached only step {seen} of {step}")

    def rank_pids(self, node_id: str) -> list[int]:
        """The rank processes the node's agent started (found by their agent socket)."""
        socket = str(self.nodes[node_id].root / "agent" / SOCKET_NAME)
        return rank_pids({node_id: socket})[node_id]

    def kill_node(self, node_id: str) -> None:
        """kill -9 of everything on the node: its agent, its checkpoint daemon, its ranks."""
        node = self.nodes[node_id]
        ranks = self.rank_pids(node_id)
        for proc in (node.agent, node.checkpointd):
            assert proc is not None
            killpg(proc.pid, signal.SIGKILL)
        for pid in ranks:
            killpg(pid, signal.SIGKILL)

    def inject(self, node_id: str, fault: common_pb2.Fault) -> None:
        self.node_api.InjectFault(nodes_pb2.InjectFaultRequest(node_id=node_id, fault=fault))

    def logs(self, job_id: str) -> str:
        out = []
        for node in self.nodes.values():
            for path in sorted((node.root / "agent" / "ranks" / job_id).glob("*.log")):
                out.append(f"== {node.node_id} {path.name}\n{path.read_text()[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self.events.close()


@pytest.fixture
def cluster(stores: StoreUrls, tmp_path: Path) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="pr-"))  # short: the agent socket path
    prefix = f"{stores.redis_prefix}{unique('rec')}:"
    thread = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path / "scheduler",
            database_url=stores.fresh_database(),
            redis_prefix=prefix,
            leader_loops=True,
            heartbeat_interval_seconds=0.5,
            liveness_startup_grace_seconds=0.0,
        )
    )
    built: Cluster | None = None
    try:
        built = Cluster(thread, root)
        built.redis_url, built.redis_prefix = stores.redis_url, prefix
        yield built
    finally:
        if built is not None:
            built.stop()
        thread.stop()
        if not os.environ.get("PITSTOP_E2E_KEEP"):
            shutil.rmtree(root, ignore_errors=True)


def steps_logged(cluster: Cluster, job: jobs_pb2.Job, rank: int) -> list[int]:
    """The steps `rank` printed, in order, over every process that ran it on its node."""
    path = cluster.node_of(job, rank).rank_log(job.id, rank)
    return [
        int(m.group(2))
        for line in path.read_bytes().splitlines()
        if (m := STEP_LINE.match(line)) is not None
    ]


RESTORED_LINE = re.compile(rb"rank \d+ restored step (\d+) from ")


def restored_steps(cluster: Cluster, job: jobs_pb2.Job) -> list[int]:
    """The step each restarted rank process restored, from every rank log."""
    steps = []
    for node in cluster.nodes.values():
        for path in (node.root / "agent" / "ranks" / job.id).glob("*.log"):
            steps += [int(m.group(1)) for m in RESTORED_LINE.finditer(path.read_bytes())]
    return steps


def all_steps_logged(cluster: Cluster, job: jobs_pb2.Job, rank: int) -> set[int]:
    """The steps `rank` printed on any node (a moved rank's log starts on its new node)."""
    steps: set[int] = set()
    for node in cluster.nodes.values():
        path = node.rank_log(job.id, rank)
        if path.exists():
            steps.update(
                int(m.group(2)) for m in map(STEP_LINE.match, path.read_bytes().splitlines()) if m
            )
    return steps


def check_result(job: jobs_pb2.Job, expected: str) -> None:
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED
    assert job.result["final_weights_sha256"] == expected
    assert job.current_step == STEPS


def test_fault_free_run_matches_the_standalone_hash(cluster: Cluster, standalone_hash: str) -> None:
    job = cluster.submit()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))
    assert done.goodput.recoveries == 0
    assert done.goodput.productive_seconds > 0
    assert done.goodput.ratio == 1.0


def test_pause_then_resume_through_the_cli_skips_and_repeats_no_step(
    cluster: Cluster, standalone_hash: str
) -> None:
    job = cluster.submit()  # returns once the ranks are stepping: the pause lands mid-run
    cli = CliRunner()
    server = ["--server", cluster.scheduler.address]
    paused = cli.invoke(app, [*server, "job", "pause", job.id], catch_exceptions=False)
    assert paused.exit_code == 0, paused.output
    assert cluster.get(job.id).state == common_pb2.JOB_STATE_PAUSED
    resumed = cli.invoke(app, [*server, "job", "resume", job.id], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1  # paused and resumed in place: never restarted
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))


FAULTS = ["rank_killed", "agent_killed", "node_killed", "fatal_xid"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_at_a_random_step_ends_with_the_fault_free_hash(
    cluster: Cluster, standalone_hash: str, fault: str
) -> None:
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    victim_rank = random.randrange(4)
    at_step = random.randint(8, STEPS // 2)
    victim = cluster.node_of(job, victim_rank)
    cluster.wait_for_step(job, victim_rank, at_step)
    if fault == "rank_killed":
        (pid,) = cluster.rank_pids(victim.node_id)
        killpg(pid, signal.SIGKILL)
    elif fault == "agent_killed":
        assert victim.agent is not None
        killpg(victim.agent.pid, signal.SIGKILL)  # its ranks and checkpointd live on
    elif fault == "node_killed":
        cluster.kill_node(victim.node_id)
    else:
        cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    done = cluster.finish(job.id)
    context = f"{fault} on {victim.node_id} (rank {victim_rank}) at step {at_step}"
    check_result(done, standalone_hash)
    assert done.generation >= 2, context
    moved = {a.node_id for a in done.rank_map.ranks}
    if fault == "rank_killed":
        assert victim.node_id in moved, context  # restarted in place
    else:
        assert victim.node_id not in moved, context
        assert SPARE in moved, context
    for rank in range(4):
        assert all_steps_logged(cluster, done, rank) == set(range(1, STEPS + 1)), context
    # Recovered from the in-memory snapshots, not restarted from the beginning.
    restored = restored_steps(cluster, done)
    assert restored, (context, cluster.logs(job.id))
    assert min(restored) > 0, (context, restored)
    # The goodput account names the failure and splits its cost; `job show` prints it.
    goodput = done.goodput
    assert goodput.recoveries >= 1, goodput
    assert 0 < goodput.ratio < 1, goodput
    first = goodput.incidents[0]
    assert first.resumed, goodput
    assert first.resume_seconds > 0, goodput
    if fault != "rank_killed":
        assert victim.node_id in first.cause, goodput
    shown = CliRunner().invoke(
        app, ["--server", cluster.scheduler.address, "job", "show", job.id], catch_exceptions=False
    )
    assert shown.exit_code == 0, shown.output
    assert "recoveries" in shown.output
    assert first.cause.split()[0] in shown.output


@pytest.mark.timeout(240)
def test_spares_exhausted_the_job_shrinks_by_one_replica_and_finishes(
    cluster: Cluster, standalone_hash: str
) -> None:
    """The first lost node takes the spare; the second leaves none, so the job goes on
    with three replicas (min_dp 3). The example splits its global batch into the same
    four shards at any world size, so even the shrunk run ends bitwise equal."""
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), min_dp=3)
    first = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, 10)
    cluster.kill_node(first.node_id)
    cluster.job_event(job.id, "job.recovered")
    moved = cluster.get(job.id)
    assert SPARE in {a.node_id for a in moved.rank_map.ranks}
    second = cluster.node_of(moved, 2)
    cluster.wait_for_step(moved, 2, 25)
    cluster.kill_node(second.node_id)
    shrunk = cluster.job_event(job.id, "job.recovering", "job.reconfigured")
    assert "shrunk to dp=3" in shrunk.reason, shrunk
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.rank_map.world_size == 3
    assert {a.node_id for a in done.rank_map.ranks}.isdisjoint({first.node_id, second.node_id})
    assert done.goodput.recoveries >= 2


def test_a_redis_flush_mid_run_loses_nothing(cluster: Cluster, standalone_hash: str) -> None:
    """Redis holds only hot state (heartbeat deadlines, step streams, live health): with
    all of the scheduler's keys gone mid-run, the job still finishes bitwise equal, and
    no node is declared lost for it."""
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    cluster.wait_for_step(job, 0, 20)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        keys = list(client.scan_iter(match=f"{cluster.redis_prefix}*"))
        assert keys  # the scheduler's hot state was there
        client.delete(*keys)
    finally:
        client.close()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(limit=1000))
    assert "node.lost" not in [e.kind for e in log.events]
