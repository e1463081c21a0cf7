"""The agent against a real scheduler: registration, heartbeats, Xids, commands, rank
exits, a scheduler restart, /metrics, and the real `pitstop-agent` binary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kit.agents import AGENT_BINARY, agent_settings, running_agent
from kit.ranks import RankNotices, start_command, wait_gone
from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from kit.waits import until
from pitstop.agent.gpu import SimulatedBackend
from pitstop.agent.main import NodeAgent
from pitstop.client.launch import agent_command
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc

TIMEOUT = 15.0


class NodeEvents:
    """EventService.Watch on one node: its history, then live events."""

    def __init__(self, address: str, node_id: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        stub = nodes_pb2_grpc.EventServiceStub(self._channel)
        self._call = stub.Watch(nodes_pb2.WatchEventsRequest(node_id=node_id))

    async def next(
        self, kind: str, where: Callable[[common_pb2.Event], bool] = lambda e: True
    ) -> common_pb2.Event:
        async with asyncio.timeout(TIMEOUT):
            while (event := await self._call.read()) is not grpc.aio.EOF:
                if event.kind == kind and where(event):
                    return event
        raise AssertionError(f"the event watch ended before a {kind} event")

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close()


@contextlib.asynccontextmanager
async def node_events(address: str, node_id: str) -> AsyncIterator[NodeEvents]:
    events = NodeEvents(address, node_id)
    try:
        yield events
    finally:
        await events.close()


@contextlib.asynccontextmanager
async def node_service(address: str) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield nodes_pb2_grpc.NodeServiceStub(channel)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def metrics_url(agent: NodeAgent, path: str = "/metrics") -> str:
    assert agent.metrics_server is not None
    host, port = agent.metrics_server.address
    return f"http://{host}:{port}{path}"


async def test_an_agent_registers_its_inventory_and_labels(
    scheduler: SchedulerThread, short_dir: Path
) -> None:
    settings = agent_settings(scheduler.address, short_dir, role="spare")
    async with running_agent(settings) as agent, node_service(scheduler.address) as nodes:
        registered = await agent.link.wait_registered(timeout=TIMEOUT)
        assert registered.node_id == settings.node_id
        assert registered.role == common_pb2.NODE_ROLE_SPARE
        node = await nodes.Get(nodes_pb2.GetNodeRequest(node_id=settings.node_id))
        assert node.connected
        assert [g.uuid for g in node.inventory.gpus] == [
            f"GPU-sim-{settings.node_id}-{i}" for i in range(8)
        ]
        assert node.inventory.gpu_backend == "sim"
        assert node.inventory.driver_version == "sim"
        assert node.inventory.agent_version
        labels = node.labels
        assert (labels.zone, labels.block, labels.rack, labels.nvlink_domain) == (
            "z1",
            "b1",
            "r7",
            "nvl-1",
        )
        assert await asyncio.to_thread(http_get, metrics_url(agent, "/healthz")) == (200, "ok\n")


async def test_a_lost_gpu_is_seen_at_once_by_an_extra_heartbeat(
    scheduler: SchedulerThread, short_dir: Path
) -> None:
    # The session scheduler beats every 60 s: only the injection's heartbeat can be it.
    settings = agent_settings(scheduler.address, short_dir)
    async with (
        running_agent(settings) as agent,
        node_service(scheduler.address) as nodes,
        node_events(scheduler.address, settings.node_id) as events,
    ):
        await agent.link.wait_registered(timeout=TIMEOUT)
        fault = common_pb2.Fault(gpu_index=2, gpu_lost=True)
        await nodes.InjectFault(nodes_pb2.InjectFaultRequest(node_id=settings.node_id, fault=fault))
        unhealthy = await events.next("node.unhealthy")
        assert "GPU 2: lost" in unhealthy.reason
        node = await nodes.Get(nodes_pb2.GetNodeRequest(node_id=settings.node_id))
        assert node.health.verdict == common_pb2.HEALTH_VERDICT_FATAL
        assert len(node.health.gpus) == 8
        assert node.health.gpus[2].lost
        assert node.health.gpus[0].verdict == common_pb2.HEALTH_VERDICT_HEALTHY


async def test_an_injected_xid_reaches_the_backend_and_flows_back(
    scheduler: SchedulerThread, short_dir: Path
) -> None:
    settings = agent_settings(scheduler.address, short_dir)
    async with (
        running_agent(settings) as agent,
        node_service(scheduler.address) as nodes,
        node_events(scheduler.address, settings.node_id) as events,
    ):
        await agent.link.wait_registered(timeout=TIMEOUT)
        fault = common_pb2.Fault(gpu_index=1, xid=79)
        await nodes.InjectFault(nodes_pb2.InjectFaultRequest(node_id=settings.node_id, fault=fault))
        unhealthy = await events.next("node.unhealthy")
        assert unhealthy.attributes["xid"] == "79"
        assert unhealthy.attributes["gpu"] == "1"
        assert isinstance(agent.backend, SimulatedBackend)
        assert agent.backend.read_health()[1].lost  # Xid 79: fallen off the bus

        node = await nodes.Get(nodes_pb2.GetNodeRequest(node_id=settings.node_id))
        [xid] = node.xid_history
        assert (xid.gpu_index, xid.xid, xid.source) == (1, 79, common_pb2.XID_SOURCE_SIMULATED)
        assert xid.verdict == common_pb2.HEALTH_VERDICT_FATAL

        status, text = await asyncio.to_thread(http_get, metrics_url(agent))
        assert status == 200
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        uuid = f"GPU-sim-{settings.node_id}-1"
        labels = (("gpu", "1"), ("node", settings.node_id), ("uuid", uuid), ("xid", "79"))
        assert samples[("pitstop_agent_xid_total", labels)] == 1
        assert samples[("pitstop_agent_scheduler_connected", (("node", settings.node_id),))] == 1
        check_with_promtool(text)


def check_with_promtool(text: str) -> None:
    """`promtool check metrics` when promtool is installed (Debian: apt install prometheus)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_a_failed_command_is_acknowledged_with_its_error_and_the_link_goes_on(
    scheduler: SchedulerThread, short_dir: Path
) -> None:
    settings = agent_settings(scheduler.address, short_dir, gpus="sim:2")
    async with (
        running_agent(settings) as agent,
        node_service(scheduler.address) as nodes,
        node_events(scheduler.address, settings.node_id) as events,
    ):
        await agent.link.wait_registered(timeout=TIMEOUT)
        bad = common_pb2.Fault(gpu_index=0, nvlink_errors=common_pb2.NvLinkFault(link=99))
        await nodes.InjectFault(nodes_pb2.InjectFaultRequest(node_id=settings.node_id, fault=bad))
        failed = await events.next("node.command_failed")
        assert "NVLink link 99" in failed.reason
        good = common_pb2.Fault(gpu_index=1, gpu_lost=True)
        await nodes.InjectFault(nodes_pb2.InjectFaultRequest(node_id=settings.node_id, fault=good))
        await events.next("node.unhealthy")
        assert agent.link.registrations == 1


