"""bench/scale.py's simulated nodes: agents that speak the agent protocol over their own
streams (straight to a scheduler, or through a relay process that can cut them), the
job's ranks on them, and the benchmark's constants. A worker process
(bench/_scale_worker.py) runs a share of them; what they do that the benchmark measures
(a command arrived, a registration, a stream closed) goes into its `SimFleet`'s notes."""

from __future__ import annotations

import asyncio
import functools
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.common.tls import (
    CertificateAuthority,
    cert_pem,
    certificate_request,
    channel_options,
    key_pem,
    new_key,
)
from pitstop.health.straggler import StragglerPolicy
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2

GPUS = 8
RANKS_PER_REPLICA = 8 * 16  # TP 8 x PP 16
FULL_FLEET = 12_500
NODES_PER_RACK, RACKS_PER_BLOCK, BLOCKS_PER_ZONE = 8, 49, 8
TARGETS = {
    "detect_p99_seconds": 1.0,
    "decide_p99_seconds": 0.1,
    "fanout_seconds": 1.0,
    "loop_lag_p99_seconds": 0.1,
    "ingest_cpu_cores": 1.0,
}
DECISIONS = ("job.recovering", "job.reconfigured", "job.restarting")
LAG_LIMIT = 0.1
"""A simulator or relay whose event loop ran this late (seconds) may have sent a heartbeat
or answered a ping late: what was measured meanwhile is the benchmark's, not only the
scheduler's."""
LAG_TICK = 0.05
"""How often a simulator or relay process samples its own event-loop lag."""
FINAL_RESULT = {"final_weights_sha256": "sim"}


