"""Commands for a node whose agent stream another scheduler process holds go to that
process alone, over real Redis pub/sub, as protobuf bytes; a holder that is unknown,
gone or stale falls back to the shared channel, where the process holding the stream
forwards the command. No command is lost to a wrong guess."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest

from kit.stores import StoreUrls, unique
from kit.waits import until
from pitstop.scheduler.gateway import AgentGateway, CommandRouter
from pitstop.scheduler.hotstate import HotState
from pitstop.v1 import agent_pb2

DEADLINE = 10.0


class Process:
    """One scheduler process's share: its Redis client, gateway and router."""

    def __init__(self, hot: HotState) -> None:
        self.hot = hot
        self.gateway = AgentGateway()
        self.router = CommandRouter(self.gateway, hot)
        self.queues: dict[str, asyncio.Queue[Any]] = {}

    def take(self, node_id: str) -> None:
        """Hold the node's stream, as Connect does."""
        self.queues[node_id] = self.gateway.attach(node_id)


async def taken(holder: Process, node_id: str, *heard_by: Process) -> None:
    """`holder` takes the node's stream; until `heard_by` know it holds it."""
    holder.take(node_id)

    def heard() -> bool:
        return all(p.router.holders.get(node_id) == holder.router.process_id for p in heard_by)

    await until(heard, f"the notice that {node_id} is held", DEADLINE, poll=0.01)


async def received(queue: asyncio.Queue[Any]) -> agent_pb2.SchedulerMessage:
    item = await asyncio.wait_for(queue.get(), DEADLINE)
    assert isinstance(item, agent_pb2.SchedulerMessage), item
    return item


@pytest.fixture
async def processes(stores: StoreUrls) -> AsyncIterator[Callable[[], Awaitable[Process]]]:
    prefix = f"{stores.redis_prefix}{unique('router')}:"
    async with AsyncExitStack() as stack:

        async def start() -> Process:
            hot = HotState.from_url(stores.redis_url, prefix)
            stack.push_async_callback(hot.redis.aclose)
            process = Process(hot)
            process.router.start()
            stack.push_async_callback(process.router.stop)
            # Subscribed (the routers' two channels each) before the test sends anything.
            await until_subscribed(hot, process.router.own_channel)
            return process

        yield start
        first = HotState.from_url(stores.redis_url, prefix)
        await first.redis.delete(first.stream_holders_key)
        await first.redis.aclose()