async def test_fault_injection_can_be_switched_off(
    scheduler: SchedulerThread, short_dir: Path
) -> None:
    settings = agent_settings(scheduler.address, short_dir, allow_fault_injection=False)
    async with (
        running_agent(settings) as agent,
        node_service(scheduler.address) as nodes,
        node_events(scheduler.address, settings.node_id) as events,
    ):
        await agent.link.wait_registered(timeout=TIMEOUT)
        fault = common_pb2.Fault(gpu_index=0, gpu_lost=True)
        await nodes.InjectFault(nodes_pb2.InjectFaultRequest(node_id=settings.node_id, fault=fault))
        failed = await events.next("node.command_failed")
        assert "fault injection is disabled" in failed.reason
        assert isinstance(agent.backend, SimulatedBackend)
        assert not agent.backend.read_health()[0].lost


def send_command(scheduler: SchedulerThread, node_id: str, **body: Any) -> int:
    """Queue a command down the node's stream, as the scheduler's own loops will."""
    message = agent_pb2.SchedulerMessage(**body)
    command_id = scheduler._call(scheduler.scheduler.agents.gateway.forward(node_id, message))
    assert command_id is not None, f"node {node_id} has no stream"
    return int(command_id)


async def test_start_ranks_runs_the_rank_and_its_exit_is_reported(
    scheduler: SchedulerThread, short_dir: Path, notices: RankNotices
) -> None:
    settings = agent_settings(scheduler.address, short_dir, gpus="sim:2")
    job_id = unique("job")
    start = start_command(job_id, notices, "--exit-code", "3", ranks=((0, settings.node_id, 1),))
    async with (
        running_agent(settings) as agent,
        node_events(scheduler.address, settings.node_id) as events,
    ):
        await agent.link.wait_registered(timeout=TIMEOUT)
        await asyncio.to_thread(send_command, scheduler, settings.node_id, start_ranks=start)
        ready = await notices.next(0)
        assert ready["env"]["CUDA_VISIBLE_DEVICES"] == "1"
        exited = await events.next("rank.exited")
        assert exited.job_id == job_id
        assert exited.attributes["exit_code"] == "3"


