"""A checkpoint daemon keeps a channel to each peer it pushes to or pulls from, but not
for ever: a peer's daemon restarted on another port, or a buddy replaced long ago,
leaves an address no one calls again, and its channel (a socket) would stay open."""

from __future__ import annotations

from typing import Any, cast

from pitstop.checkpointd import replication
from pitstop.checkpointd.replication import Replicator


async def test_a_channel_unused_for_long_is_closed_and_one_in_use_kept() -> None:
    clock = [1000.0]
    replicator = Replicator(cast(Any, None), cast(Any, None), clock=lambda: clock[0])
    try:
        old = replicator.stub("127.0.0.1:1")
        replicator.stub("127.0.0.1:2")
        clock[0] += replication.CHANNEL_IDLE_SECONDS / 2
        assert replicator.stub("127.0.0.1:1") is old  # kept while it is used
        clock[0] += replication.CHANNEL_IDLE_SECONDS / 2 + 1
        replicator.stub("127.0.0.1:3")
        assert replicator.peers == ["127.0.0.1:1", "127.0.0.1:3"]  # :2 idle too long
        clock[0] += replication.CHANNEL_IDLE_SECONDS + 1
        replicator.stub("127.0.0.1:1")  # the one asked for is never the one closed
        assert replicator.peers == ["127.0.0.1:1"]
    finally:
        await replicator.close()
