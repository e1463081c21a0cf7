"""The agent's stream to a stand-in scheduler, to check the wire protocol itself: every
stream registers first and numbers its messages, a message queued while a stream is
refused goes out on the next, heartbeats go out on news and on refresh, the agent's own
keepalive leaves a scheduler gone silent, step summaries go out in batches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kit.agents import agent_settings, running_agent
from kit.waits import until
from pitstop.agent.gpu import SimulatedBackend
from pitstop.agent.main import NodeAgent
from pitstop.v1 import agent_pb2, common_pb2

TIMEOUT = 15.0


class FakeStream:
    """One agent stream as the fake scheduler sees it."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self.metadata = metadata
        self.received: asyncio.Queue[agent_pb2.AgentMessage] = asyncio.Queue()
        self.commands: asyncio.Queue[agent_pb2.SchedulerMessage | None] = asyncio.Queue()

    async def next(self, kind: str | None = None) -> agent_pb2.AgentMessage:
        """The next message (of `kind`, skipping others)."""
        async with asyncio.timeout(TIMEOUT):
            while True:
                message = await self.received.get()
                if kind is None or message.WhichOneof("body") == kind:
                    return message

    def end(self) -> None:
        self.commands.put_nowait(None)


class FakeScheduler:
    """An AgentService that records what the agent sends, to check the wire protocol
    itself: sequence numbers, registration, batching. `refuse` streams are refused."""

    def __init__(self, heartbeat_interval: float, refuse: int = 0, refresh: float = 0.0) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.refresh = refresh
        self.refuse = refuse
        self.before_refusal: Callable[[], Awaitable[None]] | None = None
        """Run once a stream to be refused has sent its Register, before the refusal."""
        self.streams: asyncio.Queue[FakeStream] = asyncio.Queue()

    async def Connect(  # noqa: N802 (gRPC method name)
        self, requests: AsyncIterator[agent_pb2.AgentMessage], context: Any
    ) -> AsyncIterator[agent_pb2.SchedulerMessage]:
        if self.refuse:
            self.refuse -= 1
            if self.before_refusal is not None:
                await anext(aiter(requests))  # the Register
                await self.before_refusal()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused by the test")
        stream = FakeStream(dict(context.invocation_metadata()))

        async def read() -> None:
            async for message in requests:
                stream.received.put_nowait(message)

        reader = asyncio.create_task(read())
        self.streams.put_nowait(stream)
        try:
            registered = agent_pb2.Registered(
                node_id="fake",
                heartbeat_interval_seconds=self.heartbeat_interval,
                refresh_interval_seconds=self.refresh,
            )
            yield agent_pb2.SchedulerMessage(registered=registered)
            while (command := await stream.commands.get()) is not None:
                yield command
        finally:
            reader.cancel()

    async def next_stream(self) -> FakeStream:
        return await asyncio.wait_for(self.streams.get(), TIMEOUT)


@contextlib.asynccontextmanager
async def fake_scheduler(
    heartbeat_interval: float, refuse: int = 0, refresh: float = 0.0
) -> AsyncIterator[Any]:
    from pitstop.v1 import agent_pb2_grpc

    fake = FakeScheduler(heartbeat_interval, refuse, refresh)
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


class KernelLogBackend(SimulatedBackend):
    """Simulated GPUs whose kernel log holds one old Xid."""

    def kernel_log_xids(self) -> list[common_pb2.XidEvent]:
        return [common_pb2.XidEvent(gpu_index=0, xid=48, source=common_pb2.XID_SOURCE_KERNEL_LOG)]


