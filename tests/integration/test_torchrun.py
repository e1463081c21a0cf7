"""Two torchrun "nodes" meet through ``--rdzv-backend=pitstop`` and train to completion.

Each node is its own ``torchrun`` process with one rank. The job is data-parallel least
squares over gloo: every rank takes the gradient of its half of the batch, the ranks
average gradients with all_reduce, and both step. Afterwards both ranks must hold the
same weights bit for bit, and those weights must be what one process gets from the
whole batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kit.schedulers import SchedulerThread, tls_scheduler
from kit.stores import StoreUrls, unique
from pitstop.common.enrollment import enroll
from pitstop.common.tls import TLS_DIR_ENV, NodeIdentity
from pitstop.v1 import nodes_pb2, nodes_pb2_grpc

STEPS = 5
LEARNING_RATE = 0.1
NODE_TIMEOUT_SECONDS = 90

JOB = f"""
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same data and start on every rank
x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
w = torch.zeros(3, dtype=torch.float64)
half = len(x) // world
xs, ys = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
for _ in range({STEPS}):
    grad = 2 * xs.T @ (xs @ w - ys) / len(xs)
    dist.all_reduce(grad)
    w -= {LEARNING_RATE} * grad / world
with open(os.path.join(sys.argv[1], f"rank{{rank}}.json"), "w") as out:
    json.dump({{"rank": rank, "world": world, "weights": w.tolist()}}, out)
dist.destroy_process_group()
"""


def expected_weights() -> list[float]:
    """The same training in one process on the whole batch."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    w = torch.zeros(3, dtype=torch.float64)
    for _ in range(STEPS):
        w -= LEARNING_RATE * 2 * x.T @ (x @ w - y) / len(x)
    return list(w.tolist())


def test_two_torchrun_nodes_rendezvous_through_pitstop(
    scheduler: SchedulerThread, tmp_path: Path
) -> None:
    run_two_nodes(scheduler.address, tmp_path, {})


def test_under_mutual_tls_torchrun_meets_with_the_nodes_certificate(
    stores: StoreUrls, tmp_path: Path
) -> None:
    """A secure scheduler takes the agent role only from a node certificate: torchrun
    started by the agent finds the node's identity in PITSTOP_TLS_DIR and talks mutual
    TLS to the scheduler's node port."""
    (tmp_path / "scheduler").mkdir()
    scheduler = tls_scheduler(stores, tmp_path / "scheduler", [])
    try:
        assert scheduler.ca is not None
        with scheduler.channel() as channel:
            made = nodes_pb2_grpc.NodeServiceStub(channel).CreateJoinToken(
                nodes_pb2.CreateJoinTokenRequest(node_id="tr-node"), timeout=10
            )
        identity = NodeIdentity(tmp_path / "tls", "tr-node")
        enroll(identity, scheduler.address, made.token, scheduler.ca)
        run_two_nodes(scheduler.address, tmp_path, {TLS_DIR_ENV: str(identity.directory)})
    finally:
        scheduler.stop()


def run_two_nodes(address: str, tmp_path: Path, extra_env: dict[str, str]) -> None:
    """Two one-rank torchrun "nodes" meeting at `address`; both must end with the weights
    one process gets from the whole batch."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    results = tmp_path / "results"
    results.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--max-restarts=0",
        "--rdzv-backend=pitstop",
        f"--rdzv-endpoint={address}",
        f"--rdzv-id={unique('torchrun')}",
        # Both "nodes" share this host; name it so rank 0's store is reachable.
        "--local-addr=127.0.0.1",
        # Fail within the test's time rather than torch's default ten minutes.
        "--rdzv-conf=join_timeout=60",
        str(script),
        str(results),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra_env}
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = []
    for log in logs:
        with log.open("wb") as sink:
            nodes.append(subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT))
    try:
        codes = [node.wait(NODE_TIMEOUT_SECONDS) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    output = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
    assert codes == [0, 0], output

    ranks = [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # bit for bit: floats round-trip JSON
    assert torch.allclose(
        torch.tensor(ranks[0]["weights"], dtype=torch.float64),
        torch.tensor(expected_weights(), dtype=torch.float64),
    )