async def until_subscribed(hot: HotState, channel: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not (await hot.redis.pubsub_numsub(channel))[0][1]:
        if loop.time() > deadline:
            raise AssertionError(f"nobody subscribed to {channel}")
        await asyncio.sleep(0.01)


def start_ranks(job_id: str) -> agent_pb2.SchedulerMessage:
    message = agent_pb2.SchedulerMessage()
    message.start_ranks.job_id = job_id
    return message


async def test_a_command_goes_to_the_holding_process_alone_as_protobuf(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    sender, holder, bystander = await processes(), await processes(), await processes()
    await taken(holder, "n1", sender)
    # What crosses the shared channel while the command is sent: nothing for n1.
    shared = sender.hot.redis.pubsub(ignore_subscribe_messages=True)
    await shared.subscribe(sender.router.channel)
    try:
        assert await sender.router.send("n1", start_ranks("j-1")) == 0
        got = await received(holder.queues["n1"])
        assert got.start_ranks.job_id == "j-1"
        assert got.command_id > 0
        frame = await shared.get_message(timeout=0.5)
        assert frame is None, frame
    finally:
        await shared.aclose()  # type: ignore[no-untyped-call]
    assert not bystander.gateway.connected("n1")


async def test_a_process_started_later_learns_the_holders_from_redis(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    holder = await processes()
    holder.take("n2")
    await until(
        lambda: holder.router.holders.get("n2") == holder.router.process_id,
        "claim",
        DEADLINE,
        poll=0.01,
    )
    probe = await processes()  # its claim went to Redis before this process existed
    await until(
        lambda: probe.router.holders.get("n2") == holder.router.process_id,
        "loaded",
        DEADLINE,
        poll=0.01,
    )
    late = await processes()
    assert await late.router.send("n2", start_ranks("j-2")) == 0
    assert (await received(holder.queues["n2"])).start_ranks.job_id == "j-2"


async def test_a_gone_or_stale_holder_costs_no_command(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    sender, old, new = await processes(), await processes(), await processes()
    await taken(new, "n3", sender)
    # A holder process that is gone: nobody hears its channel, so everyone is asked.
    sender.router.holders["n3"] = "0123456789ab"
    assert await sender.router.send("n3", start_ranks("j-gone")) == 0
    assert (await received(new.queues["n3"])).start_ranks.job_id == "j-gone"
    # A stale holder (the stream moved, its notice lost): that process passes it on.
    sender.router.holders["n3"] = old.router.process_id
    assert await sender.router.send("n3", start_ranks("j-moved")) == 0
    assert (await received(new.queues["n3"])).start_ranks.job_id == "j-moved"


async def test_a_frame_nobody_can_read_does_not_stop_the_routing(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    sender, holder = await processes(), await processes()
    await taken(holder, "n4", sender)
    await sender.hot.redis.publish(holder.router.own_channel, b"no node id here")
    await sender.hot.redis.publish(holder.router.own_channel, b"Mn4\0not protobuf \xff\xff")
    # A batch whose second command's length runs past its end.
    await sender.hot.redis.publish(holder.router.own_channel, b"B\0n4\0\0\0\0\0n4\0\0\0\0\xff")
    assert await sender.router.send("n4", start_ranks("j-4")) == 0
    assert (await received(holder.queues["n4"])).start_ranks.job_id == "j-4"


async def test_closing_a_stream_reaches_the_process_that_holds_it(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    sender, holder = await processes(), await processes()
    holder.take("n5")
    await sender.router.close("n5", "revoked")
    item = await asyncio.wait_for(holder.queues["n5"].get(), DEADLINE)
    assert getattr(item, "reason", None) == "revoked", item


async def test_a_fan_out_reaches_every_node_in_one_round_trip_per_kind_of_channel(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    """`send_many`: the sender's own nodes straight down their streams, the others'
    through Redis, every node its own command; a holder that is gone costs none."""
    sender, left, right = await processes(), await processes(), await processes()
    here = [f"h{i}" for i in range(3)]
    for node_id in here:
        sender.take(node_id)
    on_left = [f"l{i}" for i in range(40)]
    on_right = [f"r{i}" for i in range(40)]
    for node_id in on_left:
        await taken(left, node_id, sender)
    for node_id in on_right:
        await taken(right, node_id, sender)
    sender.router.holders["r0"] = "0123456789ab"  # gone: asked of everyone
    nodes = [*here, *on_left, *on_right]
    await sender.router.send_many([(n, start_ranks(f"j-{n}")) for n in nodes])
    for node_id, process in [
        *((n, sender) for n in here),
        *((n, left) for n in on_left),
        *((n, right) for n in on_right),
    ]:
        got = await received(process.queues[node_id])
        assert got.start_ranks.job_id == f"j-{node_id}"
        assert process.queues[node_id].empty()  # once, not twice


async def test_a_fan_out_through_a_stale_holder_reaches_where_the_stream_went(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    """A batch sent to the process the sender last heard held the nodes: the nodes whose
    streams moved on are passed to every process, once, and arrive."""
    sender, old, new = await processes(), await processes(), await processes()
    await taken(old, "s1", sender)
    await taken(new, "s2", sender)
    sender.router.holders["s2"] = old.router.process_id  # its notice lost
    await sender.router.send_many([(n, start_ranks(f"j-{n}")) for n in ("s1", "s2")])
    for node_id, process in (("s1", old), ("s2", new)):
        got = await received(process.queues[node_id])
        assert got.start_ranks.job_id == f"j-{node_id}"
        assert process.queues[node_id].empty()


async def test_one_message_for_many_nodes_crosses_redis_once_per_holder(
    processes: Callable[[], Awaitable[Process]],
) -> None:
    """A recovery's survivors all get one message: it is serialized once and reaches
    each holding process as one broadcast frame (its bytes, the nodes' ids), every node
    getting it under a command id of its own; a node whose stream moved gets it from its
    new holder, once; nodes with messages of their own get those."""
    sender, left, right = await processes(), await processes(), await processes()
    sender.take("h0")
    on_left = [f"l{i}" for i in range(30)]
    on_right = [f"r{i}" for i in range(30)]
    for node_id in on_left:
        await taken(left, node_id, sender)
    for node_id in on_right:
        await taken(right, node_id, sender)
    sender.router.holders["r0"] = left.router.process_id  # a stale notice: r0 is right's
    survivors = ["h0", *on_left[1:], *on_right]
    kept = agent_pb2.SchedulerMessage()
    kept.reconfigure_kept.job_id = "j-1"
    kept.reconfigure_kept.generation = 7
    frames = sender.hot.redis.pubsub()
    await frames.psubscribe(f"{sender.router.channel}*")
    try:
        confirmed = await frames.get_message(timeout=DEADLINE)
        assert confirmed is not None
        assert confirmed["type"] == "psubscribe"
        await sender.router.send_many(
            [(n, kept) for n in survivors] + [(on_left[0], start_ranks("j-1"))]
        )
        seen = []
        while (frame := await frames.get_message(timeout=0.5)) is not None:
            if frame["type"] == "pmessage" and frame["data"][:1] in (b"B", b"R", b"M"):
                seen.append(frame["data"][:1])
    finally:
        await frames.aclose()  # type: ignore[no-untyped-call]
    # One broadcast frame per holder (and left's pass of r0 to everyone); one batch.
    assert sorted(seen) == [b"B", b"R", b"R", b"R"], seen
    ids = set()
    for node_id, process in [
        ("h0", sender),
        *((n, left) for n in on_left[1:]),
        *((n, right) for n in on_right),
    ]:
        got = await received(process.queues[node_id])
        assert (got.reconfigure_kept.job_id, got.reconfigure_kept.generation) == ("j-1", 7)
        assert process.queues[node_id].empty()
        ids.add((id(process), got.command_id))
    assert len(ids) == len(survivors)  # a command id of its own in its process
    got = await received(left.queues[on_left[0]])
    assert got.start_ranks.job_id == "j-1"