async def test_a_fatal_xid_ends_the_ranks_on_that_gpu_and_no_other(
    scheduler: SchedulerThread, short_dir: Path, notices: RankNotices
) -> None:
    """A GPU fallen off the bus takes its ranks with it at once: they must not step on
    (their peers would run the job ahead of the scheduler's decision, on a broken GPU)."""
    settings = agent_settings(scheduler.address, short_dir, gpus="sim:2")
    job_id = unique("job")
    ranks = ((0, settings.node_id, 0), (1, settings.node_id, 1))
    start = start_command(job_id, notices, "--hold", ranks=ranks)
    async with (
        running_agent(settings) as agent,
        node_events(scheduler.address, settings.node_id) as events,
    ):
        await agent.link.wait_registered(timeout=TIMEOUT)
        await agent.supervisor.start_ranks(start)
        pids = {rank: (await notices.next(rank))["pid"] for rank in (0, 1)}
        fault = common_pb2.Fault(gpu_index=1, xid=79)
        await asyncio.to_thread(send_command, scheduler, settings.node_id, inject_fault=fault)
        await events.next("node.unhealthy")
        exited = await events.next("rank.exited")
        assert (exited.job_id, exited.attributes["rank"]) == (job_id, "1")
        await wait_gone([pids[1]])
        assert [r.pid for r in agent.supervisor.running()] == [pids[0]]
        os.kill(pids[0], 0)  # the rank on the healthy GPU runs on


async def test_pause_is_relayed_to_the_jobs_ranks(
    scheduler: SchedulerThread, short_dir: Path, notices: RankNotices
) -> None:
    settings = agent_settings(scheduler.address, short_dir, gpus="sim:2")
    job_id = unique("job")
    start = start_command(
        job_id,
        notices,
        "--attach",
        "--steps",
        "3",
        "--wait-commands",
        ranks=((0, settings.node_id, 0), (1, settings.node_id, 1)),
    )
    async with running_agent(settings) as agent:
        await agent.link.wait_registered(timeout=TIMEOUT)
        await asyncio.to_thread(send_command, scheduler, settings.node_id, start_ranks=start)
        for rank in (0, 1):
            assert (await notices.next(rank))["generation"] == 1
            assert await agent.local.wait_command_stream(job_id, rank, TIMEOUT)
        pause = agent_pb2.PauseJob(job_id=job_id, generation=1)
        await asyncio.to_thread(send_command, scheduler, settings.node_id, pause=pause)
        for rank in (0, 1):
            assert (await notices.next(rank))["kind"] == "pause"


def scheduler_ready(scheduler: SchedulerThread, job_id: str, node_id: str) -> set[str] | None:
    """Which nodes hold a waiting standby of the job, as the recovery decision reads it
    (Redis), when GetNode tells an operator the same; None while they differ (a
    heartbeat came between the two reads)."""
    ready = set(scheduler._call(scheduler.scheduler.hot.ready_standbys(job_id, [node_id])))
    stub = nodes_pb2_grpc.NodeServiceStub(scheduler.channel())
    node = stub.Get(nodes_pb2.GetNodeRequest(node_id=node_id), timeout=TIMEOUT)
    return ready if (job_id in node.standby_job_ids) == (node_id in ready) else None


