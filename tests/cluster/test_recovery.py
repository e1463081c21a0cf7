"""The fault matrix: the example job (pitstop.trainer.example, dp=4, one rank per node)
under a real scheduler, real agents and real checkpoint daemons, one of each per node,
plus one or two spares. Whatever fails mid-run (a rank, an agent, a whole node, an Xid,
a slow GPU, the scheduler, the leader, PostgreSQL, Redis, the network, two nodes, a node
during a recovery, a shard in memory, the durable store, the last spare), the job
succeeds with the same final-weights hash as the example run standalone in one process
(the hash does not depend on the world size)."""

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
from typing import Any, BinaryIO

import grpc
import pytest
import redis
from kit.events import follow_events
from kit.forking import ForkClient, ForkedChild, ForkServerProcess, forking, run_mesh_ranks
from kit.ports import free_port
from kit.schedulers import SchedulerProcess, SchedulerThread, scheduler_settings
from kit.stores import PostgresProcess, StoreUrls, unique
from typer.testing import CliRunner

from pitstop.agent.config import SOCKET_NAME
from pitstop.agent.identity import enroll, identity_for
from pitstop.checkpointd.instances import remove_stale_segments
from pitstop.checkpointd.slots import segment_prefix
from pitstop.client import scenario
from pitstop.client.cli import app
from pitstop.client.cpuload import cpu_load_from_env
from pitstop.client.localcluster import rank_pids
from pitstop.client.netns import IFACE, Network
from pitstop.client.netns import create as create_network
from pitstop.client.netns import destroy as destroy_network
from pitstop.common.codeversion import code_version
from pitstop.common.tls import open_channel
from pitstop.rankside.peers import pull_shard
from pitstop.v1 import (
    checkpoint_pb2,
    checkpoint_pb2_grpc,
    common_pb2,
    jobs_pb2,
    jobs_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
)

# A scenario waits up to WAIT_TIMEOUT for each event and then fails with the cluster's
# logs; pytest's own timeout (only the test's stacks) is the backstop for a hang elsewhere.
WAIT_TIMEOUT = 150.0
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


@pytest.fixture(scope="module", autouse=True)
def cpu_load() -> Iterator[None]:
    """PITSTOP_TEST_CPU_LOAD=2 runs the fault matrix beside two busy processes, as on a
    user's loaded machine (see pitstop.client.cpuload); unset, nothing runs beside it."""
    with cpu_load_from_env():
        yield


STEPS = 30
STEP_SECONDS = 0.05  # each step's work paced (the exchange and snapshot come on top), so a
# fault lands mid-run
HANDOVER_STEP_SECONDS = 0.5  # a run that must outlast a leader handover
SLOW_STEP_SECONDS = 0.2  # where a fault waits for a committed step, which trails the
# ranks by the daemons' reports (seconds on a busy machine): the run must outlast it
# A silent node is lost after 8 beats of 0.5 s (4 s, as in the local cluster). A shorter
# deadline declared live nodes lost while a CPU load and four ranks starved the 2-core
# machine; a stream that breaks is noticed at once either way.
LIVENESS_INTERVALS = 8.0
WORKERS = ["n0", "n1", "n2", "n3"]
SPARE = "sp"
TIMEOUT = 90.0
EXAMPLE = [sys.executable, "-m", "pitstop.trainer.example", "--steps", str(STEPS)]
BIN = Path(sys.executable).parent
STEP_LINE = re.compile(rb'^\{"rank": (\d+), "step": (\d+), ')


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
def rank_forks(fork_server: Path) -> Iterator[ForkClient]:
    """This test's own connection to the ranks' fork server (for ranks it starts itself)."""
    client = ForkClient(fork_server)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def daemon_forks() -> Iterator[ForkClient]:
    """A fork server with the agent and the checkpoint daemon imported, and this test's
    connection to it: every scenario starts five of each, forked rather than each
    importing gRPC, pydantic and the rest afresh (as for the ranks: a cluster's start is
    not what the matrix tests; the local cluster's tests start its daemons afresh)."""
    with forking("pitstop.agent.main,pitstop.checkpointd.main", clean_env()) as client:
        yield client


@pytest.fixture(scope="module")
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


