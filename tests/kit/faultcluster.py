"""The fault matrix's harness (tests/cluster/): a real scheduler (a process, or a thread
of the test to patch its code), and per node a real checkpoint daemon and agent, started
with the command lines and environments of pitstop.client.launch; the constants its
scenarios share and what they read back from the rank logs."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import grpc

from kit import waits
from kit.dirs import tmpfs
from kit.events import follow_events
from kit.forking import ForkClient, ForkedChild
from kit.processes import line_with
from kit.schedulers import SchedulerProcess, SchedulerThread
from kit.stores import PostgresProcess, unique
from pitstop.agent.config import SOCKET_NAME
from pitstop.agent.identity import enroll, identity_for
from pitstop.checkpointd.instances import remove_stale_segments
from pitstop.checkpointd.slots import segment_prefix
from pitstop.client.launch import agent_command, checkpointd_command, clean_env
from pitstop.client.localcluster import rank_pids
from pitstop.client.netns import IFACE, Network
from pitstop.client.netns import create as create_network
from pitstop.client.netns import destroy as destroy_network
from pitstop.common.tls import open_channel
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
JOB_ENDS = ("job.succeeded", "job.failed", "job.cancelled")
"""The kinds of event that end a job."""


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
STEP_LINE = re.compile(rb'^\{"rank": (\d+), "step": (\d+), ')


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
    agent_env: dict[str, str] = field(default_factory=dict)  # its agent's settings beyond
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
        command = checkpointd_command(
            node_id=self.node_id,
            host=self.host,
            port=0,
            scheduler=self.scheduler,
            state_dir=self.root / "checkpointd",
            log_level="WARNING",
            tls_dir=self.tls_dir if self.tls else None,
        )
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
        command = agent_command(
            node_id=self.node_id,
            scheduler=self.scheduler,
            gpus=f"sim:{self.gpus}",
            zone="z1",
            block="b1",
            rack=self.rack,
            role=self.role,
            state_dir=self.root / "agent",
            checkpointd_address=self.checkpointd_address,
            metrics_port=0,
            advertise_host=self.host,
            log_level="WARNING",
            tls=True if self.tls else None,
            # The host's shared fork server; a node in a namespace of its own starts
            # its ranks fresh (a server forks only into its own namespace).
            fork_server=str(self.fork_server) if self.fork_server else "off",
        )
        # An idle node checks itself every second: a drilled preflight failure shows at once.
        env = clean_env(PITSTOP_AGENT_PREFLIGHT_INTERVAL_SECONDS="1") | self.agent_env
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
        never = f"checkpointd of {self.node_id} never said {text!r}"
        return line_with(self.lines, text, deadline, never)

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


def wait_until(condition: Callable[[], Any], what: str) -> None:
    """Poll `condition` until it holds, up to TIMEOUT (the condition, not the time, ends
    the wait)."""
    waits.wait_until(condition, what, TIMEOUT, poll=0.02)


class Cluster:
    """A deciding scheduler, four worker nodes in four racks and a spare."""

    def __init__(self, scheduler: SchedulerProcess | SchedulerThread, root: Path) -> None:
        self.scheduler = scheduler
        self.root = root
        # A scheduler with TLS on: the test's clients check it against the cluster CA.
        self.ca: Path | None = getattr(scheduler, "ca", None)
        self.events = self.follow(0, 4 * TIMEOUT)
        self.last_event_id = 0
        self.ends: dict[str, Any] = {}
        """The end event (succeeded, failed, cancelled) of each job, from every event a
        wait has read: a wait for one event reads past another job's end."""
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
        agent_env: dict[str, str] | None = None,
    ) -> None:
        """Start the nodes (their checkpoint daemons with `checkpointd_env`, their agents
        with `agent_env`); returns once every one is registered. With `network`, its
        nodes run in their namespaces and the others here, reached at the bridge's
        address."""
        self.network = network
        specs = [(n, f"r{i}", "worker") for i, n in enumerate(WORKERS)]
        specs += [(f"{SPARE}{i or ''}", f"r{i}", "spare") for i in range(spares)]
        for node_id, rack, role in specs:
            node = Node(node_id, self.root / node_id, rack, role, self.scheduler.address)
            node.gpus = gpus
            node.checkpointd_env = dict(checkpointd_env or {})
            node.agent_env = dict(agent_env or {})
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
                        if event.kind in JOB_ENDS:
                            self.ends[event.job_id] = event
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

    def wait_for_standby(self, job: jobs_pb2.Job, node_id: str = SPARE) -> None:
        """Until the scheduler knows that a standby process of the job waits for a rank on
        `node_id` (its agent said so): a rank moved there from then on is adopted by it,
        not started afresh. A standby process that exists may still be importing."""

        def waiting() -> bool:
            node = self.node_api.Get(nodes_pb2.GetNodeRequest(node_id=node_id), timeout=10)
            return job.id in node.standby_job_ids

        wait_until(waiting, f"a standby of {job.id} waiting on {node_id}")

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


@contextlib.contextmanager
def full_filesystem(path: Path, size: str = "64m") -> Iterator[Path]:
    """A tmpfs of `size` at `path`, filled to the last byte by the file it yields (needs
    root to mount): delete it and the room is back."""
    with tmpfs(path, size):
        with (path / "filler").open("wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:  # until ENOSPC
                filler.write(bytes(4096))
        assert os.statvfs(path).f_bavail == 0
        yield path / "filler"


@contextlib.contextmanager
def network_namespace(nodes: str) -> Iterator[Network]:
    """Each of `nodes` (comma-separated) in a network namespace of its own, behind a
    bridge here."""
    network = create_network(nodes.split(","))
    try:
        yield network
    finally:
        destroy_network(network)


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
    """The steps `rank` printed on any node (a moved rank's log starts on its new node;
    a standby adopting the rank on its own node keeps the earlier log as rank-N.1.log)."""
    steps: set[int] = set()
    for node in cluster.nodes.values():
        path = node.rank_log(job.id, rank)
        for log in [path, *path.parent.glob(f"rank-{rank}.*.log")]:
            if log.exists():
                lines = log.read_bytes().splitlines()
                steps.update(int(m.group(2)) for m in map(STEP_LINE.match, lines) if m)
    return steps


def check_result(job: jobs_pb2.Job, expected: str) -> None:
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED
    assert job.result["final_weights_sha256"] == expected
    assert job.current_step == STEPS


def node_lost_events(cluster: Cluster) -> list[str]:
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(limit=1000))
    return [f"{e.node_id}: {e.reason}" for e in log.events if e.kind == "node.lost"]


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


def finish_all(cluster: Cluster, job_ids: list[str]) -> list[jobs_pb2.Job]:
    """The jobs once every one succeeded, in whichever order they end, an end an earlier
    wait read past included (`Cluster.ends`)."""
    while waiting := set(job_ids) - set(cluster.ends):
        cluster.wait(
            lambda e, waiting=waiting: e.job_id in waiting and e.kind in JOB_ENDS,
            f"the end of {sorted(waiting)}",
        )
    for job_id in job_ids:
        end = cluster.ends[job_id]
        assert end.kind == "job.succeeded", (end, cluster.logs(job_id))
    return [cluster.get(job_id) for job_id in job_ids]
