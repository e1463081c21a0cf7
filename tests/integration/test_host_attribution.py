"""A host signal explains what the job saw: a port that retrained at a lower rate slows
its node's ranks (the simulated link slows their steps as collectives over it would),
the straggler detector flags the rank, and its event and the swap's incident name the
node and the link. Real agents on simulated GPUs and hosts, fake rank processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kit.agents import AgentSpec, run_agents
from kit.events import follow_events, wait_for
from kit.ranks import FAKE_RANK
from kit.schedulers import SchedulerThread, agents_leader
from kit.stores import StoreUrls, unique
from pitstop.v1 import common_pb2, jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc

SLOWER = "w2's host: infiniband link mlx5_0/1 runs at 200 Gb/s, below the 400 Gb/s it ran at"


@pytest.fixture
def deciding(stores: StoreUrls, tmp_path: Path) -> Iterator[SchedulerThread]:
    thread = agents_leader(stores, tmp_path, "host")
    yield thread
    thread.stop()


def job_event(events: Iterator[Any], job_id: str, kind: str) -> Any:
    return wait_for(events, lambda e: e.job_id == job_id and e.kind == kind)


def test_a_slower_link_makes_a_straggler_named_by_its_node_and_link(
    deciding: SchedulerThread, short_dir: Path
) -> None:
    events = follow_events(deciding.address)
    specs = [AgentSpec(f"w{i}", gpus=1) for i in range(4)] + [
        AgentSpec("spare", gpus=1, role="spare")
    ]
    with run_agents(deciding.address, short_dir, specs):
        missing = {s.node_id for s in specs}
        while missing:
            missing.discard(wait_for(events, lambda e: e.kind == "node.registered").node_id)
        nodes_pb2_grpc.NodeServiceStub(deciding.channel()).InjectFault(
            nodes_pb2.InjectFaultRequest(
                node_id="w2",
                fault=common_pb2.Fault(
                    host=common_pb2.HostFault(
                        link_degraded=common_pb2.PortRate(port="mlx5_0/1", rate_gbps=200)
                    )
                ),
            )
        )
        reported = wait_for(events, lambda e: e.kind == "node.degraded" and e.node_id == "w2")
        assert SLOWER.removeprefix("w2's host: ") in reported.reason, reported
        # Fake ranks report their step times without taking them: the link is slow first.
        steps = ["--attach", "--step-seconds", "0.05", "--noise", "0.05", "--steps", "200"]
        spec = jobs_pb2.JobSpec(
            name=unique("slowlink"),
            command=[sys.executable, str(FAKE_RANK), *steps, "--hold"],
            dp=4,
            gpus_per_node=1,
            spares=1,
            straggler=jobs_pb2.StragglerPolicy(action=jobs_pb2.STRAGGLER_ACTION_SWAP),
        )
        jobs = jobs_pb2_grpc.JobServiceStub(deciding.channel())
        job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
        job_event(events, job.id, "job.running")
        placed = jobs.Get(jobs_pb2.GetJobRequest(job_id=job.id))
        (slow_rank,) = [r.rank for r in placed.rank_map.ranks if r.node_id == "w2"]
        flagged = job_event(events, job.id, "job.straggler")
        assert flagged.attributes["rank"] == str(slow_rank), flagged
        assert flagged.node_id == "w2", flagged
        assert 1.7 < float(flagged.attributes["slowdown"]) < 2.3, flagged  # 400 / 200
        assert SLOWER in flagged.reason, flagged
        job_event(events, job.id, "job.recovered")  # swapped out to the spare
        moved = jobs.Get(jobs_pb2.GetJobRequest(job_id=job.id))
        assert "w2" not in {r.node_id for r in moved.rank_map.ranks}, moved.rank_map
        (incident,) = moved.goodput.incidents
        assert incident.cause.startswith("w2 swapped out ("), incident
        assert SLOWER in incident.cause, incident
        jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id, reason="test over"))