@dataclass
class Node:
    """One node: its checkpoint daemon and its agent, each a process group of its own."""

    node_id: str
    root: Path
    rack: str
    role: str
    scheduler: str
    checkpointd: subprocess.Popen[str] | ForkedChild | None = None
    agent: subprocess.Popen[bytes] | ForkedChild | None = None
    checkpointd_address: str = ""
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    checkpointd_env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # what its daemons listen on and its ranks are reached at
    netns: str = ""  # the network namespace its daemons (and so its ranks) run in
    iface: str = ""  # the interface its ranks' gloo uses (GLOO_SOCKET_IFNAME); "": any
    gpus: int = 1  # simulated GPUs
    tls: bool = False  # mutual TLS with the node's certificate (enrolled before start)
    fork_server: Path | None = None  # where its agent forks ranks from, if anywhere
    daemons: ForkClient | None = None  # where its daemons are forked from, if anywhere

    def _in_netns(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *command] if self.netns else command

    def start(self) -> None:
        """Start the checkpoint daemon; `start_agent` follows once it listens."""
        command = [
            str(BIN / "pitstop-checkpointd"),
            "run",
            "--node-id",
            self.node_id,
            "--host",
            self.host,
            "--port",
            "0",
            "--scheduler",
            self.scheduler,
            "--state-dir",
            str(self.root / "checkpointd"),
            "--log-level",
            "WARNING",
            *(["--tls-dir", str(self.tls_dir)] if self.tls else []),
        ]
        env = clean_env()
        env["PITSTOP_CHECKPOINTD_MEMORY_BUDGET_BYTES"] = str(256 << 20)
        env["PITSTOP_CHECKPOINTD_FLUSH_EVERY_STEPS"] = "1000"
        env["PITSTOP_CHECKPOINTD_RETRY_MAX_SECONDS"] = "0.5"
        env.update(self.checkpointd_env)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.daemons is not None and not self.netns:
            self.checkpointd = self.daemons.launch(
                [sys.executable, *command], env, self.root / "checkpointd.log"
            )
            return
        self.checkpointd = subprocess.Popen(
            self._in_netns(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=self._read, args=(self.checkpointd,), daemon=True).start()

    @property
    def tls_dir(self) -> Path:
        """The node's identity: the agent's <state_dir>/tls."""
        return self.root / "agent" / "tls"

    @property
    def agent_log(self) -> Path:
        return self.root / "agent.log"

    def start_agent(self) -> None:
        """Start the agent, pointed at the checkpoint daemon (waits until it listens)."""
        self.checkpointd_address = self._wait_for_line("listening on").split("listening on ")[1]
        self.checkpointd_address = self.checkpointd_address.split()[0]
        self.root.mkdir(parents=True, exist_ok=True)
        with self.agent_log.open("ab") as log:
            self._spawn_agent(log)

    def _spawn_agent(self, log: BinaryIO) -> None:
        command = [
            str(BIN / "pitstop-agent"),
            "run",
            "--node-id",
            self.node_id,
            "--scheduler",
            self.scheduler,
            "--gpus",
            f"sim:{self.gpus}",
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
            "--advertise-host",
            self.host,
            "--log-level",
            "WARNING",
            *(["--tls"] if self.tls else []),
            *(["--fork-server", str(self.fork_server)] if self.fork_server else []),
        ]
        # An idle node checks itself every second: a drilled preflight failure shows at once.
        env = clean_env() | {"PITSTOP_AGENT_PREFLIGHT_INTERVAL_SECONDS": "1"}
        if self.daemons is not None and not self.netns:
            argv = [sys.executable, *command]
            self.agent = self.daemons.launch(argv, env, self.agent_log)
            return
        self.agent = subprocess.Popen(
            self._in_netns(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env | ({"GLOO_SOCKET_IFNAME": self.iface} if self.iface else {}),
            start_new_session=True,
        )

    def _read(self, checkpointd: subprocess.Popen[str]) -> None:
        assert checkpointd.stdout is not None
        with (self.root / "checkpointd.log").open("a") as kept:  # for a failure's context
            for line in checkpointd.stdout:
                kept.write(line)
                kept.flush()
                self.lines.put(line.rstrip())

    def _wait_for_line(self, text: str) -> str:
        """The checkpoint daemon's first output line holding `text`."""
        deadline = time.monotonic() + TIMEOUT
        if isinstance(self.checkpointd, ForkedChild):  # its output goes to its log file
            log, seen = self.root / "checkpointd.log", 0
            while time.monotonic() < deadline:
                try:
                    lines = log.read_text(errors="replace").splitlines()
                except FileNotFoundError:  # the forked daemon has not opened it yet
                    lines = []
                found = [line for line in lines[seen:] if text in line]
                if found:
                    return found[0]
                seen = max(0, len(lines) - 1)  # the last line may still be incomplete
                if self.checkpointd.poll() is not None:
                    break
                time.sleep(0.02)
            said = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise AssertionError(f"checkpointd of {self.node_id} never said {text!r}:\n{said}")
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
        """SIGTERM to its daemons; `wait_stopped` waits for them (SIGKILL after 30 s)."""
        for proc in (self.agent, self.checkpointd):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
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


def wait_until(condition: Any, what: str) -> None:
    """Poll `condition` until it holds (the condition, not the time, ends the wait)."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


class Cluster:
    """A deciding scheduler, four worker nodes in four racks and a spare."""

    def __init__(self, scheduler: SchedulerProcess | SchedulerThread, root: Path) -> None:
        self.scheduler = scheduler
        self.root = root
        # A scheduler with TLS on: the test's clients check it against the cluster CA.
        self.ca: Path | None = getattr(scheduler, "ca", None)
        self.events = self.follow(0, 4 * TIMEOUT)
        self.last_event_id = 0
        self.jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
        self.node_api = nodes_pb2_grpc.NodeServiceStub(scheduler.channel())
        self.event_api = nodes_pb2_grpc.EventServiceStub(scheduler.channel())
        self.nodes: dict[str, Node] = {}

    network: Network | None = None
    daemons: ForkClient | None = None
    """Where the nodes' daemons are forked from (not those of a node in a network
    namespace of its own)."""
    fork_server: Path | None = None
    """The fork server the agents start ranks from (not those in a network namespace
    of their own, whose ranks must live there too)."""

    def start(
        self,
        spares: int = 1,
        checkpointd_env: dict[str, str] | None = None,
        network: Network | None = None,
        gpus: int = 1,
    ) -> None:
        """Start the nodes (their checkpoint daemons with `checkpointd_env`); returns
        once every one is registered. With `network`, its nodes run in their namespaces
        and the others here, reached at the bridge's address."""
        self.network = network
        specs = [(n, f"r{i}", "worker") for i, n in enumerate(WORKERS)]
        specs += [(f"{SPARE}{i or ''}", f"r{i}", "spare") for i in range(spares)]
        for node_id, rack, role in specs:
            node = Node(node_id, self.root / node_id, rack, role, self.scheduler.address)
            node.gpus = gpus
            node.checkpointd_env = dict(checkpointd_env or {})
            if network is not None:
                inside = {link.node_id: link for link in network.links}.get(node_id)
                node.host = network.gateway if inside is None else inside.address
                node.netns = "" if inside is None else inside.namespace
                node.iface = network.bridge if inside is None else IFACE
                port = self.scheduler.address.rsplit(":", 1)[1]
                node.scheduler = f"{network.gateway}:{port}"
            node.fork_server = None if node.netns else self.fork_server
            node.daemons = self.daemons
            self.nodes[node_id] = node
            if self.ca is not None:  # the node enrolls (its agent then finds its certificate)
                node.tls = True
                made = self.node_api.CreateJoinToken(
                    nodes_pb2.CreateJoinTokenRequest(ttl_seconds=600, node_id=node_id), timeout=10
                )
                identity = identity_for(node.root / "agent", node_id)
                enroll(identity, self.scheduler.address, made.token, self.ca)
            node.start()
        for node in self.nodes.values():  # the daemons started side by side: now the agents
            node.start_agent()
        deadline = time.monotonic() + TIMEOUT / 2
        while missing := set(self.nodes) - self.connected():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"nodes {sorted(missing)} never registered; their agents said:\n"
                    + "\n".join(
                        f"{n}: {self.nodes[n].agent_log.read_text(errors='replace')[-2000:]}"
                        for n in sorted(missing)
                    )
                )
            time.sleep(0.05)

    def buddy_of(self, node_id: str) -> str:
        """The node's snapshot buddy, asked of the catalog as the node itself (its agent
        role comes from its certificate when the cluster runs mutual TLS)."""
        node = self.nodes[node_id]
        identity = identity_for(node.root / "agent", node_id) if node.tls else None
        with open_channel(self.scheduler.address, identity, to_scheduler=True) as channel:
            catalog = checkpoint_pb2_grpc.CheckpointCatalogServiceStub(channel)
            request = checkpoint_pb2.GetBuddyRequest(node_id=node_id)
            return str(catalog.GetBuddy(request, timeout=10).buddy_node_id)

    def cli_options(self) -> list[str]:
        """The `pitstop` CLI's options to reach this cluster's scheduler."""
        return ["--server", self.scheduler.address] + (
            ["--ca-cert", str(self.ca)] if self.ca is not None else []
        )

    def follow(self, after: int, timeout: float, wait_for_ready: bool = False) -> follow_events:
        """The event stream after event `after`."""
        return follow_events(
            self.scheduler.address, after, timeout, wait_for_ready=wait_for_ready, ca=self.ca
        )

    def connected(self) -> set[str]:
        """The nodes whose agents are connected to the scheduler now."""
        listed = self.node_api.List(nodes_pb2.ListNodesRequest(), timeout=10)
        return {n.id for n in listed.nodes if n.connected}

    def wait(self, match: Any, what: str = "the awaited event", job_id: str = "") -> Any:
        """The next event `match` accepts, within WAIT_TIMEOUT; past it, the test fails with the
        cluster's logs (not later, from pytest's timeout, with only the test's stacks). A
        scheduler that dies cuts the stream: it is followed again, from the last event
        seen, once a scheduler answers there."""
        deadline = time.monotonic() + WAIT_TIMEOUT
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self.events.close()  # ends the blocked read below

        timer = threading.Timer(WAIT_TIMEOUT, expire)
        timer.start()
        try:
            while True:
                try:
                    for event in self.events:
                        self.last_event_id = event.id
                        if match(event):
                            return event
                    raise AssertionError(f"the event stream ended before {what}")
                except grpc.RpcError as exc:
                    left = deadline - time.monotonic()
                    if expired.is_set() or left <= 0:
                        raise AssertionError(
                            f"no {what} within {WAIT_TIMEOUT:.0f}s\n{self.logs(job_id)}"
                        ) from None
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    self.events.close()
                    self.events = self.follow(self.last_event_id, left, wait_for_ready=True)
        finally:
            timer.cancel()
            if expired.is_set():  # a later wait follows from the last event seen
                self.events = self.follow(self.last_event_id, 4 * TIMEOUT)

    def job_event(self, job_id: str, *kinds: str) -> Any:
        return self.wait(
            lambda e: e.job_id == job_id and e.kind in kinds,
            f"event {' or '.join(kinds)} of job {job_id}",
            job_id,
        )

    redis_url = ""
    redis_prefix = ""
    durable_url = ""

    def submit(
        self,
        *extra: str,
        min_dp: int = 4,
        straggler: jobs_pb2.StragglerPolicy | None = None,
        env: dict[str, str] | None = None,
        standby: bool = True,
        integrity: jobs_pb2.IntegrityPolicy | None = None,
        dp: int = 4,
    ) -> jobs_pb2.Job:
        """Submit the example job; returns once it runs. With `standby`, its spare holds a
        standby process (only tests that move a rank to a spare need one)."""
        spec = jobs_pb2.JobSpec(
            straggler=straggler,
            integrity=integrity,
            name=unique("gpt"),
            command=[*EXAMPLE, "--log-every", "1", *extra],
            dp=dp,
            min_dp=min(min_dp, dp),
            gpus_per_node=1,
            spares=1,
            max_restarts=3,
            standby_processes=standby,
            # The default 30 s collective timeout: no recovery may wait it out.
            env={"PYTHONUNBUFFERED": "1", **(env or {})},
        )
        return self.submit_spec(spec)

    def submit_spec(self, spec: jobs_pb2.JobSpec) -> jobs_pb2.Job:
        """Submit `spec`; returns once the job runs."""
        job = self.jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
        running = self.job_event(job.id, "job.running", "job.failed", "job.cancelled")
        assert running.kind == "job.running", (running, self.logs(job.id))
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

        def reached() -> bool:
            text = path.read_bytes() if path.exists() else b""
            return any(
                int(m.group(2)) >= step for m in map(STEP_LINE.match, text.splitlines()) if m
            )

        wait_until(reached, f"rank {rank} logs step {step}")

    def wait_for_commit(self, job: jobs_pb2.Job) -> None:
        """Until the catalog has committed a step of the job (every rank's snapshot on
        two nodes): from then on a single node's loss restores from memory. Before it,
        a recovery rightly starts over; on a busy machine the daemons' reports reach
        the scheduler seconds after the ranks log their steps."""
        wait_until(lambda: self.get(job.id).committed_step >= 1, f"a committed step of {job.id}")

    def apart_from(self, job: jobs_pb2.Job, first: str) -> str:
        """A worker of the job in no buddy pair with `first`: neither holds the other's
        replicas, so losing both leaves every rank a copy."""
        buddy = self.buddy_of(first)
        workers = [a.node_id for a in job.rank_map.ranks if a.node_id != first]
        assert buddy in workers, (first, buddy)
        return next(n for n in workers if n != buddy and self.buddy_of(n) != first)

    def rank_pids(self, node_id: str) -> list[int]:
        """The rank processes the node's agent started (found by their agent socket)."""
        socket = str(self.nodes[node_id].root / "agent" / SOCKET_NAME)
        return rank_pids({node_id: socket})[node_id]

    def kill_node(self, node_id: str, signum: signal.Signals = signal.SIGKILL) -> None:
        """kill -9 of everything on the node: its agent, its checkpoint daemon, its ranks.
        With SIGSTOP, a frozen node: to the others as a host that lost power or its
        network, nothing answers and no connection is reset."""
        node = self.nodes[node_id]
        ranks = self.rank_pids(node_id)
        for proc in (node.agent, node.checkpointd):
            assert proc is not None
            killpg(proc.pid, signum)
        for pid in ranks:
            killpg(pid, signum)

    def inject(self, node_id: str, fault: common_pb2.Fault) -> None:
        self.node_api.InjectFault(nodes_pb2.InjectFaultRequest(node_id=node_id, fault=fault))

    def logs(self, job_id: str = "") -> str:
        """The cluster's event log, the tail of the scheduler's log, then the tail of every
        rank log of the job (of every job without one)."""
        out = ["== events"]
        with contextlib.suppress(grpc.RpcError):
            listed = self.event_api.List(
                nodes_pb2.ListEventsRequest(after_event_id=-1, limit=1000), timeout=10
            )
            out += [
                f"{e.time.ToDatetime():%H:%M:%S.%f} {e.kind} {e.job_id} {e.node_id} {e.reason}"
                for e in listed.events
            ]
        log = getattr(self.scheduler, "log", None)  # a process's; a thread logs to pytest
        if log is not None and log.exists():
            out.append(f"== scheduler\n{log.read_text(errors='replace')[-3000:]}")
        for node in self.nodes.values():
            ranks = node.root / "agent" / "ranks"
            for path in sorted(ranks.glob(f"{job_id or '*'}/*.log")):
                out.append(f"== {node.node_id} {path.name}\n{path.read_text()[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for node in self.nodes.values():  # every node stops side by side
            node.stop()
        if isinstance(self.scheduler, SchedulerProcess):  # and the scheduler beside them (a
            # second SIGTERM, from its own stop, is the same request)
            self.scheduler.proc.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            node.wait_stopped()
        # A daemon killed with SIGKILL (a node's death) cannot unlink its shared memory;
        # the next daemon of that node id would. Nothing comes after a test's cluster.
        for node_id in self.nodes:
            remove_stale_segments(segment_prefix(node_id))
        self.events.close()


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


@contextlib.contextmanager
def full_filesystem(path: Path) -> Iterator[None]:
    """A 64 KiB tmpfs at `path`, filled to the last byte (needs root to mount)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True)
    try:
        with (path / "filler").open("wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:  # until ENOSPC
                filler.write(bytes(4096))
        assert os.statvfs(path).f_bavail == 0
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def network_namespace(node: str) -> Iterator[Network]:
    """Node `node` in a network namespace of its own, behind a bridge here."""
    network = create_network([node])
    try:
        yield network
    finally:
        destroy_network(network)


@pytest.fixture
def netns_node() -> str:
    """The node that runs in a network namespace of its own; "" for none."""
    return ""


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
) -> Iterator[Cluster]:
    if full_durable_store and os.geteuid() != 0:
        pytest.skip("a full durable store is a tiny tmpfs: mounting it needs root")
    if netns_node and (os.geteuid() != 0 or shutil.which("ip") is None):
        pytest.skip("cutting a node off by its network namespace needs root and iproute2")
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="pr-"))  # short: the agent socket path
    prefix = f"{stores.redis_prefix}{unique('rec')}:"
    checkpointd_env = {}
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PITSTOP_E2E_KEEP"):
            stack.callback(shutil.rmtree, root, ignore_errors=True)
        if full_durable_store:
            stack.enter_context(full_filesystem(root / "store"))
            checkpointd_env = {
                "PITSTOP_CHECKPOINTD_DURABLE_URL": f"file://{root / 'store' / 'durable'}",
                "PITSTOP_CHECKPOINTD_FLUSH_EVERY_STEPS": "5",
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
                "PITSTOP_LIVENESS_TIMEOUT_INTERVALS": str(LIVENESS_INTERVALS),
                "PITSTOP_LIVENESS_STARTUP_GRACE_SECONDS": "0",
                # Reachable from a node in a network namespace too.
                "PITSTOP_HOST": "0.0.0.0" if network else "127.0.0.1",
                "GRPC_VERBOSITY": "ERROR",
            }
            if tls:
                env |= {"PITSTOP_TLS": "true", "PITSTOP_NODE_PORT": "0"}
            scheduler = SchedulerProcess(root, "scheduler", env)
        stack.callback(scheduler.stop)
        built = Cluster(scheduler, root)
        built.fork_server = fork_server
        built.daemons = daemon_forks
        stack.callback(built.stop)  # also when a node fails to start
        built.start(spares, checkpointd_env, network, gpus)
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


@dataclass
class ProcessCluster:
    """A cluster whose schedulers are processes: the first leads; the nodes and the test
    talk to the last one (`cluster.scheduler`)."""

    root: Path
    cluster: Cluster = field(init=False)
    schedulers: list[SchedulerProcess] = field(default_factory=list)
    postgres: PostgresProcess | None = None

    def restart_postgres(self) -> None:
        """Stop the test's own PostgreSQL and start it again on the same data."""
        assert self.postgres is not None
        self.postgres.stop()
        self.postgres = None
        self.postgres = PostgresProcess(self.root / "pg")


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


def steps_logged(cluster: Cluster, job: jobs_pb2.Job, rank: int) -> list[int]:
    """The steps `rank` printed, in order, over every process that ran it on its node."""
    path = cluster.node_of(job, rank).rank_log(job.id, rank)
    return [
        int(m.group(2))
        for line in path.read_bytes().splitlines()
        if (m := STEP_LINE.match(line)) is not None
    ]


RESTORED_LINE = re.compile(rb"rank (\d+) restored step (\d+) from ")


def restored_steps(cluster: Cluster, job: jobs_pb2.Job) -> list[int]:
    """The step each restarted rank process restored, from every rank log."""
    steps = []
    for node in cluster.nodes.values():
        for path in (node.root / "agent" / "ranks" / job.id).glob("*.log"):
            steps += [int(m.group(2)) for m in RESTORED_LINE.finditer(path.read_bytes())]
    return steps


def steps_never_run(cluster: Cluster, job: jobs_pb2.Job, rank: int) -> set[int]:
    """The steps of 1..STEPS that no process of `rank` printed nor restored. A rank
    prints a step after its snapshot: a kill between the two leaves a step that ran
    (its snapshot is the one restored) without its line."""
    restored: set[int] = set()
    for node in cluster.nodes.values():
        for path in (node.root / "agent" / "ranks" / job.id).glob("*.log"):
            restored.update(
                int(m.group(2))
                for m in RESTORED_LINE.finditer(path.read_bytes())
                if int(m.group(1)) == rank
            )
    return set(range(1, STEPS + 1)) - all_steps_logged(cluster, job, rank) - restored


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
    assert done.generation == 1, cluster.logs(job.id)  # nothing was recovered
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))
    assert done.goodput.recoveries == 0
    assert done.goodput.productive_seconds > 0
    assert done.goodput.ratio == 1.0
    # The spare held a standby process for the job; it goes when the job ends.
    standby_log = cluster.nodes[SPARE].root / "agent" / "ranks" / job.id / "standby-gpu0.log"
    assert "--- pitstop: standby on GPU 0" in standby_log.read_text()
    wait_until(lambda: cluster.rank_pids(SPARE) == [], "the standby process stops")