async def test_every_stream_registers_first_and_numbers_its_messages_from_1(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pitstop.agent.link")
    async with fake_scheduler(heartbeat_interval=0.05, refuse=1) as (fake, address):
        settings = agent_settings(
            address, short_dir, gpus="sim:2", role="spare", token="agent-token-0123456789"
        )
        agent = NodeAgent(settings, KernelLogBackend(settings.node_id, 2))
        await agent.start()
        stop = asyncio.Event()
        run = asyncio.create_task(agent.run(stop))
        try:
            first = await fake.next_stream()
            assert first.metadata["authorization"] == "Bearer agent-token-0123456789"
            messages = [await first.next()]
            while {"xid", "heartbeat"} - {m.WhichOneof("body") for m in messages}:
                messages.append(await first.next())
            assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
            register = messages[0].register
            assert register.node_id == settings.node_id
            assert [g.uuid for g in register.inventory.gpus] == [
                f"GPU-sim-{settings.node_id}-0",
                f"GPU-sim-{settings.node_id}-1",
            ]
            assert register.requested_role == common_pb2.NODE_ROLE_SPARE
            assert register.HasField("agent_started_at")
            [old] = [m.xid for m in messages if m.WhichOneof("body") == "xid"]
            assert (old.xid, old.verdict) == (48, common_pb2.HEALTH_VERDICT_FATAL)
            beat = (await first.next("heartbeat")).heartbeat  # sent after the old Xid
            assert beat.health.verdict == common_pb2.HEALTH_VERDICT_HEALTHY  # history only
            assert len(beat.health.gpus) == 2

            first.end()
            second = await fake.next_stream()
            again = [await second.next() for _ in range(4)]
            assert [m.seq for m in again] == [1, 2, 3, 4]
            assert again[0].register.agent_started_at == register.agent_started_at
            assert "xid" not in [m.WhichOneof("body") for m in again]
            assert agent.link.registrations == 2
        finally:
            stop.set()
            await asyncio.wait_for(run, TIMEOUT)
            await agent.close()
    refused = [r for r in caplog.records if "refused by the test" in r.getMessage()]
    assert refused
    assert refused[0].levelname == "ERROR"


async def test_a_message_queued_as_a_stream_is_refused_goes_out_on_the_next_stream(
    short_dir: Path,
) -> None:
    """The refused stream's writer, waiting for the answer to its Register, must not take
    the message queued meanwhile (and lose it on a stream that has ended)."""
    exited = agent_pb2.RankExited(job_id="job-q", generation=1, rank=3, exit_code=0)
    async with fake_scheduler(heartbeat_interval=3600.0, refuse=1) as (fake, address):
        settings = agent_settings(address, short_dir, gpus="sim:1")
        async with running_agent(settings) as agent:
            # Set before the agent's first connection (its task has not run yet).
            fake.before_refusal = lambda: agent.link.report_rank_exit(exited)
            stream = await fake.next_stream()  # the second connection, accepted
            assert (await stream.next("rank_exited")).rank_exited == exited


class CountingBackend(SimulatedBackend):
    """Simulated GPUs that count how often the agent looked at them."""

    def __init__(self, node_id: str, count: int) -> None:
        super().__init__(node_id, count)
        self.looks = 0

    def read_health(self) -> list[common_pb2.GpuHealth]:
        self.looks += 1
        return super().read_health()

    async def looked(self, more: int) -> None:
        """Return once the agent has looked `more` times from now."""
        target = self.looks + more
        await until(lambda: self.looks >= target, f"{more} more looks", TIMEOUT, in_thread=True)


async def test_a_heartbeat_goes_out_when_what_it_says_changes_not_at_every_look(
    short_dir: Path,
) -> None:
    """At 12,500 nodes a heartbeat a second from each is most of the scheduler's work,
    and nearly all of them repeat the last. The agent looks every interval but sends
    only a change of verdict or of its processes (and a refresh, here an hour away):
    a new temperature is no news, a double-bit ECC error is at once."""
    async with fake_scheduler(heartbeat_interval=0.02, refresh=3600.0) as (fake, address):
        settings = agent_settings(address, short_dir, gpus="sim:2")
        backend = CountingBackend(settings.node_id, 2)
        async with running_agent(settings, backend):
            stream = await fake.next_stream()
            first = (await stream.next("heartbeat")).heartbeat
            assert first.health.verdict == common_pb2.HEALTH_VERDICT_HEALTHY
            await backend.looked(10)
            backend.set_reading(0, temperature_c=61.0)
            await backend.looked(10)
            said = [m.WhichOneof("body") for m in drain(stream.received)]
            assert "heartbeat" not in said
            backend.inject_fault(common_pb2.Fault(gpu_index=1, ecc_double_bit=1))
            beat = (await stream.next("heartbeat")).heartbeat
            assert beat.health.verdict != common_pb2.HEALTH_VERDICT_HEALTHY
            assert beat.health.gpus[0].temperature_c == 61.0  # the latest readings go along


def drain(messages: asyncio.Queue[agent_pb2.AgentMessage]) -> list[agent_pb2.AgentMessage]:
    out = []
    while not messages.empty():
        out.append(messages.get_nowait())
    return out


async def test_with_nothing_new_a_heartbeat_still_goes_out_every_refresh(
    short_dir: Path,
) -> None:
    async with fake_scheduler(heartbeat_interval=0.02, refresh=0.1) as (fake, address):
        settings = agent_settings(address, short_dir, gpus="sim:1")
        backend = CountingBackend(settings.node_id, 1)
        async with running_agent(settings, backend):
            stream = await fake.next_stream()
            beats = [(await stream.next("heartbeat")).heartbeat for _ in range(3)]
            assert len({_gist_of(b) for b in beats}) == 1  # the same news, refreshed
            assert backend.looks >= 5  # and looked more often than it said so


def _gist_of(beat: agent_pb2.Heartbeat) -> tuple[object, ...]:
    return (beat.health.verdict, tuple(beat.health.reasons), len(beat.running_ranks))


FROZEN_SCHEDULER = """
import asyncio

import grpc
from pitstop.v1 import agent_pb2, agent_pb2_grpc


class Scheduler:
    async def Connect(self, requests, context):
        await anext(aiter(requests))
        registered = agent_pb2.Registered(
            node_id="n", heartbeat_interval_seconds=3600, refresh_interval_seconds=3600
        )
        yield agent_pb2.SchedulerMessage(registered=registered)
        async for _ in requests:
            pass


async def main():
    server = grpc.aio.server(
        options=[
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 500),
            ("grpc.http2.max_ping_strikes", 0),
        ]
    )
    agent_pb2_grpc.add_AgentServiceServicer_to_server(Scheduler(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()


asyncio.run(main())
"""


async def test_an_agent_leaves_a_scheduler_gone_silent_by_its_own_keepalive(
    short_dir: Path,
) -> None:
    """The scheduler's host freezes (no TCP reset) and the agent sends nothing (its
    heartbeats are an hour apart): its own pings go unanswered and it drops the stream,
    to reconnect (to another scheduler process, where there are several)."""
    frozen = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FROZEN_SCHEDULER, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert frozen.stdout is not None
        port = int(await asyncio.wait_for(frozen.stdout.readline(), TIMEOUT))
        settings = agent_settings(
            f"127.0.0.1:{port}",
            short_dir,
            gpus="sim:1",
            keepalive_seconds=0.5,
            keepalive_timeout_seconds=1.0,
        )
        async with running_agent(settings) as agent:
            await agent.link.wait_registered(timeout=TIMEOUT)
            frozen.send_signal(signal.SIGSTOP)
            await until(
                lambda: not agent.link.connected, "the stream to drop", TIMEOUT, in_thread=True
            )
            assert agent.link.registrations == 1
    finally:
        frozen.send_signal(signal.SIGCONT)
        frozen.kill()
        await frozen.wait()


async def test_a_step_summary_goes_out_before_the_next_heartbeat_once_1024_samples_wait(
    short_dir: Path,
) -> None:
    async with fake_scheduler(heartbeat_interval=3600.0) as (fake, address):
        settings = agent_settings(address, short_dir, gpus="sim:1")
        async with running_agent(settings) as agent:
            stream = await fake.next_stream()
            await stream.next("heartbeat")  # the first beat, at registration
            for step in range(1024):
                sample = agent_pb2.StepSample(rank=step % 2, step=step // 2, step_seconds=0.1)
                agent.steps.add("job-a", 3, sample)
            summary = (await stream.next("step_summary")).step_summary
            assert (summary.job_id, summary.generation, summary.samples) == ("job-a", 3, 1024)
            assert (summary.ranks, summary.slowest_step, summary.newest_step) == (2, 511, 511)
            reported = agent.metrics.registry.get_sample_value(
                "pitstop_agent_steps_reported_total", {"node": settings.node_id, "job_id": "job-a"}
            )
            assert reported == 1024