async def test_a_rank_handed_to_the_node_goes_to_its_standby_or_starts_afresh(
    scheduler: SchedulerThread, short_dir: Path, notices: RankNotices
) -> None:
    """A Reconfigure naming ranks in adopted_ranks: the standby process on the rank's GPU
    becomes it; with no standby left there, the rank starts as a fresh process from the
    standby's command, and the rank already running here is left alone."""
    settings = agent_settings(scheduler.address, short_dir, gpus="sim:2")
    node, job_id = settings.node_id, unique("job")
    standby = start_command(job_id, notices, "--standby", "--hold", ranks=(), standby_gpus=[1])

    def handed(generation: int, *ranks: tuple[int, int]) -> agent_pb2.Reconfigure:
        """Generation `generation`: rank 0 elsewhere, (rank, gpu) here, the last adopted."""
        placed = [common_pb2.RankAssignment(rank=0, node_id="elsewhere", gpu_index=0)]
        placed += [common_pb2.RankAssignment(rank=r, node_id=node, gpu_index=g) for r, g in ranks]
        return agent_pb2.Reconfigure(
            job_id=job_id,
            generation=generation,
            rank_map=common_pb2.RankMap(generation=generation, world_size=4, ranks=placed),
            rendezvous_address="127.0.0.1:29999",
            restore_step=7,
            adopted_ranks=[ranks[-1][0]],
        )

    async with running_agent(settings) as agent:
        await agent.link.wait_registered(timeout=TIMEOUT)
        await asyncio.to_thread(send_command, scheduler, node, start_ranks=standby)
        waiting = await notices.next(0)
        assert waiting["standby"]
        assert (waiting["env"]["PITSTOP_STANDBY"], waiting["env"]["CUDA_VISIBLE_DEVICES"]) == (
            "1",
            "1",
        )
        # Waiting for a rank, it is reported ready, and the scheduler knows (a recovery
        # prefers such a spare to one whose standby still imports).
        await until(
            lambda: scheduler_ready(scheduler, job_id, node) == {node},
            "the scheduler to know the standby is ready",
            TIMEOUT,
            in_thread=True,
        )
        assert [(r.standby, r.ready) for r in agent.supervisor.running()] == [(True, True)]

        await asyncio.to_thread(send_command, scheduler, node, reconfigure=handed(2, (3, 1)))
        adopted = await notices.next(3)
        assert adopted["pid"] == waiting["pid"]
        assert (adopted["generation"], adopted["restore_step"], adopted["gpu_index"]) == (2, 7, 1)
        running = [(r.rank, r.generation, r.standby) for r in agent.supervisor.running()]
        assert running == [(3, 2, False)]
        # Handed a rank, it no longer waits: the next heartbeat takes the mark away.
        await until(
            lambda: scheduler_ready(scheduler, job_id, node) == set(),
            "the scheduler to drop the ready mark",
            TIMEOUT,
            in_thread=True,
        )

        again = handed(3, (3, 1), (2, 0))
        await asyncio.to_thread(send_command, scheduler, node, reconfigure=again)
        fresh = await notices.next(2)
        assert not fresh.get("standby")
        assert {
            k: fresh["env"][k] for k in ("RANK", "PITSTOP_GENERATION", "CUDA_VISIBLE_DEVICES")
        } == {
            "RANK": "2",
            "PITSTOP_GENERATION": "3",
            "CUDA_VISIBLE_DEVICES": "0",
        }
        assert fresh["env"]["PITSTOP_RESTORE_STEP"] == "7"
        running = [(r.rank, r.pid) for r in agent.supervisor.running()]
        assert running == [(2, fresh["pid"]), (3, waiting["pid"])]  # rank 3 kept its process