def test_pause_then_resume_through_the_cli_skips_and_repeats_no_step(
    cluster: Cluster, standalone_hash: str
) -> None:
    job = cluster.submit(
        standby=False
    )  # returns once the ranks are stepping: the pause lands mid-run
    cli = CliRunner()
    server = cluster.cli_options()
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


def check_plaintext_refused(cluster: Cluster) -> None:
    """Every checkpoint daemon answers a plaintext client with a failed handshake only."""
    assert cluster.ca is not None
    for node in cluster.nodes.values():
        with grpc.insecure_channel(node.checkpointd_address) as plain:
            stub = checkpoint_pb2_grpc.CheckpointServiceStub(plain)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListShards(checkpoint_pb2.ListShardsRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no handshake


def check_shards_stay_in_the_job(cluster: Cluster, done: jobs_pb2.Job, lost: str) -> None:
    """An enrolled node that runs no rank of the job reads none of its shards, a member
    node may, and no node acts as another node's ranks on its daemon."""
    assert cluster.ca is not None
    made = cluster.node_api.CreateJoinToken(nodes_pb2.CreateJoinTokenRequest(), timeout=10)
    outsider = identity_for(cluster.root / "outsider", "outsider")
    enroll(outsider, cluster.scheduler.address, made.token, cluster.ca)
    holder = cluster.node_of(done, 0)
    key = checkpoint_pb2.ShardKey(job_id=done.id, rank=0, step=0)
    with pytest.raises(grpc.RpcError) as denied:
        pull_shard(holder.checkpointd_address, key, identity=outsider)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "runs no rank of job" in denied.value.details()
    member = next(n for n in cluster.nodes.values() if n.node_id not in (holder.node_id, lost))
    insider = identity_for(member.root / "agent", member.node_id)
    header, _ = pull_shard(holder.checkpointd_address, key, identity=insider)  # a member may
    assert header.key.rank == 0
    channel = open_channel(holder.checkpointd_address, insider)
    with channel, pytest.raises(grpc.RpcError) as foreign:
        checkpoint_pb2_grpc.CheckpointServiceStub(channel).AcquireSlot(
            checkpoint_pb2.AcquireSlotRequest(key=key, size_bytes=64), timeout=10
        )
    assert foreign.value.code() == grpc.StatusCode.PERMISSION_DENIED


FAULTS = [
    "rank_killed",
    "agent_killed",
    "node_killed",
    "node_frozen",
    "fatal_xid",
    "application_xid",
]
IN_PLACE = ("rank_killed", "application_xid")  # the rank restarts on its own node


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_at_a_random_step_ends_with_the_fault_free_hash(
    cluster: Cluster, standalone_hash: str, fault: str
) -> None:
    """Every node enrolled with a join token; agents, checkpoint daemons and ranks speak
    mutual TLS with the node's certificate. A fault at a random step: the job ends with
    the fault-free hash, every step run, restored from memory (a killed node's rank from
    its buddy's replica, over TLS)."""
    if fault == "node_killed":  # every wire of the cluster is mutual TLS (the default)
        check_plaintext_refused(cluster)
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=fault not in IN_PLACE)
    victim_rank = random.randrange(4)
    at_step = random.randint(8, STEPS // 2)
    victim = cluster.node_of(job, victim_rank)
    if fault not in IN_PLACE:  # the leader starts the spare's standby once the job runs
        wait_until(lambda: cluster.rank_pids(SPARE) != [], "a standby process on the spare")
    cluster.wait_for_step(job, victim_rank, at_step)
    if fault == "rank_killed":
        (pid,) = cluster.rank_pids(victim.node_id)
        killpg(pid, signal.SIGKILL)
    elif fault == "agent_killed":
        assert victim.agent is not None
        killpg(victim.agent.pid, signal.SIGKILL)  # its ranks and checkpointd live on
    elif fault == "node_killed":
        cluster.kill_node(victim.node_id)
    elif fault == "node_frozen":  # a silent host: no connection reset, its peers blocked
        cluster.kill_node(victim.node_id, signal.SIGSTOP)
    elif fault == "fatal_xid":
        cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    else:  # Xid 13, graphics engine exception: the agent ends the rank on that GPU
        cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=13))
    try:
        done = cluster.finish(job.id)
    finally:
        if fault == "node_frozen":  # its stopped processes would wait out a SIGTERM
            cluster.kill_node(victim.node_id)
    context = f"{fault} on {victim.node_id} (rank {victim_rank}) at step {at_step}"
    check_result(done, standalone_hash)
    assert done.generation >= 2, context
    moved = {a.node_id for a in done.rank_map.ranks}
    if fault in IN_PLACE:
        assert victim.node_id in moved, context  # restarted in place
    else:
        assert victim.node_id not in moved, context
        assert SPARE in moved, context
        # The spare's standby process took the rank: no fresh Python, no torch import.
        adopted = cluster.nodes[SPARE].rank_log(job.id, victim_rank).read_text()
        assert "--- pitstop: standby on GPU 0" in adopted, (context, adopted[-3000:])
        assert f"rank {victim_rank} joined generation" in adopted, (context, cluster.logs(job.id))
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set(), context
    # Recovered from the in-memory snapshots, not restarted from the beginning.
    restored = restored_steps(cluster, done)
    assert restored, (context, cluster.logs(job.id))
    assert min(restored) > 0, (context, restored)
    # The goodput account names the failure and splits its cost; `job show` prints it.
    goodput = done.goodput
    assert goodput.recoveries >= 1, goodput
    assert 0 < goodput.ratio < 1, goodput
    first, last = goodput.incidents[0], goodput.incidents[-1]
    # Under load a first decision can be superseded by a second (its own incident, not
    # resumed); the last one resumed the job.
    assert last.resumed, goodput
    assert last.resume_seconds > 0, goodput
    if fault not in IN_PLACE:
        assert victim.node_id in first.cause, goodput
    if fault in ("agent_killed", "node_killed", "node_frozen"):  # last sign of life to loss
        assert 0 < first.detect_seconds < 5, goodput
    shown = CliRunner().invoke(
        app, [*cluster.cli_options(), "job", "show", job.id], catch_exceptions=False
    )
    assert shown.exit_code == 0, shown.output
    assert "recoveries" in shown.output
    assert first.cause.split()[0] in shown.output
    if fault == "node_killed":  # the spare restored the rank from its buddy over TLS
        check_shards_stay_in_the_job(cluster, done, victim.node_id)