def say(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def stamp(seconds: float) -> Timestamp:
    out = Timestamp()
    out.FromNanoseconds(int(seconds * 1e9))
    return out


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class LagMeter:
    """This process's event-loop lag, sampled every LAG_TICK: the largest since the last
    take, and each lag over LAG_LIMIT with the wall-clock time it ended (so the benchmark
    can tell which of its samples it overlapped)."""

    def __init__(self) -> None:
        self.lag_max = 0.0
        self.spikes: list[tuple[float, float]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(LAG_TICK)
            lag = time.monotonic() - before - LAG_TICK
            self.lag_max = max(self.lag_max, lag)
            if lag > LAG_LIMIT and len(self.spikes) < 1000:
                self.spikes.append((round(time.time(), 3), round(lag, 3)))

    def take(self) -> dict[str, Any]:
        out = {"lag_max": round(self.lag_max, 4), "spikes": self.spikes}
        self.lag_max, self.spikes = 0.0, []
        return out


def cpu_seconds() -> float:
    """This process's CPU, every thread (gRPC's core threads too)."""
    times = os.times()
    return times.user + times.system


@functools.lru_cache(maxsize=16)
def _policy(window_steps: int, warmup_steps: int | None) -> StragglerPolicy:
    windows = agent_pb2.StepWindows(window_steps=window_steps)
    if warmup_steps is not None:
        windows.warmup_steps = warmup_steps
    return StragglerPolicy.from_step_windows(windows)


def policy_of(windows: agent_pb2.StepWindows) -> StragglerPolicy:
    """The job's straggler windows, built once per kind of command (a fan-out brings the
    same to every node: built for each, it was a tenth of a worker's time)."""
    warmup = windows.warmup_steps if windows.HasField("warmup_steps") else None
    return _policy(windows.window_steps, warmup)


@dataclass
class Assignment:
    """One generation of the job on a node: its ranks (global rank, gpu index)."""

    generation: int
    ranks: list[tuple[int, int]]
    started: float
    restore_step: int
    windows: StragglerPolicy = field(default_factory=StragglerPolicy)
    """How the node cuts the job's straggler windows (its command says)."""
    told: bool = False
    """A step of this generation was reported: later ones wait for the periodic report."""


class SimFleet:
    """One worker's simulated nodes, and what they did that the benchmark reads: `notes`
    (commands arrived, registrations, closed streams) go to the parent as they happen;
    `sent` and `steps` with each report."""

    def __init__(
        self,
        targets: list[str],
        interval: float,
        step_seconds: float,
        tls: NodeCertificates | None = None,
    ) -> None:
        self.targets = targets
        self.tls = tls
        self.relay_ports: dict[str, int] = {}
        """Node id -> the port of this worker's relay its stream goes through."""
        self.host_ports: dict[str, int] = {}
        """Node id -> its host's port at the relay (silent while its line is cut)."""
        self.host_port = 0
        """The port that stands in for the host of every node not behind the relay
        (HostListener): it accepts and closes, as a live host's daemon port does."""
        self.alive_targets = set(range(len(targets)))
        self.interval = interval
        self.step_seconds = step_seconds
        self.nodes: dict[str, SimNode] = {}
        self.sent = {"heartbeat": 0, "step_summaries": 0, "ack": 0, "samples": 0, "windows": 0}
        self.steps: dict[str, int] = {}
        """Job id -> the newest step any node of this worker reported."""
        self.registrations = 0
        self.notes: list[list[Any]] = []
        self.noted = asyncio.Event()
        # (job, generation) -> node id -> ranks, worked out once per rank map.
        self._maps: dict[tuple[str, int], dict[str, list[tuple[int, int]]]] = {}

    def note(self, *entry: Any) -> None:
        self.notes.append(list(entry))
        self.noted.set()

    def ranks_of(
        self, job_id: str, rank_map: common_pb2.RankMap
    ) -> dict[str, list[tuple[int, int]]]:
        key = (job_id, rank_map.generation)
        if key not in self._maps:
            by_node: dict[str, list[tuple[int, int]]] = {}
            for a in rank_map.ranks:
                by_node.setdefault(a.node_id, []).append((a.rank, a.gpu_index))
            self._maps = {key: by_node}  # only the newest map is kept
        return self._maps[key]

    async def close(self) -> None:
        for node in self.nodes.values():
            node.dead = True
            node.cancel()
        tasks = [n.task for n in self.nodes.values() if n.task]
        await asyncio.gather(*tasks, return_exceptions=True)


def labels_of(index: int) -> common_pb2.TopologyLabels:
    rack = index // NODES_PER_RACK
    block = rack // RACKS_PER_BLOCK
    zone = block // BLOCKS_PER_ZONE
    return common_pb2.TopologyLabels(
        zone=f"z{zone}", block=f"z{zone}-b{block}", rack=f"z{zone}-b{block}-r{rack}"
    )


def inventory_of(node_id: str, gpu_uuids: list[str], host: str = "") -> common_pb2.Inventory:
    """What a simulated node's agent registers with: 8 simulated GPUs of 80 GiB, and the
    address where the scheduler asks whether its host is up (its checkpoint daemon's)."""
    return common_pb2.Inventory(
        hostname=node_id,
        driver_version="sim",
        gpu_backend="sim",
        agent_version="bench",
        checkpointd_address=host,
        gpus=[
            common_pb2.GpuInfo(index=g, uuid=u, name="sim", memory_bytes=80 << 30)
            for g, u in enumerate(gpu_uuids)
        ],
    )


def node_id_of(index: int) -> str:
    return f"n{index:05d}"


def retarget(index: int, target: int, alive: set[int]) -> int:
    """The scheduler a node reconnects to once `target` is gone (the relay picks the same)."""
    live = sorted(alive)
    return target if target in live or not live else live[index % len(live)]


def node_health(gpu_uuids: list[str], unhealthy_gpu: int | None) -> common_pb2.NodeHealth:
    """A node's health as its agent reports it: 8 healthy GPUs, or one FATAL (Xid 79)."""
    gpus = []
    for g, uuid in enumerate(gpu_uuids):
        fatal = g == unhealthy_gpu
        gpus.append(
            common_pb2.GpuHealth(
                index=g,
                uuid=uuid,
                temperature_c=45.0,
                power_w=300.0,
                pcie_link_gen=5,
                pcie_link_gen_max=5,
                pcie_link_width=16,
                pcie_link_width_max=16,
                verdict=(
                    common_pb2.HEALTH_VERDICT_FATAL if fatal else common_pb2.HEALTH_VERDICT_HEALTHY
                ),
                reasons=["Xid 79 (GPU has fallen off the bus)"] if fatal else [],
            )
        )
    if unhealthy_gpu is None:
        return common_pb2.NodeHealth(verdict=common_pb2.HEALTH_VERDICT_HEALTHY, gpus=gpus)
    return common_pb2.NodeHealth(
        verdict=common_pb2.HEALTH_VERDICT_FATAL,
        reasons=[f"GPU {unhealthy_gpu}: Xid 79 (GPU has fallen off the bus)"],
        gpus=gpus,
    )


def add_windows(
    summary: agent_pb2.StepSummary, job: Assignment, last: int, step: int, seconds: float
) -> None:
    """A window summary per rank for every straggler window its steps completed between
    `last` and `step`, as the agent folds them into its step summary."""
    size = job.windows.window_steps
    counted = job.restore_step + 1 + job.windows.warmup_steps
    for s in range(last + 1, step + 1):
        if s < counted or (s - counted + 1) % size:
            continue
        window = (s - counted) // size
        for r, _ in job.ranks:
            summary.windows.add(
                rank=r,
                window=window,
                steps=size,
                timed=size,
                median_seconds=seconds * random.uniform(0.99, 1.01),
                max_seconds=seconds * 1.02,
                first_step=s - size + 1,
            )


class SimNode:
    """One node's agent as the scheduler sees it: a stream, heartbeats, step summaries, acks."""

    def __init__(self, fleet: SimFleet, index: int, spare: bool, target: int) -> None:
        self.fleet = fleet
        self.index = index
        self.node_id = node_id_of(index)
        self.spare = spare
        self.target = target
        self.dead = False  # no more reconnects
        self.hung = False  # no heartbeats, stream open (an agent hung in Python)
        self.registered = asyncio.Event()
        self.jobs: dict[str, Assignment] = {}
        self.reported_step: dict[str, int] = {}
        self.unhealthy_gpu: int | None = None
        self.outbox: asyncio.Queue[agent_pb2.AgentMessage | None] = asyncio.Queue()
        self.call: Any = None
        self.task: asyncio.Task[None] | None = None
        self.started_at = stamp(time.time())
        self.gpu_uuids = [f"GPU-{index:05d}-{g}" for g in range(GPUS)]
        # What the last heartbeat said (gist) and when: an ack that carries one counts.
        self.beat_sent: tuple[object, ...] | None = None
        self.beat_sent_at = -math.inf

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=self.node_id)

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    def send(self, **body: Any) -> None:
        self.outbox.put_nowait(agent_pb2.AgentMessage(**body))

    def register_message(self) -> agent_pb2.AgentMessage:
        return agent_pb2.AgentMessage(
            seq=1,
            register=agent_pb2.Register(
                node_id=self.node_id,
                inventory=inventory_of(self.node_id, self.gpu_uuids, self.host_address()),
                labels=labels_of(self.index),
                requested_role=(
                    common_pb2.NODE_ROLE_SPARE if self.spare else common_pb2.NODE_ROLE_WORKER
                ),
                running_ranks=self.running(),
                agent_started_at=self.started_at,
            ),
        )

    def host_address(self) -> str:
        """Where the scheduler asks whether this node's host is up: at the relay for a
        node behind it (silent while cut), else the worker's listener."""
        port = self.fleet.host_ports.get(self.node_id, self.fleet.host_port)
        return f"127.0.0.1:{port}" if port else ""

    async def run(self) -> None:
        """Keep a registered stream, reconnecting (to the next live scheduler, jittered)
        as an agent does, until the node is dead."""
        while not self.dead:
            try:
                await self.session()
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken stream: reconnect, as the agent does
                pass
            if self.registered.is_set():
                self.fleet.note("down", self.node_id)
            self.registered.clear()
            if self.dead or self.hung:
                return
            await asyncio.sleep(random.uniform(0.05, 1.0))
            self.target = retarget(self.index, self.target, self.fleet.alive_targets)

    async def session(self) -> None:
        fleet = self.fleet
        port = fleet.relay_ports.get(self.node_id)
        # Through the relay, which dials this node's scheduler (it knows which) for it.
        target = fleet.targets[self.target] if port is None else f"127.0.0.1:{port}"
        if fleet.tls is None:
            channel = grpc.aio.insecure_channel(target)
        else:
            channel = grpc.aio.secure_channel(
                target, fleet.tls.credentials(self.node_id), options=channel_options()
            )
        try:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            self.outbox = asyncio.Queue()
            self.call = stub.Connect(self.requests(self.register_message()))
            beats: asyncio.Task[None] | None = None
            try:
                async for reply in self.call:
                    kind = reply.WhichOneof("body")
                    if kind == "registered":
                        self.registered.set()
                        fleet.registrations += 1
                        fleet.note("reg", self.node_id, self.target)
                        beats = asyncio.create_task(self.beat(reply.registered))
                    else:
                        self.command(reply, kind)
            finally:
                if beats is not None:
                    beats.cancel()
                self.outbox.put_nowait(None)
        finally:
            await channel.close(grace=None)

    async def requests(
        self, first: agent_pb2.AgentMessage
    ) -> AsyncIterator[agent_pb2.AgentMessage]:
        yield first
        seq = 1
        outbox = self.outbox
        while (message := await outbox.get()) is not None:
            seq += 1
            message.seq = seq
            yield message

    def running(self) -> list[agent_pb2.RunningRank]:
        out: list[agent_pb2.RunningRank] = []
        for job_id, job in self.jobs.items():
            step = self.reported_step.get(job_id, job.restore_step)
            out.extend(
                agent_pb2.RunningRank(
                    job_id=job_id, generation=job.generation, rank=r, pid=10_000 + g, step=step
                )
                for r, g in job.ranks
            )
        return out

    async def beat(self, registered: agent_pb2.Registered) -> None:
        """As the agent: look every interval; a heartbeat when what it says changed and
        at least every refresh interval; the ranks' new steps at each look."""
        interval = registered.heartbeat_interval_seconds or self.fleet.interval
        refresh = max(registered.refresh_interval_seconds, interval)
        report = max(registered.step_report_seconds, interval)
        reported_at = -math.inf
        await asyncio.sleep(random.uniform(0, interval))  # agents are not in phase
        self.beat_sent, self.beat_sent_at = None, -math.inf
        while True:
            if not self.hung:
                now = time.monotonic()
                gist = self.gist()
                if gist != self.beat_sent or now - self.beat_sent_at >= refresh - interval / 2:
                    self.heartbeat()
                    self.beat_sent, self.beat_sent_at = gist, now
                due = now - reported_at >= report - interval / 2
                self.send_steps(due)
                if due:
                    reported_at = now
            await asyncio.sleep(interval)

    def gist(self) -> tuple[object, ...]:
        """What a heartbeat says that the scheduler acts on (the agent's `_gist`)."""
        jobs = tuple(sorted((j, a.generation, tuple(a.ranks)) for j, a in self.jobs.items()))
        return (self.unhealthy_gpu, jobs)

    def heartbeat(self) -> None:
        self.send(heartbeat=self.beat_now())
        self.fleet.sent["heartbeat"] += 1

    def beat_now(self) -> agent_pb2.Heartbeat:
        return agent_pb2.Heartbeat(
            time=stamp(time.time()),
            health=node_health(self.gpu_uuids, self.unhealthy_gpu),
            running_ranks=self.running(),
        )

    def send_steps(self, due: bool = True) -> None:
        """As the agent reports steps: every report interval (`due`), and a generation's
        first steps at the look after them."""
        now = time.time()
        sent = self.fleet.sent
        for job_id, job in self.jobs.items():
            step = job.restore_step + int((now - job.started) / self.fleet.step_seconds)
            last = self.reported_step.get(job_id, job.restore_step)
            if step <= last or (job.told and not due):
                continue
            job.told = True
            # What the agent sends: its ranks' steps since the last summary, folded,
            # with a window summary per rank for every straggler window they completed.
            seconds = self.fleet.step_seconds
            summary = agent_pb2.StepSummary(
                job_id=job_id,
                generation=job.generation,
                ranks=len(job.ranks),
                slowest_step=step,
                newest_step=step,
                samples=(step - last) * len(job.ranks),
                tokens=8192 * (step - last) * len(job.ranks),
                loss_step=step,
                loss=2.0,
                time=stamp(now),
            )
            add_windows(summary, job, last, step, seconds)
            self.reported_step[job_id] = step
            self.fleet.steps[job_id] = max(self.fleet.steps.get(job_id, 0), step)
            self.send(step_summary=summary)
            sent["step_summaries"] += 1
            sent["samples"] += summary.samples
            sent["windows"] += len(summary.windows)

    def command(self, reply: agent_pb2.SchedulerMessage, kind: str | None) -> None:
        """Carry out a command and ack it, as the agent does: the ack of one that moves
        the node's ranks to a generation carries the heartbeat the node would send next
        (one message per node per recovery)."""
        now = time.time()
        error = ""
        moved = False
        if kind in ("start_ranks", "reconfigure", "reconfigure_kept"):
            body = getattr(reply, kind)
            if not (kind == "start_ranks" and reply.start_ranks.standby_gpus):
                moved = True
                kept = self.jobs.get(body.job_id)
                if kind == "reconfigure_kept":  # the ranks it runs, as placed here
                    ranks = list(kept.ranks) if kept is not None else []
                    if not ranks:
                        error = "no ranks of the job placed here to keep"
                elif body.rank_map.node_local:  # this node's share of the map
                    ranks = [(a.rank, a.gpu_index) for a in body.rank_map.ranks]
                else:
                    ranks = self.fleet.ranks_of(body.job_id, body.rank_map).get(self.node_id, [])
                # What the benchmark times: when this node's command for the generation
                # came, its size, and whether the node holds ranks in it.
                self.fleet.note(
                    "cmd",
                    body.generation,
                    self.node_id,
                    round(now, 4),
                    reply.ByteSize(),
                    len(ranks),
                    body.restore_step,
                )
                if ranks:
                    self.jobs[body.job_id] = Assignment(
                        body.generation,
                        ranks,
                        now,
                        body.restore_step,
                        policy_of(body.step_windows),
                    )
                    self.reported_step[body.job_id] = body.restore_step
                else:
                    self.jobs.pop(body.job_id, None)
        elif kind == "stop_ranks":
            stop = reply.stop_ranks
            job = self.jobs.get(stop.job_id)
            if job is not None:
                job.ranks = [(r, g) for r, g in job.ranks if stop.ranks and r not in stop.ranks]
                if not job.ranks:
                    del self.jobs[stop.job_id]
                    self.fleet.note("left", self.node_id)
        ack = agent_pb2.CommandAck(command_id=reply.command_id, ok=not error, error=error)
        if moved:
            ack.heartbeat.CopyFrom(self.beat_now())
            self.beat_sent, self.beat_sent_at = self.gist(), time.monotonic()
        self.send(ack=ack)
        self.fleet.sent["ack"] += 1


# What an agent sends when its node fails, or its job ends


def inject_xid(node: SimNode) -> None:
    """What the agent sends on a fatal Xid: the Xid, the exit of the rank on that GPU
    (the agent ends it), and a heartbeat at once saying FATAL."""
    gpu = 0
    job_id, job = next(iter(node.jobs.items()))
    rank = next(r for r, g in job.ranks if g == gpu)
    node.unhealthy_gpu = gpu
    now = time.time()
    node.send(
        xid=common_pb2.XidEvent(
            gpu_index=gpu,
            gpu_uuid=node.gpu_uuids[gpu],
            xid=79,
            message="GPU has fallen off the bus",
            time=stamp(now),
            source=common_pb2.XID_SOURCE_SIMULATED,
            verdict=common_pb2.HEALTH_VERDICT_FATAL,
        )
    )
    job.ranks = [(r, g) for r, g in job.ranks if g != gpu]
    node.send(
        rank_exited=agent_pb2.RankExited(
            job_id=job_id, generation=job.generation, rank=rank, signal=9, time=stamp(now)
        )
    )
    node.heartbeat()


def exit_rank(node: SimNode) -> None:
    """A rank of the node's job exits with code 1 (its training crashed): the agent
    reports the exit at once, then a heartbeat without that rank."""
    job_id, job = next(iter(node.jobs.items()))
    rank, _ = job.ranks[-1]
    job.ranks = job.ranks[:-1]
    node.send(
        rank_exited=agent_pb2.RankExited(
            job_id=job_id,
            generation=job.generation,
            rank=rank,
            exit_code=1,
            time=stamp(time.time()),
            stderr_tail="RuntimeError: simulated crash",
        )
    )
    node.heartbeat()


def finish(node: SimNode, job_id: str, generation: int) -> int:
    """Every rank of `job_id`'s `generation` on this node exits 0 with its result, as
    a job's last step ends; then a heartbeat without them. The ranks that exited."""
    job = node.jobs.get(job_id)
    if job is None or job.generation != generation:
        return 0
    now = stamp(time.time())
    for rank, _ in job.ranks:
        node.send(
            rank_exited=agent_pb2.RankExited(
                job_id=job_id,
                generation=generation,
                rank=rank,
                exit_code=0,
                time=now,
                result=FINAL_RESULT,
            )
        )
    del node.jobs[job_id]
    node.heartbeat()
    return len(job.ranks)


class NodeCertificates:
    """Each simulated node's certificate from the cluster CA, as enrollment issues them
    (signed here rather than through 2,500 join tokens: the stream is what is measured)."""

    def __init__(self, ca_directory: Path) -> None:
        self.ca = CertificateAuthority.load_or_create(ca_directory)
        self._made: dict[str, Any] = {}

    def credentials(self, node_id: str) -> Any:
        if node_id not in self._made:
            key = new_key()
            cert = self.ca.issue_node(certificate_request(key, node_id), node_id)
            self._made[node_id] = grpc.ssl_channel_credentials(
                root_certificates=self.ca.pem,
                private_key=key_pem(key),
                certificate_chain=cert_pem(cert),
            )
        return self._made[node_id]
