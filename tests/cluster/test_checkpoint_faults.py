"""The fault matrix, the checkpoint daemons' faults: a shard corrupted in shared memory,
a durable store with no byte free until room returns."""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import pytest

from kit.faultcluster import (
    STEP_SECONDS,
    STEPS,
    Cluster,
    check_result,
    killpg,
    reference_hash,
    restored_steps,
    steps_never_run,
    wait_until,
)
from kit.forking import ForkClient
from pitstop.agent.identity import identity_for
from pitstop.checkpointd.slots import segment_prefix
from pitstop.common.tls import open_channel
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc, nodes_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


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
def test_a_full_durable_store_is_reported_and_training_goes_on_until_room_returns(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """Every node flushes every 5 steps to a store with no byte free. The flushes are
    refused before they write and reported as events saying how much is free; each
    node reports its disk full (degraded, nothing drained); no rank waits on them, the
    in-memory copies stay, so a node lost mid-run is still recovered from memory. Then
    the room comes back: the next flushes land, the nodes say so, and the job ends with
    the fault-free hash and a durable step."""
    steps = 80  # at 0.1 s a step: the room returns mid-run
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1")
    failed = cluster.wait(lambda e: e.kind == "checkpoint.flush_failed", "a flush_failed event")
    assert "refused before writing" in failed.reason, failed
    assert "free, the flush needs" in failed.reason, failed
    assert f"job {job.id}" in failed.reason, failed
    victim = cluster.node_of(job, 2)
    # Full since before the agents started: reported as each registered.
    degraded = [
        e
        for e in cluster.event_api.List(nodes_pb2.ListEventsRequest(limit=1000)).events
        if e.kind == "node.degraded" and e.node_id == victim.node_id
    ]
    assert degraded, cluster.logs(job.id)
    said = f"disk {cluster.root / 'store' / 'durable'}: 0.0 GiB free"
    assert said in degraded[0].reason, degraded
    assert cluster.get(job.id).durable_step == 0  # nothing landed
    cluster.wait_for_step(job, 2, random.randint(12, 20))
    cluster.kill_node(victim.node_id)
    cluster.job_event(job.id, "job.recovered")
    (cluster.root / "store" / "filler").unlink()  # the room is back
    wait_until(lambda: cluster.get(job.id).durable_step > 0, "a durable flush once room returned")
    survivor = cluster.node_of(cluster.get(job.id), 0)
    cluster.wait(
        lambda e: e.kind == "node.degraded_cleared" and e.node_id == survivor.node_id,
        f"{survivor.node_id} says its disk has room",
    )
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    assert done.durable_step > 0, done
    restored = restored_steps(cluster, done)
    assert restored, cluster.logs(job.id)
    assert min(restored) > 0, restored