def test_spares_exhausted_the_job_shrinks_by_one_replica_and_finishes(
    cluster: Cluster, standalone_hash: str
) -> None:
    """The first lost node takes the spare; the second leaves none, so the job goes on
    with three replicas (min_dp 3). The example splits its global batch into the same
    four shards at any world size, so even the shrunk run ends bitwise equal."""
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), min_dp=3)
    first = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, 8)
    cluster.kill_node(first.node_id)
    cluster.job_event(job.id, "job.recovered")
    moved = cluster.get(job.id)
    assert SPARE in {a.node_id for a in moved.rank_map.ranks}
    second = cluster.node_of(moved, 2)
    cluster.wait_for_step(moved, 2, STEPS * 2 // 3)
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
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=False)
    cluster.wait_for_step(job, 0, STEPS // 2)
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
    assert node_lost_events(cluster) == []


def check_moved(
    cluster: Cluster, done: jobs_pb2.Job, victims: set[str], from_memory: bool = True
) -> None:
    """Every rank ran every step, and each victim's rank now runs on a spare; with
    `from_memory`, the ranks restored an in-memory snapshot rather than starting over."""
    placed = {a.node_id for a in done.rank_map.ranks}
    assert placed.isdisjoint(victims), (placed, victims)
    assert {SPARE, f"{SPARE}1"} <= placed, placed
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()
    if from_memory:
        restored = restored_steps(cluster, done)
        assert restored, cluster.logs(done.id)
        assert min(restored) > 0, restored


@pytest.mark.parametrize("spares", [2])
@pytest.mark.parametrize("pair", ["apart", "buddies"])
def test_two_nodes_failing_at_once_take_both_spares(
    cluster: Cluster, standalone_hash: str, pair: str
) -> None:
    """Two workers killed together. Apart, each lost rank's replica is on a survivor and
    the job goes on from memory. A node and its buddy hold both copies of one rank's
    newest steps: the job goes back to the newest step still whole (here, with no
    durable flush yet, step 0) and still ends bitwise equal."""
    job = cluster.submit("--step-seconds", str(SLOW_STEP_SECONDS))
    first = cluster.node_of(job, 1).node_id
    second = cluster.buddy_of(first) if pair == "buddies" else cluster.apart_from(job, first)
    assert second in {a.node_id for a in job.rank_map.ranks} - {first}, (first, second)
    cluster.wait_for_step(job, 1, random.randint(8, STEPS // 2))
    if pair == "apart":
        cluster.wait_for_commit(job)
    for node_id in (first, second):
        cluster.kill_node(node_id)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    check_moved(cluster, done, {first, second}, from_memory=pair == "apart")
    assert done.goodput.recoveries >= 1, done.goodput


@pytest.mark.parametrize("spares", [2])
def test_a_node_lost_during_a_recovery_is_replaced_too(
    cluster: Cluster, standalone_hash: str
) -> None:
    """The second node dies while the job is still recovering from the first: the
    recovery in flight is superseded by a new generation, and nothing is lost. The
    second is not in a buddy pair with the first (that loses both copies of a rank's
    newest steps: test_two_nodes_failing_at_once_take_both_spares[buddies])."""
    job = cluster.submit("--step-seconds", str(SLOW_STEP_SECONDS))
    first = cluster.node_of(job, 0).node_id
    second = cluster.apart_from(job, first)
    cluster.wait_for_step(job, 0, random.randint(8, STEPS // 2))
    cluster.wait_for_commit(job)
    cluster.kill_node(first)
    cluster.job_event(job.id, "job.recovering")
    assert cluster.get(job.id).state == common_pb2.JOB_STATE_RECOVERING
    cluster.kill_node(second)
    again = cluster.job_event(job.id, "job.reconfigured", "job.recovering", "job.recovered")
    assert again.kind != "job.recovered", again  # the second loss landed mid-recovery
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    check_moved(cluster, done, {first, second})
    assert done.goodput.recoveries >= 2, done.goodput
    # In place throughout: the first replacement, still starting, was started anew in
    # the second generation rather than left waiting in the first until the fallback.
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(job_id=job.id, limit=1000))
    restarts = [e.reason for e in log.events if e.kind == "job.restarting"]
    assert restarts == [], restarts


def test_a_corrupted_in_memory_shard_is_caught_and_restored_from_the_buddy(
    cluster: Cluster, standalone_hash: str
) -> None:
    """Every shared-memory segment of a node's checkpoint daemon is overwritten, then the
    rank there is killed. Its restart finds the local copy failing its checksum, drops
    it and restores the buddy's replica: the job ends bitwise equal, never training on
    the corrupted bytes."""
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=False)
    rank = random.randrange(4)
    victim = cluster.node_of(job, rank)
    cluster.wait_for_step(job, rank, random.randint(8, STEPS // 2))
    (pid,) = cluster.rank_pids(victim.node_id)
    os.kill(pid, signal.SIGSTOP)  # it writes no newer snapshot while we corrupt
    # The daemon takes calls from its own node only (mutual TLS with the node's identity).
    identity = identity_for(victim.root / "agent", victim.node_id) if victim.tls else None
    daemon = checkpoint_pb2_grpc.CheckpointServiceStub(
        open_channel(victim.checkpointd_address, identity)
    )

    def newest_local() -> int:
        held = daemon.ListShards(checkpoint_pb2.ListShardsRequest(job_id=job.id)).shards
        return max(
            s.header.key.step
            for s in held
            if s.header.key.rank == rank and s.tier == checkpoint_pb2.SHARD_TIER_LOCAL
        )

    # Its newest snapshot is replicated (committed) before the local copies go bad.
    wait_until(lambda: cluster.get(job.id).committed_step >= newest_local(), "commit")
    segments = [
        p for p in Path("/dev/shm").iterdir() if p.name.startswith(segment_prefix(victim.node_id))
    ]
    assert segments
    for path in segments:
        with path.open("r+b") as segment:
            head = segment.read(4096)
            segment.seek(0)
            segment.write(bytes(b ^ 0xFF for b in head))
    killpg(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert victim.node_id in {a.node_id for a in done.rank_map.ranks}  # restarted in place
    log = victim.rank_log(job.id, rank).read_text()
    restores = re.findall(rf"rank {rank} restored step (\d+) from (\w+)", log)
    assert restores, cluster.logs(job.id)
    assert restores[0][1] == "replica", restores
    said = (victim.root / "checkpointd.log").read_text(errors="replace").splitlines()
    assert any("fails its checksum" in line for line in said), said  # caught, not missing
    for each in range(4):
        assert steps_never_run(cluster, done, each) == set()


@pytest.mark.parametrize("full_durable_store", [True])
def test_a_full_durable_store_is_reported_and_training_goes_on(
    cluster: Cluster, standalone_hash: str
) -> None:
    """Every node flushes every 5 steps to a store with no byte free. The flushes fail
    and are reported as events naming the error; no rank waits on them, the in-memory
    copies stay, so a node lost mid-run is still recovered from memory."""
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    failed = cluster.wait(lambda e: e.kind == "checkpoint.flush_failed", "a flush_failed event")
    assert "No space left on device" in failed.reason, failed
    assert f"job {job.id}" in failed.reason, failed
    victim = cluster.node_of(job, 2)
    cluster.wait_for_step(job, 2, random.randint(12, STEPS // 2))
    cluster.kill_node(victim.node_id)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.durable_step == 0  # nothing ever landed
    restored = restored_steps(cluster, done)
    assert restored, cluster.logs(job.id)
    assert min(restored) > 0, restored


def node_lost_events(cluster: Cluster) -> list[str]:
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(limit=1000))
    return [f"{e.node_id}: {e.reason}" for e in log.events if e.kind == "node.lost"]


def test_the_scheduler_killed_and_restarted_mid_run_loses_nothing(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """kill -9 of the only scheduler while the job trains, then a new process on the same
    port: the ranks never stop (they do not need the scheduler to step), the agents
    reconnect, and the new process finishes the job from PostgreSQL, with no node
    declared lost and no restart."""
    cluster = process_cluster.cluster
    (scheduler,) = process_cluster.schedulers
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=False)
    cluster.wait_for_step(job, 0, random.randint(8, STEPS // 2))
    scheduler.kill()
    scheduler.start()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))
    assert node_lost_events(cluster) == []


@pytest.mark.parametrize("standbys", [1])
def test_leader_failover_mid_run_and_the_new_leader_recovers_a_node(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """Two schedulers on one PostgreSQL; the nodes talk to the standby. kill -9 of the
    scheduler that leads mid-run: the other takes the lease, the job trains on, and a
    node killed after the handover is recovered by the new leader."""
    cluster = process_cluster.cluster
    first, second = process_cluster.schedulers
    assert first.leading()
    assert not second.leading()
    # Paced so that the run outlasts the handover (a lease period or two) many times
    # over: the node must die mid-run, after it.
    job = cluster.submit("--step-seconds", str(HANDOVER_STEP_SECONDS))
    cluster.wait_for_step(job, 0, random.randint(3, STEPS // 5))
    # The one that leads now is killed: on a busy machine a late renewal may already
    # have handed the lease to the second mid-run, and killing the first would then
    # hand nothing over.
    wait_until(lambda: first.leading() or second.leading(), "a scheduler leads")
    leader, survivor = (first, second) if first.leading() else (second, first)
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(limit=1000))
    old_holder = [e for e in log.events if e.kind == "scheduler.leader"][-1].actor
    leader.kill()
    # The killed one may have re-taken its own lease just before (a late renewal, its
    # event logged too): the handover is the event of another holder.
    took_over = cluster.wait(
        lambda e: e.kind == "scheduler.leader" and e.actor != old_holder,
        "a scheduler.leader event of the surviving scheduler",
    )
    assert int(took_over.attributes["token"]) > 1, took_over
    # The event is committed before the process acts on it: wait for the act.
    wait_until(survivor.leading, "the surviving scheduler reports that it leads")
    victim = cluster.node_of(job, 2)
    running = cluster.get(job.id)
    assert running.state == common_pb2.JOB_STATE_RUNNING, (running, cluster.logs(job.id))
    cluster.kill_node(victim.node_id)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert SPARE in {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in {a.node_id for a in done.rank_map.ranks}
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()
    assert [victim.node_id in lost for lost in node_lost_events(cluster)] == [True]


@pytest.mark.parametrize("own_postgres", [True])
def test_a_postgresql_restart_mid_run_loses_nothing(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """PostgreSQL stops and starts again while the job trains: the scheduler is
    UNAVAILABLE meanwhile, the ranks keep stepping, and the job finishes bitwise equal
    with every step reported."""
    cluster = process_cluster.cluster
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=False)
    cluster.wait_for_step(job, 0, random.randint(8, STEPS // 3))
    process_cluster.restart_postgres()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1, cluster.logs(job.id)  # nothing was recovered
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))
    assert node_lost_events(cluster) == []


def test_a_slow_gpu_is_swapped_out_as_a_straggler(cluster: Cluster, standalone_hash: str) -> None:
    """A GPU turns 8x slower mid-run. Its rank's compute time (the step less the wait in
    the gradient exchange) stands out, the rank is flagged after two slow windows, and
    the job's swap policy moves it to the spare in place; the job ends bitwise equal.
    Beside a CPU load, a 3x slowdown of a 0.05 s step hid in the others' noise and the
    run ended before the swap: here steps take 0.1 s, so the slow GPU's 0.8 s steps
    leave the swap many steps to land in, however late the fault reaches the node."""
    policy = jobs_pb2.StragglerPolicy(
        action=jobs_pb2.STRAGGLER_ACTION_SWAP, windows=2, window_steps=3, warmup_steps=2
    )
    job = cluster.submit("--step-seconds", str(2 * STEP_SECONDS), straggler=policy)
    rank = random.randrange(4)
    victim = cluster.node_of(job, rank)
    cluster.wait_for_step(job, rank, 3)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, slow_multiplier=8.0))
    flagged = cluster.job_event(job.id, "job.straggler")
    assert flagged.attributes["rank"] == str(rank), flagged
    assert float(flagged.attributes["slowdown"]) > 1.5, flagged
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in placed, f"{placed}\n{cluster.logs(job.id)}"
    assert SPARE in placed, placed
    for each in range(4):
        assert steps_never_run(cluster, done, each) == set()
    assert f"{victim.node_id} swapped out" in done.goodput.incidents[0].cause, done.goodput


def test_silent_corruption_and_nan_losses_are_caught_rolled_back_and_moved_off(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """Failures that do not crash, drilled through the CLI on a dp=4 job (four replicas):
    a NaN loss on one rank rolls every rank back and skips the batch (kept in the job's
    record); a bit flipped in one replica's weights is caught at the next snapshot, that
    rank named against the three that agree, its node quarantined and its rank moved to
    the spare; a second NaN reaches the policy's maximum of two rollbacks and pauses the
    job with the reason. Resumed, the job ends with the hash of a fault-free run told to
    skip the same batches."""
    steps = 70
    policy = jobs_pb2.IntegrityPolicy(max_rollbacks=2)
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1", integrity=policy)
    cli, server = CliRunner(), cluster.cli_options()

    def inject(rank: int, flag: str) -> Node:
        node = cluster.node_of(cluster.get(job.id), rank)
        done = cli.invoke(
            app,
            [*server, "node", "inject-fault", node.node_id, "--gpu", "0", flag],
            catch_exceptions=False,
        )
        assert done.exit_code == 0, done.output
        return node

    cluster.wait_for_step(job, 1, 5)
    inject(1, "--nan")
    rolled = cluster.job_event(job.id, "job.rolled_back")
    assert rolled.attributes["kind"] == "nonfinite", rolled
    assert rolled.attributes["ranks"] == "1", rolled
    first = int(rolled.attributes["skipped_step"])
    assert int(rolled.attributes["rolled_back_to"]) == first - 1, rolled
    assert list(cluster.get(job.id).skipped_steps) == [first]

    corrupt = inject(2, "--sdc")
    found = cluster.job_event(job.id, "job.sdc_detected")
    assert found.attributes["rank"] == "2", found
    assert found.attributes["digest"] != found.attributes["expected_digest"], found
    quarantined = cluster.wait(
        lambda e: e.kind == "node.unhealthy" and e.node_id == corrupt.node_id,
        f"{corrupt.node_id} quarantined",
    )
    assert quarantined.reason.startswith("sdc: "), quarantined
    assert quarantined.attributes["step"] == found.attributes["step"], quarantined
    cluster.job_event(job.id, "job.recovered")

    inject(3, "--nan")
    rolled = cluster.job_event(job.id, "job.rolled_back")
    second = int(rolled.attributes["skipped_step"])
    paused = cluster.job_event(job.id, "job.pause")
    assert "max_rollbacks" in paused.reason, paused
    assert cluster.get(job.id).state == common_pb2.JOB_STATE_PAUSED
    resumed = cli.invoke(app, [*server, "job", "resume", job.id], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    done = cluster.finish(job.id)

    assert list(done.skipped_steps) == [first, second]
    placed = {a.node_id for a in done.rank_map.ranks}
    assert corrupt.node_id not in placed, placed
    assert SPARE in placed, placed
    expected = reference_hash(rank_forks, tmp_path, steps, skipped=[first, second])
    assert done.result["final_weights_sha256"] == expected, cluster.logs(job.id)


def reference_hash(
    forks: ForkClient, folder: Path, steps: int, skipped: list[int] | None = None
) -> str:
    """The example's hash run alone for `steps` steps, told to skip the batches of
    `skipped` (as a job whose checks rolled those steps back does)."""
    log = folder / "reference.log"
    env = clean_env() | {"PITSTOP_SKIP_STEPS": ",".join(map(str, skipped or []))}
    command = [*EXAMPLE, "--steps", str(steps), "--log-every", "0"]
    assert forks.launch(command, env, log).wait(TIMEOUT) == 0, log.read_text()[-3000:]
    said = re.findall(r'"final_weights_sha256": "([0-9a-f]{64})"', log.read_text())
    assert said, log.read_text()[-3000:]
    return said[-1]


def test_with_two_replicas_a_replay_names_the_corrupt_one(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """dp=2: two replicas that disagree cannot outvote each other. Both roll back to the
    last checked step and replay; the fault was transient, so the replay is clean and
    the replica whose first result it does not reproduce is named, its node quarantined
    and its rank moved to the spare. The job ends with the fault-free hash."""
    steps = 60  # at 0.1 s a step, outlasting the fault's way to the rank
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1", dp=2)
    victim = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, 5)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, sdc=True))
    found = cluster.job_event(job.id, "job.sdc_detected")
    assert found.attributes["rank"] == "1", found
    assert found.attributes["ranks"] == "0,1", found
    assert "replay does not reproduce" in found.reason, found
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in placed, placed
    assert SPARE in placed, placed
    replayed = cluster.node_of(done, 0).rank_log(job.id, 0).read_text()
    assert "replaying to tell which is wrong" in replayed, replayed[-3000:]


@pytest.mark.parametrize("spares", [2])
def test_a_spare_that_fails_its_preflight_never_gets_ranks(
    cluster: Cluster, standalone_hash: str
) -> None:
    """A spare whose preflight fails (inject-fault --fail-preflight) is quarantined with
    the reason and never gets ranks: a node lost mid-run moves to the next spare, and
    the job ends with the fault-free hash."""
    failing, good = SPARE, f"{SPARE}1"
    flags = ["--gpu", "0", "--fail-preflight"]
    shown = CliRunner().invoke(
        app,
        [*cluster.cli_options(), "node", "inject-fault", failing, *flags],
        catch_exceptions=False,
    )
    assert shown.exit_code == 0, shown.output
    quarantined = cluster.wait(
        lambda e: e.kind == "node.unhealthy" and e.node_id == failing, f"{failing} quarantined"
    )
    assert "preflight failed: an injected preflight failure" in quarantined.reason, quarantined
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    victim = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, 5)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert failing not in placed, placed
    assert good in placed, placed
    assert victim.node_id not in placed, placed


def test_an_early_warning_drains_the_node_and_moves_its_rank_without_losing_a_step(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A pending row remap (inject-fault --pending-row-remap) is a warning, not a
    failure: the node drains, and once a step is committed its rank moves to the spare
    from that step, the node's own snapshot in memory (no step given up); the job ends
    with the fault-free hash."""
    steps = 80  # at 0.1 s a step: the drain lands mid-run (it waits for a committed step)
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1")
    victim = cluster.node_of(job, 1)
    flags = ["--gpu", "0", "--pending-row-remap"]
    shown = CliRunner().invoke(
        app,
        [*cluster.cli_options(), "node", "inject-fault", victim.node_id, *flags],
        catch_exceptions=False,
    )
    assert shown.exit_code == 0, shown.output
    draining = cluster.wait(
        lambda e: e.kind == "node.draining" and e.node_id == victim.node_id,
        f"{victim.node_id} draining",
    )
    assert "row remap" in draining.reason.lower(), draining
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in placed, cluster.logs(job.id)
    assert SPARE in placed, placed
    (incident,) = done.goodput.incidents
    assert victim.node_id in incident.cause, incident
    assert incident.lost_steps == 0, incident


def test_a_hung_rank_is_named_by_its_stacks_and_replaced(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A rank blocks outside any collective (inject-fault --hang); the others wait for it
    in the gradient exchange, every process alive. After the hang threshold (3 s here)
    the scheduler takes every rank's stacks (py-spy), names the one that is not in the
    all_gather, and replaces it; the job recovers within twice the threshold of its last
    step and ends with the fault-free hash. `pitstop job stacks` shows what was seen."""
    steps, floor = 60, 3.0
    policy = jobs_pb2.IntegrityPolicy(hang_floor_seconds=floor)
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1", integrity=policy)
    victim = cluster.node_of(job, 2)
    cluster.wait_for_step(job, 2, 5)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, hang=True))
    hang = cluster.job_event(job.id, "job.hang")
    assert float(hang.attributes["threshold_seconds"]) == floor, hang
    located = cluster.job_event(job.id, "job.hang_located", "job.hang_unlocated")
    assert located.kind == "job.hang_located", (located, cluster.logs(job.id))
    assert located.attributes["ranks"] == "2", located
    assert located.attributes["incident"] == str(hang.id), located
    recovered = cluster.job_event(job.id, "job.recovered")
    silent = float(hang.attributes["silent_seconds"])
    since_last_step = silent + (recovered.time.ToNanoseconds() - hang.time.ToNanoseconds()) / 1e9
    assert since_last_step <= 2 * floor, (since_last_step, cluster.logs(job.id))
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    shown = CliRunner().invoke(
        app, [*cluster.cli_options(), "job", "stacks", job.id], catch_exceptions=False
    )
    assert shown.exit_code == 0, shown.output
    assert f"hang incident {hang.id} of job {job.id}" in shown.output, shown.output
    assert "hung ranks: 2 (" in shown.output, shown.output
    assert "hang_here" in shown.output, shown.output  # the hung rank's own frame
    assert "all_gather" in shown.output, shown.output  # where the others waited


@pytest.mark.parametrize("netns_node", ["n3"])
def test_a_node_cut_off_by_its_network_namespace_is_replaced(
    cluster: Cluster, standalone_hash: str
) -> None:
    """Node n3 runs in a network namespace of its own. Its link goes down mid-run: its
    processes live on but nothing reaches them. Its heartbeats stop, the scheduler
    declares it lost, its rank moves to the spare and restores the replica its buddy
    holds; the survivors' gradient exchange gives up after the collective timeout and
    they re-form without it. The job ends bitwise equal."""
    network = cluster.network
    assert network is not None
    (cut,) = network.links
    # gloo's peers meet on the bridge's subnet (loopback would not cross namespaces): each
    # node's agent hands its ranks GLOO_SOCKET_IFNAME.
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    (rank,) = [a.rank for a in job.rank_map.ranks if a.node_id == cut.node_id]
    assert rank != 0  # rank 0's host is the rendezvous; the test cuts another node
    cluster.wait_for_step(job, rank, random.randint(8, STEPS // 2))
    network.cut(cut.node_id)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert cut.node_id not in placed, placed
    assert SPARE in placed, placed
    lost = node_lost_events(cluster)
    assert len(lost) == 1, lost
    assert lost[0].startswith(f"{cut.node_id}: "), lost
    for each in range(4):
        assert steps_never_run(cluster, done, each) == set()
    restored = restored_steps(cluster, done)
    assert restored, cluster.logs(job.id)
    assert min(restored) > 0, restored
    # The partitioned host is powered off and its link comes back: the scheduler's end of
    # the dead node's connection is then reset at once, instead of holding the
    # scheduler's stop for its whole grace (10 s of the suite).
    cluster.kill_node(cut.node_id)
    network.heal(cut.node_id)


def dropping_first_sends(generation: int) -> tuple[Any, list[str]]:
    """A CommandRouter.send_many (the fan-out of every decision) that loses the first
    StartRanks or Reconfigure of `generation` to each node, as if the leader died (or
    its send failed) right after committing the decision; the dropped commands' nodes
    are listed."""
    from pitstop.scheduler.gateway import CommandRouter

    real = CommandRouter.send_many
    dropped: list[str] = []

    def lost(node_id: str, message: Any) -> bool:
        kind = message.WhichOneof("body")
        body = getattr(message, kind)
        if (
            kind in ("start_ranks", "reconfigure")
            and body.generation == generation
            and not (kind == "start_ranks" and body.standby_gpus)
            and node_id not in dropped
        ):
            dropped.append(node_id)
            return True
        return False

    async def send_many(self: CommandRouter, commands: list[tuple[str, Any]]) -> None:
        await real(self, [(node_id, m) for node_id, m in commands if not lost(node_id, m)])

    return send_many, dropped


@pytest.mark.parametrize("in_process", [True])
def test_a_recovery_whose_commands_were_lost_after_the_decision_still_recovers(
    cluster: Cluster, standalone_hash: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision commits, and then not one of its commands arrives. Nothing waits for
    the deadline: the next tick re-sends what no agent acknowledged."""
    from pitstop.scheduler.gateway import CommandRouter

    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    send_many, dropped = dropping_first_sends(job.generation + 1)
    monkeypatch.setattr(CommandRouter, "send_many", send_many)
    wait_until(lambda: cluster.rank_pids(SPARE) != [], "a standby process on the spare")
    victim = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, random.randint(8, STEPS // 2))
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    recovering = cluster.job_event(job.id, "job.recovering")
    # Recovered, or (under load the old generation may run to the end meanwhile) the
    # nodes started afresh from the restore step and finished.
    recovered = cluster.job_event(job.id, "job.recovered", "job.succeeded", "job.failed")
    assert recovered.kind != "job.failed", (recovered, cluster.logs(job.id))
    # Every node of the new generation lost its first command, and got it again.
    new_map = {a.node_id for a in cluster.get(job.id).rank_map.ranks}
    assert set(dropped) >= new_map, dropped
    took = recovered.time.ToDatetime() - recovering.time.ToDatetime()
    # No fallback: the recovery was carried out by the re-sends, well within its deadline
    # (ranks that stepped on meanwhile may cost a restart in place, never the deadline).
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(job_id=job.id, limit=1000))
    assert not [e for e in log.events if e.attributes.get("fallback") == "true"], log
    assert took.total_seconds() < 30, took
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()


@pytest.mark.parametrize("standbys", [1])
def test_the_leader_killed_in_the_middle_of_a_recovery_the_new_leader_finishes_it(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """kill -9 of the leader the moment it committed a recovery (its commands may or
    may not have gone out): the standby takes the lease, finds the recovery in
    PostgreSQL and carries it on."""
    cluster = process_cluster.cluster
    leader, standby = process_cluster.schedulers
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    wait_until(lambda: cluster.rank_pids(SPARE) != [], "a standby process on the spare")
    victim = cluster.node_of(job, 2)
    cluster.wait_for_step(job, 2, random.randint(8, STEPS // 2))
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    cluster.job_event(job.id, "job.recovering")
    leader.kill()
    took_over = cluster.wait(lambda e: e.kind == "scheduler.leader", "a scheduler.leader event")
    assert standby.leading(), took_over
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert victim.node_id not in {a.node_id for a in done.rank_map.ranks}
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()


# The 3D example (pitstop.trainer.example3d): tp = pp = dp = 2 on four 2-GPU nodes (a
# node holds one TP pair: a pipeline stage of a replica) and a 2-GPU spare.
STEPS_3D = 16
MODEL_3D = list(scenario.MODEL_3D)
"""One block a stage and two microbatches through 1F1B, as the recovery benchmark's 3D
job: still every kind of parallelism, at 0.4 s a step here rather than the example's
default 1.2 s (8 ranks on 2 cores)."""
EXAMPLE_3D = [
    sys.executable,
    "-m",
    "pitstop.trainer.example3d",
    *MODEL_3D,
    "--steps",
    str(STEPS_3D),
]
DCP_3D = Path(__file__).with_name("dcp3d_rank.py")
JOINED_LINE = re.compile(rb"rank (\d+) joined generation (\d+) at step (\d+)")
RESHARDED_LINE = re.compile(
    rb"rank \d+: step (\d+) resharded from dp=2 \(ranks \[\d+, \d+\]\) to dp=1"
)


@pytest.fixture(scope="module")
def hash_3d(rank_forks: ForkClient) -> str:
    """The 3D example run without pitstop: its 8 ranks (the same mesh) one gloo world on
    loopback, as torchrun would start them (`RANK`, `WORLD_SIZE`, `MASTER_*`), forked
    from the ranks' fork server: the hash every run of it must end with. (torchrun
    itself meets pitstop in tests/integration/test_torchrun.py.)"""
    outputs = run_mesh_ranks(
        [*EXAMPLE_3D[1:], "--log-every", "0"],
        dp=2,
        pp=2,
        tp=2,
        timeout=3 * TIMEOUT,
        fork=rank_forks,
        env=clean_env(),
    )
    said = [re.findall(r'"final_weights_sha256": "([0-9a-f]{64})"', out) for out in outputs]
    hashes = {h for found in said for h in found}
    assert all(said), [out[-1500:] for out in outputs]
    assert len(hashes) == 1, hashes
    return hashes.pop()


@pytest.mark.parametrize("durable_every", [8])
@pytest.mark.parametrize("gpus", [2])
@pytest.mark.parametrize("fault", ["node_killed", "fatal_xid"])
def test_the_3d_job_loses_a_node_and_ends_with_the_fault_free_hash(
    cluster: Cluster, hash_3d: str, fault: str, tmp_path: Path, rank_forks: ForkClient
) -> None:
    """Then, leaving pitstop: torch.distributed.checkpoint loads the job's last durable
    flush (step 16, which the nodes flush to one store) into a fresh 4-rank (dp = 1)
    script, which holds the weights the job ended with. (A load at the saving world size
    and at another is tests/integration/test_dcp_load.py's.)"""
    spec = jobs_pb2.JobSpec(
        name=unique("llama3d"),
        command=[*EXAMPLE_3D, "--log-every", "1", "--step-seconds", str(STEP_SECONDS)],
        tp=2,
        pp=2,
        dp=2,
        min_dp=2,
        gpus_per_node=2,
        spares=1,
        max_restarts=3,
        env={"PYTHONUNBUFFERED": "1"},
    )
    job = cluster.submit_spec(spec)
    victim_rank = random.randrange(8)
    at_step = random.randint(3, STEPS_3D // 2)
    victim = cluster.node_of(job, victim_rank)
    lost = sorted(a.rank for a in job.rank_map.ranks if a.node_id == victim.node_id)
    cluster.wait_for_step(job, victim_rank, at_step)
    if fault == "node_killed":
        cluster.kill_node(victim.node_id)
    else:
        cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    done = cluster.finish(job.id)
    context = f"{fault} on {victim.node_id} (ranks {lost}) at step {at_step}"
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, context
    assert done.result["final_weights_sha256"] == hash_3d, (context, cluster.logs(job.id))
    assert done.current_step == STEPS_3D
    assert done.generation >= 2, context
    placed = {a.rank: a.node_id for a in done.rank_map.ranks}
    assert {placed[r] for r in lost} == {SPARE}, context  # the TP pair moved together
    # Every other rank (the lost pair's pipeline neighbours and the other replica) kept
    # its process and re-formed in place: the mesh rebuilt, its shards moved over.
    for rank in set(range(8)) - set(lost):
        text = cluster.node_of(done, rank).rank_log(job.id, rank).read_bytes()
        joined = [m for m in JOINED_LINE.finditer(text) if int(m.group(1)) == rank]
        assert joined, (context, rank, text[-3000:])
        assert text.count(b'"shape": [2, 2, 2]') == 1, (context, rank)  # one process
    if fault != "node_killed":
        return  # the load is the same after either fault: once is enough
    reader = [str(DCP_3D), "--url", cluster.durable_url, "--job", job.id, *MODEL_3D]
    wait_until(
        lambda: durable_step(cluster.durable_url, job.id) == STEPS_3D,
        f"step {STEPS_3D} of job {job.id} complete in {cluster.durable_url}",
    )
    # Half the job's world size: DCP reshards the dp = 2 flush to one replica.
    out = tmp_path / "dp1.json"
    run_mesh_ranks(
        [*reader, "--out", str(out)], dp=1, pp=2, tp=2, timeout=3 * TIMEOUT, fork=rank_forks
    )
    loaded = json.loads(out.read_text())
    assert loaded == {"step": STEPS_3D, "final_weights_sha256": hash_3d}, loaded


def durable_step(url: str, job_id: str) -> int:
    """The newest complete durable step of the job (0: none yet)."""
    from pitstop.trainer.dcp import DurableCheckpointError, DurableReader

    try:
        return DurableReader(url, job_id).step
    except DurableCheckpointError:
        return 0


@pytest.mark.parametrize("gpus", [2])
def test_the_3d_job_shrinks_to_one_replica_when_the_spares_run_out(cluster: Cluster) -> None:
    """A fatal Xid on a node's GPU: the node is unhealthy and its TP pair moves to the
    spare (its buddies stop replicating to it). Then a node is killed and no spare is
    left, so the job drops the replica that lost it (min_dp 1) and the four survivors
    reshard their FSDP state to dp = 1 from the snapshots of the old ranks, in place, and
    train on to the end with the loss still falling (half the global batch: not the
    fault-free hash)."""
    steps = STEPS_3D + 8
    spec = jobs_pb2.JobSpec(
        name=unique("llama3d"),
        command=[
            *EXAMPLE_3D[:-1],
            str(steps),
            "--log-every",
            "1",
            "--step-seconds",
            str(STEP_SECONDS),
        ],
        tp=2,
        pp=2,
        dp=2,
        min_dp=1,
        gpus_per_node=2,
        spares=1,
        max_restarts=3,
        env={"PYTHONUNBUFFERED": "1"},
    )
    job = cluster.submit_spec(spec)
    first = cluster.node_of(job, random.randrange(8))
    cluster.wait_for_step(job, 0, 3)
    cluster.inject(first.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    cluster.job_event(job.id, "job.recovered")
    moved = cluster.get(job.id)
    assert SPARE in {a.node_id for a in moved.rank_map.ranks}
    assert first.node_id not in {a.node_id for a in moved.rank_map.ranks}  # the pair moved
    victim_rank = random.randrange(8)
    second = cluster.node_of(moved, victim_rank)
    cluster.wait_for_step(moved, victim_rank, steps // 2)
    cluster.kill_node(second.node_id)
    shrunk = cluster.job_event(job.id, "job.recovering", "job.reconfigured")
    assert "shrunk to dp=1" in shrunk.reason, shrunk
    done = cluster.finish(job.id)
    assert done.current_step == steps
    assert done.rank_map.world_size == 4
    assert {a.dp for a in done.rank_map.ranks} == {0}
    assert {a.node_id for a in done.rank_map.ranks}.isdisjoint({first.node_id, second.node_id})
    logs = [p.read_bytes() for p in cluster.root.glob(f"*/agent/ranks/{job.id}/rank-*.log")]
    resharded = [m for text in logs for m in RESHARDED_LINE.finditer(text)]
    # Each survivor cut its shards from both old replicas' snapshots of one step.
    assert len(resharded) >= 4, cluster.logs(job.id)
    restored = {int(m.group(1)) for m in resharded}
    # The last stage's loss, step by step (a step run again after a rollback: its last).
    losses: dict[int, float] = {}
    for text in logs:
        for line in text.splitlines():
            if line.startswith(b'{"rank"') and b'"loss": ' in line:
                said = json.loads(line)
                if said.get("loss") is not None:
                    losses[said["step"]] = said["loss"]
    assert set(losses) == set(range(1, steps + 1)), sorted(losses)
    at = max(restored)
    before = [losses[s] for s in range(at - 3, at + 1)]
    after = [losses[s] for s in range(steps - 3, steps + 1)]
    assert sum(after) / 4 < sum(before) / 4, (at, losses)


def steps_run(cluster: Cluster, job: jobs_pb2.Job, rank: int) -> list[int]:
    """Every step `rank` printed, over every node and process that ran it, sorted: a
    step run twice (restored from before it) appears twice."""
    steps: list[int] = []
    for node in cluster.nodes.values():
        path = node.rank_log(job.id, rank)
        if path.exists():
            steps += [
                int(m.group(2)) for m in map(STEP_LINE.match, path.read_bytes().splitlines()) if m
            ]
    return sorted(steps)


HIGH_STEPS = 20
"""The preempting job's steps (unpaced)."""


def submit_preemptible(cluster: Cluster, *, min_dp: int = 4) -> jobs_pb2.Job:
    """The example on all four workers, paced, preemptible at once; returns once it
    runs."""
    return cluster.submit_spec(
        jobs_pb2.JobSpec(
            name=unique("low"),
            command=[*EXAMPLE, "--log-every", "1", "--step-seconds", "0.1"],
            dp=4,
            min_dp=min_dp,
            gpus_per_node=1,
            preemptible=True,
            min_run_seconds=0,
            env={"PYTHONUNBUFFERED": "1"},
        )
    )


def submit_urgent(cluster: Cluster) -> jobs_pb2.Job:
    """A dp-2 example of priority 10, submitted (not awaited)."""
    spec = jobs_pb2.JobSpec(
        name=unique("high"),
        command=[*EXAMPLE, "--log-every", "1", "--steps", str(HIGH_STEPS)],
        dp=2,
        gpus_per_node=1,
        priority=10,
        env={"PYTHONUNBUFFERED": "1"},
    )
    return cluster.jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job


def finish_all(cluster: Cluster, job_ids: list[str]) -> list[jobs_pb2.Job]:
    """The jobs once every one succeeded, in whichever order they end (each event is
    read once: waiting for one job after another would pass over an earlier end)."""
    ended: set[str] = set()
    while len(ended) < len(job_ids):
        end = cluster.wait(
            lambda e: (
                e.job_id in set(job_ids) - ended
                and e.kind in ("job.succeeded", "job.failed", "job.cancelled")
            ),
            f"the end of {sorted(set(job_ids) - ended)}",
        )
        assert end.kind == "job.succeeded", (end, cluster.logs(end.job_id))
        ended.add(end.job_id)
    return [cluster.get(job_id) for job_id in job_ids]


def test_a_higher_priority_job_preempts_a_preemptible_one_which_resumes_losing_no_step(
    cluster: Cluster, standalone_hash: str, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A preemptible job on every worker loses one to a node failure first: the spare
    takes its place and its role (the failed node is the spare from then on), so the
    worker pool keeps four. A job of higher priority arrives and runs within 10 s of its
    submit. The preempted job stops at a step boundary with its snapshot sealed, waits
    in the queue with its reason and position, resumes by itself once the other
    finished, and ends with its own fault-free hash, every step run exactly once."""
    low = submit_preemptible(cluster)
    lost = cluster.node_of(low, 3).node_id
    cluster.wait_for_step(low, 3, 3)
    cluster.kill_node(lost)
    cluster.job_event(low.id, "job.recovered")
    roles = {n.id: n.role for n in cluster.node_api.List(nodes_pb2.ListNodesRequest()).nodes}
    assert roles[SPARE] == common_pb2.NODE_ROLE_WORKER, roles
    assert roles[lost] == common_pb2.NODE_ROLE_SPARE, roles
    low = cluster.get(low.id)
    cluster.wait_for_step(low, 0, 8)
    submitted = time.monotonic()
    high = submit_urgent(cluster)
    preempted = cluster.job_event(low.id, "job.preempted")
    assert preempted.attributes["by"] == high.id, preempted
    assert preempted.to_state == "pending", preempted
    running = cluster.job_event(high.id, "job.running", "job.failed")
    waited = time.monotonic() - submitted
    assert running.kind == "job.running", (running, cluster.logs(high.id))
    assert waited <= 10.0, f"the high-priority job ran {waited:.1f} s after its submit"
    print(f"the high-priority job ran {waited:.2f} s after its submit")  # for -s runs
    # While it runs, the preempted job waits first in the queue, and says why.
    wait_until(
        lambda: cluster.get(low.id).reason.startswith("capacity:"), "the queue says why it waits"
    )
    queued = cluster.get(low.id)
    assert queued.state == common_pb2.JOB_STATE_PENDING
    assert queued.queue_position == 1
    assert queued.preemptions == 1
    listed = CliRunner().invoke(app, [*cluster.cli_options(), "job", "list"])
    assert listed.exit_code == 0, listed.output
    assert "queue (pending jobs" in listed.output, listed.output
    assert low.id in listed.output, listed.output
    done = cluster.finish(high.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, HIGH_STEPS)
    resumed = cluster.job_event(low.id, "job.resuming")
    stopped_at = int(resumed.attributes["step"])
    assert stopped_at >= 5, resumed
    finished = cluster.finish(low.id)
    check_result(finished, standalone_hash)
    assert lost not in {a.node_id for a in finished.rank_map.ranks}
    for rank in range(4):
        assert set(steps_run(cluster, finished, rank)) == set(range(1, STEPS + 1)), rank
    assert stopped_at in restored_steps(cluster, finished)
    # The preemption gave up no step: the resume restored the step the job stopped at,
    # and no rank ran any step after it twice.
    for rank in range(4):
        after = [s for s in steps_run(cluster, finished, rank) if s > stopped_at]
        assert after == list(range(stopped_at + 1, STEPS + 1)), (rank, after)


def test_a_job_that_may_shrink_gives_up_replicas_rather_than_stopping(
    cluster: Cluster, standalone_hash: str, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A preemptible job with min_dp 2 on all four workers: a higher-priority dp-2 job
    takes two replicas' nodes while the first runs on at dp 2, and both end with their
    own fault-free hashes (the example splits its global batch into the same shards at
    any world size)."""
    low = submit_preemptible(cluster, min_dp=2)
    cluster.wait_for_step(low, 0, 5)
    submitted = time.monotonic()
    high = submit_urgent(cluster)
    shrunk = cluster.job_event(low.id, "job.shrunk", "job.preempted")
    assert shrunk.kind == "job.shrunk", shrunk
    assert shrunk.attributes["by"] == high.id, shrunk
    assert shrunk.attributes["dp"] == "2", shrunk
    running = cluster.job_event(high.id, "job.running", "job.failed")
    assert running.kind == "job.running", (running, cluster.logs(high.id))
    waited = time.monotonic() - submitted
    assert waited <= 10.0, f"the high-priority job ran {waited:.1f} s after its submit"
    done, finished = finish_all(cluster, [high.id, low.id])
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, HIGH_STEPS)
    check_result(finished, standalone_hash)
    assert finished.rank_map.world_size == 2
    assert finished.preemptions == 0


def test_the_records_of_two_runs_with_different_seeds_differ_only_where_the_seed_reaches(
    cluster: Cluster,
) -> None:
    """Two runs of the example, one with another seed: each record names the code the
    client submitted from, the ranks' software and the data digest; their diff shows
    the seed's command line, data digest and results, never the code or the software."""
    here = code_version(Path(__file__).parent)
    submitted = []
    for seed in ("1234", "99"):  # side by side: two workers each
        command = [*EXAMPLE, "--steps", "10", "--seed", seed, "--log-every", "0"]
        spec = jobs_pb2.JobSpec(name=unique("seed"), command=command, dp=2, gpus_per_node=1)
        submitted.append(cluster.jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec, code=here)).job)
    jobs = finish_all(cluster, [job.id for job in submitted])
    cli, server = CliRunner(), cluster.cli_options()
    shown = cli.invoke(app, [*server, "job", "record", jobs[0].id, "--json"])
    assert shown.exit_code == 0, shown.output
    record = json.loads(shown.output)
    assert record["submitted_code"]["git_commit"] == here.git_commit != ""
    (generation,) = record["generations"]
    assert generation["environment"]["torch"]
    assert generation["environment"]["python"]
    assert len(generation["data_digest"]) == 64
    assert record["final_weights_hash"] == jobs[0].result["final_weights_sha256"]
    diffed = cli.invoke(app, [*server, "job", "diff", jobs[0].id, jobs[1].id, "--json"])
    assert diffed.exit_code == 0, diffed.output
    differ = json.loads(diffed.output)["differ"]
    assert "generations.0.data_digest" in differ, differ
    assert "final_weights_hash" in differ, differ
    assert any(key.startswith("spec.command") for key in differ), differ
    unexpected = [
        key
        for key in differ
        if key.startswith(("submitted_code", "generations.0.environment", "generations.0.code"))
        or key in ("spec.dp", "state", "current_step", "spec.project")
    ]
    assert unexpected == [], differ