async def test_a_standby_of_a_job_that_is_not_live_is_stopped(
    scheduler: SchedulerThread, short_dir: Path, notices: RankNotices
) -> None:
    """The agent lists its standby processes in every heartbeat; one whose job has ended
    (after a leader change nobody remembers starting it) is stopped by the scheduler
    holding the node's stream."""
    settings = agent_settings(scheduler.address, short_dir, gpus="sim:1")
    async with grpc.aio.insecure_channel(scheduler.address) as channel:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        spec = jobs_pb2.JobSpec(name=unique("ended"), command=["true"], dp=1, gpus_per_node=64)
        job = (await jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec))).job  # never placed
        await jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id, reason="it ended"))
    orphan = start_command(job.id, notices, "--hold", ranks=(), standby_gpus=[0])
    async with running_agent(settings) as agent:
        # The standby may be stopped before its Python is up: take its pid as it starts.
        started: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        start_standbys = agent.supervisor.start_standbys

        async def noting_the_pid(command: agent_pb2.StartRanks) -> list[int]:
            gpus = await start_standbys(command)
            started.set_result(agent.supervisor.standby_pid(command.job_id, 0))
            return gpus

        agent.supervisor.start_standbys = noting_the_pid  # type: ignore[method-assign]
        await agent.link.wait_registered(timeout=TIMEOUT)
        await asyncio.to_thread(send_command, scheduler, settings.node_id, start_ranks=orphan)
        pid = await asyncio.wait_for(started, TIMEOUT)
        assert pid is not None
        await wait_gone([pid])
        assert agent.supervisor.standby_command(orphan.job_id) is None  # a job stop, not a crash


async def test_the_agent_outlives_a_scheduler_restart_without_touching_its_ranks(
    stores: StoreUrls, tmp_path: Path, short_dir: Path, notices: RankNotices
) -> None:
    first = await asyncio.to_thread(SchedulerThread, scheduler_settings(stores, tmp_path / "first"))
    second: SchedulerThread | None = None
    try:
        settings = agent_settings(first.address, short_dir, gpus="sim:2")
        start = start_command(unique("job"), notices, "--hold", ranks=((0, settings.node_id, 0),))
        async with running_agent(settings) as agent:
            await agent.link.wait_registered(timeout=TIMEOUT)
            await agent.supervisor.start_ranks(start)
            pid = (await notices.next(0))["pid"]

            await asyncio.to_thread(first.stop)
            port = first.scheduler.port
            second = await asyncio.to_thread(
                SchedulerThread, scheduler_settings(stores, tmp_path / "second", port=port)
            )
            registered = await agent.link.wait_registered(count=2, timeout=TIMEOUT)
            assert registered.node_id == settings.node_id
            async with node_service(second.address) as nodes:
                node = await nodes.Get(nodes_pb2.GetNodeRequest(node_id=settings.node_id))
            assert node.connected
            assert [r.pid for r in agent.supervisor.running()] == [pid]
            os.kill(pid, 0)  # still the same process
            reconnects = agent.metrics.registry.get_sample_value(
                "pitstop_agent_reconnects_total", {"node": settings.node_id}
            )
            assert reconnects == 1
    finally:
        if second is not None:
            await asyncio.to_thread(second.stop)


async def test_healthz_is_503_while_the_scheduler_is_unreachable(short_dir: Path) -> None:
    with socket_bound_and_closed() as address:
        settings = agent_settings(address, short_dir, gpus="sim:1", reconnect_max_seconds=0.2)
        async with running_agent(settings) as agent:
            status, body = await asyncio.to_thread(http_get, metrics_url(agent, "/healthz"))
            assert (status, body) == (503, "not connected to the scheduler\n")
            assert not agent.link.connected


