"""The snapshot stall (issue 14): slots reused and pre-faulted, nothing on the rank's
path but the copy, and never a half-written snapshot visible. Real daemons on port 0,
real gRPC, real shared memory; a rank killed mid-copy is a real process."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpointd_harness import (
    LOCAL,
    DaemonThread,
    as_bytes,
    make_state,
    node_segments,
    restored_bytes,
    stub,
)

from pitstop.checkpointd.config import CheckpointdSettings
from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.checkpointd.writer import SnapshotWriter
from pitstop.v1 import checkpoint_pb2


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., DaemonThread]]:
    started: list[DaemonThread] = []

    def start(node: str, **overrides: Any) -> DaemonThread:
        values: dict[str, Any] = {
            "node_id": f"{node}-{uuid.uuid4().hex[:6]}",
            "host": "127.0.0.1",
            "port": 0,
            "scheduler": "",
            "state_dir": tmp_path / node,
            "memory_budget_bytes": 64 << 20,
            "retry_max_seconds": 0.2,
            "flush_every_steps": 1000,
            **overrides,
        }
        daemon = DaemonThread(CheckpointdSettings(**values))
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        remove_stale_segments(segment_prefix(daemon.daemon.node_id))


def test_without_a_scheduler_the_newest_k_are_kept_in_the_same_segments(
    daemons: Callable[..., DaemonThread],
) -> None:
    """No scheduler ever commits a step, so nothing awaits a commit: the daemon keeps
    keep_in_memory snapshots per rank and the rank writes each new one into a segment
    an old one gave back, not into a fresh (unfaulted) one."""
    node = daemons("a", keep_in_memory=2)
    writer = SnapshotWriter(node.address, "job-reuse", 0)
    try:
        for step in range(1, 9):
            assert not writer.snapshot(step, make_state(0, step)).skipped
            writer.wait()
        listed = stub(node.address).ListShards(checkpoint_pb2.ListShardsRequest(job_id="job-reuse"))
        assert sorted(s.header.key.step for s in listed.shards if s.tier == LOCAL) == [7, 8]
        # Two kept, one leased for the next snapshot.
        assert len(node_segments(node.daemon.node_id)) == 3
        assert restored_bytes(writer)[0] == as_bytes(make_state(0, 8))
        assert restored_bytes(writer, 7)[0] == as_bytes(make_state(0, 7))
    finally:
        writer.close()
