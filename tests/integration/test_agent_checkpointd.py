"""The agent's watch over its node's checkpoint daemon, against real `pitstop-checkpointd`
processes: a daemon killed alone makes the node report itself degraded, and the reason
clears once it is back, whether someone else restarts it or the agent owns it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kit.agents import running_agent
from kit.ports import free_port
from kit.ranks import wait_gone
from kit.schedulers import SchedulerThread
from kit.stores import unique
from pitstop.agent.config import AgentSettings
from pitstop.agent.liveness import Liveness
from pitstop.agent.main import NodeAgent
from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.client.launch import checkpointd_command
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2, nodes_pb2, nodes_pb2_grpc

TIMEOUT = 20.0
PROBE_SECONDS = 0.2
DOWN = "checkpoint daemon at {address} is down"


def checkpointd_argv(node_id: str, state_dir: Path, port: int) -> list[str]:
    return checkpointd_command(
        node_id=node_id,
        host="127.0.0.1",
        port=port,
        scheduler="",
        state_dir=state_dir,
        as_module=True,
        extra=["--memory-budget-bytes", str(64 << 20)],
    )


class Checkpointd:
    """A checkpoint daemon run by the test, as systemd or the local cluster would."""

    def __init__(self, node_id: str, state_dir: Path, port: int = 0) -> None:
        self.process = subprocess.Popen(
            checkpointd_argv(node_id, state_dir, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.address = ""

    async def listening(self) -> str:
        """Its address, once it prints that it listens."""
        assert self.process.stdout is not None
        async with asyncio.timeout(TIMEOUT):
            while "listening on" not in (
                line := await asyncio.to_thread(self.process.stdout.readline)
            ):
                assert line, "checkpointd exited before it listened"
        self.address = line.split("listening on ")[1].split()[0]
        return self.address

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(TIMEOUT)


@pytest.fixture
def daemons(short_dir: Path) -> Iterator[Callable[..., Checkpointd]]:
    started: list[Checkpointd] = []
    node_ids: set[str] = set()

    def start(node_id: str, port: int = 0) -> Checkpointd:
        node_ids.add(node_id)
        daemon = Checkpointd(node_id, short_dir / "ckpt", port)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.process.poll() is None:
            daemon.kill()
    for node_id in node_ids:
        remove_stale_segments(segment_prefix(node_id))


class HeartbeatSink:
    """An AgentService that registers every agent with a 50 ms heartbeat and keeps the
    heartbeats it gets."""

    def __init__(self) -> None:
        self.beats: asyncio.Queue[agent_pb2.Heartbeat] = asyncio.Queue()

    async def Connect(  # noqa: N802 (gRPC method name)
        self, requests: AsyncIterator[agent_pb2.AgentMessage], context: Any
    ) -> AsyncIterator[agent_pb2.SchedulerMessage]:
        async def read() -> None:
            async for message in requests:
                if message.WhichOneof("body") == "heartbeat":
                    self.beats.put_nowait(message.heartbeat)

        reader = asyncio.create_task(read())
        try:
            registered = agent_pb2.Registered(node_id="fake", heartbeat_interval_seconds=0.05)
            yield agent_pb2.SchedulerMessage(registered=registered)
            await asyncio.Event().wait()  # the stream stays open until the agent ends it
        finally:
            reader.cancel()

    async def beat(self, where: Callable[[common_pb2.NodeHealth], bool]) -> agent_pb2.Heartbeat:
        """The next heartbeat whose health satisfies `where`."""
        async with asyncio.timeout(TIMEOUT):
            while not where((beat := await self.beats.get()).health):
                pass
        return beat


@contextlib.asynccontextmanager
async def heartbeat_sink() -> AsyncIterator[tuple[HeartbeatSink, str]]:
    sink = HeartbeatSink()
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield sink, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def agent_settings(scheduler: str, state_dir: Path, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "node_id": unique("ckw"),
        "scheduler": scheduler,
        "gpus": "sim:1",
        "state_dir": state_dir / "agent",
        "metrics_port": 0,
        "checkpointd_probe_seconds": PROBE_SECONDS,
        **overrides,
    }
    return AgentSettings(**values)


def down_reason(address: str) -> Callable[[common_pb2.NodeHealth], bool]:
    def degraded(health: common_pb2.NodeHealth) -> bool:
        return health.verdict == common_pb2.HEALTH_VERDICT_DEGRADED and any(
            r.startswith(DOWN.format(address=address)) for r in health.reasons
        )

    return degraded


def healthy(health: common_pb2.NodeHealth) -> bool:
    return health.verdict == common_pb2.HEALTH_VERDICT_HEALTHY and not health.reasons


def up_gauge(agent: NodeAgent, address: str) -> float | None:
    return agent.metrics.registry.get_sample_value(
        "pitstop_agent_checkpointd_up", {"node": agent.settings.node_id, "address": address}
    )


async def wait_state(agent: NodeAgent, state: Liveness) -> None:
    watch = agent.checkpointd
    assert watch is not None
    assert await watch.wait_until(lambda: watch.liveness.state is state, TIMEOUT), (
        f"the checkpoint daemon never became {state.value}: {watch.liveness}"
    )


async def test_an_external_daemon_killed_alone_degrades_the_node_until_it_is_back(
    short_dir: Path, daemons: Callable[..., Checkpointd]
) -> None:
    node_id = unique("ckpt-ext")
    first = daemons(node_id)
    address = await first.listening()
    port = int(address.rsplit(":", 1)[1])
    async with heartbeat_sink() as (sink, scheduler):
        settings = agent_settings(scheduler, short_dir, checkpointd_address=address)
        async with running_agent(settings) as agent:
            await wait_state(agent, Liveness.UP)
            await sink.beat(healthy)
            assert up_gauge(agent, address) == 1

            first.kill()
            beat = await sink.beat(down_reason(address))
            [reason] = beat.health.reasons
            assert "probes in a row unanswered: UNAVAILABLE" in reason
            assert up_gauge(agent, address) == 0
            assert agent.checkpointd is not None
            assert agent.checkpointd.starts == 0

            # Its supervisor (here: the test) starts it again on the same address.
            second = daemons(node_id, port)
            assert await second.listening() == address
            await sink.beat(healthy)
            assert up_gauge(agent, address) == 1


async def test_a_hung_external_daemon_is_reported_without_being_touched(
    short_dir: Path, daemons: Callable[..., Checkpointd]
) -> None:
    daemon = daemons(unique("ckpt-hung"))
    address = await daemon.listening()
    async with heartbeat_sink() as (sink, scheduler):
        settings = agent_settings(
            scheduler, short_dir, checkpointd_address=address, checkpointd_hang_seconds=0.5
        )
        async with running_agent(settings) as agent:
            await wait_state(agent, Liveness.UP)
            daemon.process.send_signal(signal.SIGSTOP)
            try:
                beat = await sink.beat(down_reason(address))
                assert "no answer within 0.5 s" in beat.health.reasons[0]
            finally:
                daemon.process.send_signal(signal.SIGCONT)
            await sink.beat(healthy)
            assert daemon.process.poll() is None  # not the agent's to kill


async def test_the_scheduler_records_a_node_degraded_while_its_daemon_is_down(
    scheduler: SchedulerThread, short_dir: Path, daemons: Callable[..., Checkpointd]
) -> None:
    node_id = unique("ckpt-sched")
    first = daemons(node_id)
    address = await first.listening()
    settings = agent_settings(scheduler.address, short_dir, checkpointd_address=address)
    async with (
        running_agent(settings) as agent,
        grpc.aio.insecure_channel(scheduler.address) as channel,
    ):
        nodes = nodes_pb2_grpc.NodeServiceStub(channel)
        events = nodes_pb2_grpc.EventServiceStub(channel).Watch(
            nodes_pb2.WatchEventsRequest(node_id=settings.node_id)
        )
        try:
            await agent.link.wait_registered(timeout=TIMEOUT)
            await wait_state(agent, Liveness.UP)
            first.kill()
            # The session scheduler asks for a heartbeat a minute: only the one the
            # change triggers can carry the news this soon.
            async with asyncio.timeout(TIMEOUT):
                while (event := await events.read()).kind != "node.degraded":
                    assert event.kind != "node.draining", event
            assert event.reason.startswith(DOWN.format(address=address))
            assert event.actor == f"agent:{settings.node_id}"
            node = await nodes.Get(nodes_pb2.GetNodeRequest(node_id=settings.node_id))
            # Reported, not drained: its ranks restore from another holder meanwhile.
            assert node.state == common_pb2.NODE_STATE_READY
            assert down_reason(address)(node.health)

            second = daemons(node_id, int(address.rsplit(":", 1)[1]))
            await second.listening()
            await wait_state(agent, Liveness.UP)
            async with asyncio.timeout(TIMEOUT):
                while (event := await events.read()).kind != "node.degraded_cleared":
                    pass
            node = await nodes.Get(nodes_pb2.GetNodeRequest(node_id=settings.node_id))
            assert healthy(node.health)
            assert node.state == common_pb2.NODE_STATE_READY
        finally:
            events.cancel()


async def test_an_owned_daemon_is_started_restarted_and_stopped_by_the_agent(
    short_dir: Path,
) -> None:
    node_id = unique("ckpt-own")
    port = free_port()
    address = f"127.0.0.1:{port}"
    command = shlex.join(checkpointd_argv(node_id, short_dir / "ckpt", port))
    try:
        async with heartbeat_sink() as (sink, scheduler):
            settings = agent_settings(
                scheduler, short_dir, checkpointd_address=address, checkpointd_command=command
            )
            async with running_agent(settings) as agent:
                watch = agent.checkpointd
                assert watch is not None
                assert watch.owned
                await wait_state(agent, Liveness.UP)
                first = watch.pid
                assert first is not None
                await sink.beat(healthy)

                os.kill(first, signal.SIGKILL)
                beat = await sink.beat(down_reason(address))
                assert "its process was killed by signal 9 (SIGKILL)" in beat.health.reasons[0]
                assert await watch.wait_until(lambda: watch.pid not in (None, first), TIMEOUT)
                await wait_state(agent, Liveness.UP)
                await sink.beat(healthy)
                restarts = agent.metrics.registry.get_sample_value(
                    "pitstop_agent_checkpointd_restarts_total", {"node": settings.node_id}
                )
                assert (watch.starts, restarts) == (2, 1)
                second = watch.pid
                assert second is not None
            await asyncio.wait_for(wait_gone([second]), TIMEOUT)  # stopped with the agent
        log = (short_dir / "agent" / "checkpointd.log").read_text()
        assert log.count("checkpoint daemon starting at") == 2
        assert log.count(f"{node_id} listening on {address}") == 2
    finally:
        remove_stale_segments(segment_prefix(node_id))


async def test_an_owned_daemon_that_hangs_is_killed_and_started_again(short_dir: Path) -> None:
    node_id = unique("ckpt-hang")
    port = free_port()
    address = f"127.0.0.1:{port}"
    command = shlex.join(checkpointd_argv(node_id, short_dir / "ckpt", port))
    try:
        async with heartbeat_sink() as (sink, scheduler):
            settings = agent_settings(
                scheduler,
                short_dir,
                checkpointd_address=address,
                checkpointd_command=command,
                checkpointd_hang_seconds=1.0,
            )
            async with running_agent(settings) as agent:
                watch = agent.checkpointd
                assert watch is not None
                await wait_state(agent, Liveness.UP)
                hung = watch.pid
                assert hung is not None
                os.kill(hung, signal.SIGSTOP)
                await sink.beat(down_reason(address))
                await asyncio.wait_for(wait_gone([hung]), TIMEOUT)  # SIGKILL ends a stopped one
                await wait_state(agent, Liveness.UP)
                assert watch.pid not in (None, hung)
                await sink.beat(healthy)
    finally:
        remove_stale_segments(segment_prefix(node_id))


async def test_an_owning_agent_leaves_a_daemon_that_answers_alone_until_it_is_gone(
    short_dir: Path, daemons: Callable[..., Checkpointd]
) -> None:
    # A daemon left by an earlier agent: the agent must not start a second one beside
    # it, even when it hangs (both would bind the port), but takes over once it is gone.
    node_id = unique("ckpt-left")
    left = daemons(node_id)
    address = await left.listening()
    port = int(address.rsplit(":", 1)[1])
    command = shlex.join(checkpointd_argv(node_id, short_dir / "ckpt", port))
    async with heartbeat_sink() as (sink, scheduler):
        settings = agent_settings(
            scheduler, short_dir, checkpointd_address=address, checkpointd_command=command
        )
        async with running_agent(settings) as agent:
            watch = agent.checkpointd
            assert watch is not None
            await wait_state(agent, Liveness.UP)
            assert (watch.pid, watch.starts) == (None, 0)
            # Hung, it still holds the port: reported, but no second daemon beside it.
            left.process.send_signal(signal.SIGSTOP)
            await sink.beat(down_reason(address))
            assert (watch.pid, watch.starts) == (None, 0)
            left.kill()
            assert await watch.wait_until(lambda: watch.pid is not None, TIMEOUT)
            await wait_state(agent, Liveness.UP)
            await sink.beat(healthy)