@contextlib.contextmanager
def socket_bound_and_closed() -> Iterator[str]:
    """host:port where nothing listens."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        host, port = probe.getsockname()
    yield f"{host}:{port}"


async def test_the_binary_registers_and_stops_its_ranks_on_sigterm(
    scheduler: SchedulerThread, short_dir: Path, notices: RankNotices
) -> None:
    node_id = unique("bin")
    command = agent_command(
        fork_server="off",  # fake ranks or none: no zygote to import torch
        node_id=node_id,
        scheduler=scheduler.address,
        gpus="sim:2",
        state_dir=short_dir / "state",
        metrics_port=0,
    )
    agent = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert agent.stdout is not None
        line = (await asyncio.wait_for(agent.stdout.readline(), TIMEOUT)).decode()
        assert line.startswith(f"pitstop-agent {node_id} started: metrics on http://127.0.0.1:")
        assert f"socket {short_dir / 'state' / 'agent.sock'}" in line
        assert agent.stderr is not None
        await read_until(agent.stderr, f"as node {node_id}")  # Registered: the stream is up
        async with node_events(scheduler.address, node_id) as events:
            start = start_command(unique("job"), notices, "--hold", ranks=((0, node_id, 0),))
            await asyncio.to_thread(send_command, scheduler, node_id, start_ranks=start)
            pid = (await notices.next(0))["pid"]
            agent.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(agent.wait(), TIMEOUT) == 0
            await events.next("node.lost")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no orphaned rank
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


async def read_until(stream: asyncio.StreamReader, text: str) -> str:
    """The first line from `stream` containing `text`."""
    async with asyncio.timeout(TIMEOUT):
        while line := (await stream.readline()).decode():
            if text in line:
                return line
    raise AssertionError(f"the output ended without {text!r}")


def test_the_binary_exits_2_naming_a_bad_gpus_spec() -> None:
    result = subprocess.run(
        [str(AGENT_BINARY), "run", "--gpus", "sim:0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "gpus: 'sim:0' is no GPU backend: use nvml or sim:N" in result.stderr


async def test_a_dead_rank_is_taken_over_in_place_by_the_standby_beside_the_ranks(
    scheduler: SchedulerThread, short_dir: Path, notices: RankNotices
) -> None:
    """A standby started beside the job's ranks (its GPU in use by one) waits there; an
    application Xid on that GPU kills the rank but not the standby, and a Reconfigure
    adopting the node's ranks hands the dead one to it — the same process, no fresh
    start — while the rank still alive on the other GPU keeps its process and is told."""
    settings = agent_settings(scheduler.address, short_dir, gpus="sim:2")
    node, job_id = settings.node_id, unique("job")
    placed = ((0, node, 0), (1, node, 1))
    ranks = start_command(job_id, notices, "--attach", "--wait-commands", ranks=placed)
    beside = start_command(
        job_id, notices, "--standby", "--hold", ranks=(), standby_gpus=[0], beside_ranks=True
    )
    async with running_agent(settings) as agent:
        await agent.link.wait_registered(timeout=TIMEOUT)
        await asyncio.to_thread(send_command, scheduler, node, start_ranks=ranks)
        started = {rank: await notices.next(rank) for rank in (0, 1)}
        for rank in (0, 1):
            assert await agent.local.wait_command_stream(job_id, rank, TIMEOUT)
        await asyncio.to_thread(send_command, scheduler, node, start_ranks=beside)
        waiting = await notices.next(0)
        assert waiting["standby"]
        await until(
            lambda: scheduler_ready(scheduler, job_id, node) == {node},
            "the scheduler to know the standby is ready",
            TIMEOUT,
            in_thread=True,
        )

        fault = common_pb2.Fault(gpu_index=0, xid=13)
        await asyncio.to_thread(send_command, scheduler, node, inject_fault=fault)
        await wait_gone([started[0]["pid"]])
        deadline = time.monotonic() + TIMEOUT
        while [(r.rank, r.standby) for r in agent.supervisor.running()] != [(1, False), (0, True)]:
            assert time.monotonic() < deadline, agent.supervisor.running()
            await asyncio.sleep(0.05)  # the agent's own watcher reaps the rank

        rank_map = common_pb2.RankMap(
            generation=2,
            world_size=2,
            ranks=[
                common_pb2.RankAssignment(rank=r, node_id=n, gpu_index=g, local_rank=g)
                for r, n, g in placed
            ],
        )
        reconfigure = agent_pb2.Reconfigure(
            job_id=job_id,
            generation=2,
            rank_map=rank_map,
            rendezvous_address="127.0.0.1:29999",
            restore_step=5,
            adopted_ranks=[0, 1],
        )
        await asyncio.to_thread(send_command, scheduler, node, reconfigure=reconfigure)
        adopted = await notices.next(0)
        assert (adopted["pid"], adopted["generation"], adopted["gpu_index"]) == (
            waiting["pid"],
            2,
            0,
        )
        assert (await notices.next(1))["kind"] == "reconfigure"
        running = [(r.rank, r.pid, r.standby) for r in agent.supervisor.running()]
        assert running == [(0, waiting["pid"], False), (1, started[1]["pid"], False)]
