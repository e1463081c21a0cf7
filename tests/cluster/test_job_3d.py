"""The fault matrix on the 3D example (tp = pp = dp = 2): a node lost, then the spares
run out and the job shrinks to one replica."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

from kit.faultcluster import (
    SPARE,
    STEP_SECONDS,
    TIMEOUT,
    Cluster,
    wait_until,
)
from kit.forking import ForkClient, run_mesh_ranks
from kit.stores import unique
from pitstop.client import scenario
from pitstop.client.launch import clean_env
from pitstop.v1 import common_pb2, jobs_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


# The 3D example (pitstop.trainer.example3d): tp = pp = dp = 2 on four 2-GPU nodes (a
# node holds one TP pair: a pipeline stage of a replica) and a 2-GPU spare.
STEPS_3D = 16
MODEL_3D = list(scenario.MODEL_3D)
"""One block a stage and two microbatches a replica through 1F1B, as the recovery benchmark's 3D
job: still every kind of parallelism, at 0.4 s a step here rather than the example's
default 1.2 s (8 ranks on 2 cores)."""
EXAMPLE_3D = [
    sys.executable,
    "-m",
    "pitstop.trainer.example3d",
    *MODEL_3D,
    "--steps",
    str(STEPS_3D),
]
DCP_3D = Path(__file__).with_name("dcp3d_rank.py")
JOINED_LINE = re.compile(rb"rank (\d+) joined generation (\d+) at step (\d+)")
RESHARDED_LINE = re.compile(
    rb"rank \d+: step (\d+) resharded from dp=2 \(ranks \[\d+, \d+\]\) to dp=1"
)


@pytest.fixture(scope="module")
def fault_free_3d(rank_forks: ForkClient) -> tuple[str, dict[int, str]]:
    """The 3D example run without pitstop: its 8 ranks (the same mesh) one gloo world on
    loopback, as torchrun would start them (`RANK`, `WORLD_SIZE`, `MASTER_*`), forked
    from the ranks' fork server: the hash every run of it must end with, and the samples
    each of its steps read. (torchrun itself meets pitstop in
    tests/integration/test_torchrun.py.)"""
    outputs = run_mesh_ranks(
        [*EXAMPLE_3D[1:], "--log-every", "1"],
        dp=2,
        pp=2,
        tp=2,
        timeout=3 * TIMEOUT,
        fork=rank_forks,
        env=clean_env(),
    )
    said = [re.findall(r'"final_weights_sha256": "([0-9a-f]{64})"', out) for out in outputs]
    hashes = {h for found in said for h in found}
    assert all(said), [out[-1500:] for out in outputs]
    assert len(hashes) == 1, hashes
    samples = step_samples([out.encode() for out in outputs])
    assert sorted(samples) == list(range(1, STEPS_3D + 1)), samples
    return hashes.pop(), samples


@pytest.fixture(scope="module")
def hash_3d(fault_free_3d: tuple[str, dict[int, str]]) -> str:
    return fault_free_3d[0]


def step_samples(logs: list[bytes]) -> dict[int, str]:
    """The samples each step read (its `samples` digest), from every rank's step lines;
    fails on a step whose ranks read different samples."""
    read: dict[int, set[str]] = {}
    for text in logs:
        for line in text.splitlines():
            if line.startswith(b'{"rank"') and b'"samples": ' in line:
                said = json.loads(line)
                read.setdefault(said["step"], set()).add(said["samples"])
    assert all(len(seen) == 1 for seen in read.values()), read
    return {step: seen.pop() for step, seen in read.items()}


@pytest.mark.parametrize("durable_every", [8])
@pytest.mark.parametrize("gpus", [2])
@pytest.mark.parametrize("fault", ["node_killed", "fatal_xid"])
def test_the_3d_job_loses_a_node_and_ends_with_the_fault_free_hash(
    cluster: Cluster, hash_3d: str, fault: str, tmp_path: Path, rank_forks: ForkClient
) -> None:
    """Then, leaving pitstop: torch.distributed.checkpoint loads the job's last durable
    flush (step 16, which the nodes flush to one store) into a fresh 4-rank (dp = 1)
    script, which holds the weights the job ended with. (A load at the saving world size
    and at another is tests/integration/test_dcp_load.py's.)"""
    spec = jobs_pb2.JobSpec(
        name=unique("llama3d"),
        command=[*EXAMPLE_3D, "--log-every", "1", "--step-seconds", str(STEP_SECONDS)],
        tp=2,
        pp=2,
        dp=2,
        min_dp=2,
        gpus_per_node=2,
        spares=1,
        max_restarts=3,
        env={"PYTHONUNBUFFERED": "1"},
    )
    job = cluster.submit_spec(spec)
    victim_rank = random.randrange(8)
    at_step = random.randint(3, STEPS_3D // 2)
    victim = cluster.node_of(job, victim_rank)
    lost = sorted(a.rank for a in job.rank_map.ranks if a.node_id == victim.node_id)
    cluster.wait_for_step(job, victim_rank, at_step)
    if fault == "node_killed":
        cluster.kill_node(victim.node_id)
    else:
        cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    done = cluster.finish(job.id)
    context = f"{fault} on {victim.node_id} (ranks {lost}) at step {at_step}"
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, context
    assert done.result["final_weights_sha256"] == hash_3d, (context, cluster.logs(job.id))
    assert done.current_step == STEPS_3D
    assert done.generation >= 2, context
    placed = {a.rank: a.node_id for a in done.rank_map.ranks}
    assert {placed[r] for r in lost} == {SPARE}, context  # the TP pair moved together
    # Every other rank (the lost pair's pipeline neighbours and the other replica) kept
    # its process and re-formed in place: the mesh rebuilt, its shards moved over.
    for rank in set(range(8)) - set(lost):
        text = cluster.node_of(done, rank).rank_log(job.id, rank).read_bytes()
        joined = [m for m in JOINED_LINE.finditer(text) if int(m.group(1)) == rank]
        assert joined, (context, rank, text[-3000:])
        assert text.count(b'"shape": [2, 2, 2]') == 1, (context, rank)  # one process
    if fault != "node_killed":
        return  # the load is the same after either fault: once is enough
    reader = [str(DCP_3D), "--url", cluster.durable_url, "--job", job.id, *MODEL_3D]
    wait_until(
        lambda: durable_step(cluster.durable_url, job.id) == STEPS_3D,
        f"step {STEPS_3D} of job {job.id} complete in {cluster.durable_url}",
    )
    # Half the job's world size: DCP reshards the dp = 2 flush to one replica.
    out = tmp_path / "dp1.json"
    run_mesh_ranks(
        [*reader, "--out", str(out)], dp=1, pp=2, tp=2, timeout=3 * TIMEOUT, fork=rank_forks
    )
    loaded = json.loads(out.read_text())
    assert loaded == {"step": STEPS_3D, "final_weights_sha256": hash_3d}, loaded


def durable_step(url: str, job_id: str) -> int:
    """The newest complete durable step of the job (0: none yet)."""
    from pitstop.trainer.dcp import DurableCheckpointError, DurableReader

    try:
        return DurableReader(url, job_id).step
    except DurableCheckpointError:
        return 0


@pytest.mark.parametrize("gpus", [2])
def test_the_3d_job_shrinks_to_one_replica_when_the_spares_run_out(
    cluster: Cluster, fault_free_3d: tuple[str, dict[int, str]]
) -> None:
    """A fatal Xid on a node's GPU: the node is unhealthy and its TP pair moves to the
    spare (its buddies stop replicating to it). Then a node is killed and no spare is
    left, so the job drops the replica that lost it (min_dp 1) and the four survivors
    reshard their FSDP state to dp = 1 from the snapshots of the old ranks, in place, and
    train on to the end with the loss still falling. The one replica left runs both
    replicas' microbatches: every step reads the global batch the fault-free run's same
    step reads (pitstop.data), though the sums, added in another order, are not bitwise
    the fault-free run's."""
    steps = STEPS_3D + 8
    spec = jobs_pb2.JobSpec(
        name=unique("llama3d"),
        command=[
            *EXAMPLE_3D[:-1],
            str(steps),
            "--log-every",
            "1",
            "--step-seconds",
            str(STEP_SECONDS),
        ],
        tp=2,
        pp=2,
        dp=2,
        min_dp=1,
        gpus_per_node=2,
        spares=1,
        max_restarts=3,
        env={"PYTHONUNBUFFERED": "1"},
    )
    job = cluster.submit_spec(spec)
    first = cluster.node_of(job, random.randrange(8))
    cluster.wait_for_step(job, 0, 3)
    cluster.inject(first.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    cluster.job_event(job.id, "job.recovered")
    moved = cluster.get(job.id)
    assert SPARE in {a.node_id for a in moved.rank_map.ranks}
    assert first.node_id not in {a.node_id for a in moved.rank_map.ranks}  # the pair moved
    victim_rank = random.randrange(8)
    second = cluster.node_of(moved, victim_rank)
    cluster.wait_for_step(moved, victim_rank, steps // 2)
    cluster.kill_node(second.node_id)
    shrunk = cluster.job_event(job.id, "job.recovering", "job.reconfigured")
    assert "shrunk to dp=1" in shrunk.reason, shrunk
    done = cluster.finish(job.id)
    assert done.current_step == steps
    assert done.rank_map.world_size == 4
    assert {a.dp for a in done.rank_map.ranks} == {0}
    assert {a.node_id for a in done.rank_map.ranks}.isdisjoint({first.node_id, second.node_id})
    logs = [p.read_bytes() for p in cluster.root.glob(f"*/agent/ranks/{job.id}/rank-*.log")]
    resharded = [m for text in logs for m in RESHARDED_LINE.finditer(text)]
    # Each survivor cut its shards from both old replicas' snapshots of one step.
    assert len(resharded) >= 4, cluster.logs(job.id)
    restored = {int(m.group(1)) for m in resharded}
    # Every step read its global batch, at dp 2 and at dp 1: the fault-free run's.
    samples = step_samples(logs)
    assert sorted(samples) == list(range(1, steps + 1)), sorted(samples)
    assert len(set(samples.values())) == steps, samples  # no batch read twice
    fault_free = fault_free_3d[1]
    assert {s: samples[s] for s in fault_free} == fault_free, (samples, fault_free)
    # The last stage's loss, step by step (a step run again after a rollback: its last).
    losses: dict[int, float] = {}
    for text in logs:
        for line in text.splitlines():
            if line.startswith(b'{"rank"') and b'"loss": ' in line:
                said = json.loads(line)
                if said.get("loss") is not None:
                    losses[said["step"]] = said["loss"]
    assert set(losses) == set(range(1, steps + 1)), sorted(losses)
    at = max(restored)
    before = [losses[s] for s in range(at - 3, at + 1)]
    after = [losses[s] for s in range(steps - 3, steps + 1)]
    assert sum(after) / 4 < sum(before) / 4, (at, losses)
