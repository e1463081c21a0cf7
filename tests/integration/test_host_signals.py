"""What the hosts of a hang's or a straggler's nodes report, read from their live health
in Redis as their heartbeats left it: the clause a job.hang_located or job.straggler
event ends with."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format

from kit.stores import StoreUrls, unique
from pitstop.scheduler.hotstate import HotState, host_signals
from pitstop.v1 import common_pb2


@pytest.fixture
async def hot(stores: StoreUrls) -> AsyncIterator[HotState]:
    client = aioredis.Redis.from_url(stores.redis_url)
    state = HotState(client, f"{stores.redis_prefix}{unique('signals')}:")
    try:
        yield state
    finally:
        await client.delete(state.deadlines_key, state.live_health_key)
        await client.aclose()


def health(*reasons: str) -> str:
    verdict = common_pb2.HEALTH_VERDICT_WARNING if reasons else common_pb2.HEALTH_VERDICT_HEALTHY
    node = common_pb2.NodeHealth(
        verdict=verdict, host=common_pb2.HostHealth(verdict=verdict, reasons=reasons)
    )
    return json.dumps(json_format.MessageToDict(node, preserving_proto_field_name=True))


async def test_only_the_hosts_with_something_to_say_are_named(hot: HotState) -> None:
    flap = "infiniband link mlx5_1/1 flapped 4 times in 60 s"
    await hot.record_heartbeat("node-12", 60.0, health(flap, "host memory pressure: 30%"))
    await hot.record_heartbeat("node-3", 60.0, health())
    said = await host_signals(hot, ["node-3", "node-12", "node-12", "never-seen"])
    assert said == f"node-12's host: {flap}, host memory pressure: 30%"
    assert await host_signals(hot, ["node-3"]) == ""
    assert await host_signals(hot, []) == ""
