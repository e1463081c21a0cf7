"""Two scheduler processes on one PostgreSQL: one decides at a time; kill -9 of the
leader hands over within two lease periods; no GPU is ever booked twice."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest

from kit.agents import AgentSpec, run_agents
from kit.dirs import short_tempdir
from kit.events import follow_events, wait_for
from kit.ranks import FAKE_RANK
from kit.schedulers import SchedulerProcess
from kit.stores import StoreUrls, unique
from pitstop.client.launch import clean_env
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc

LEASE = 1.0


@pytest.fixture
def root() -> Iterator[Path]:
    with short_tempdir("pld-") as path:
        yield path


def holding_job(address: str, name: str) -> jobs_pb2.Job:
    jobs = jobs_pb2_grpc.JobServiceStub(grpc.insecure_channel(address))
    spec = jobs_pb2.JobSpec(
        name=name,
        dp=2,
        gpus_per_node=1,
        command=[sys.executable, str(FAKE_RANK), "--attach", "--steps", "2", "--hold"],
    )
    return jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job


def test_one_leader_decides_and_a_standby_takes_over_without_double_booking(
    stores: StoreUrls, root: Path
) -> None:
    database = stores.fresh_database()
    env = clean_env() | {
        "PITSTOP_DATABASE_URL": database,
        "PITSTOP_REDIS_URL": stores.redis_url,
        "PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('leader')}:",
        "PITSTOP_LEADER_LEASE_SECONDS": str(LEASE),
        "PITSTOP_HEARTBEAT_INTERVAL_SECONDS": "0.5",
        "GRPC_VERBOSITY": "ERROR",
    }
    first = SchedulerProcess(root, "first", env)
    second: SchedulerProcess | None = None
    try:
        events = follow_events(first.address)
        took = wait_for(events, lambda e: e.kind == "scheduler.leader")
        second = SchedulerProcess(root, "second", env)
        assert first.leading()
        assert not second.leading()

        # The agents talk to the standby: the leader's commands reach them through Redis.
        specs = [AgentSpec(f"ld{i}", gpus=2, rack=f"r{i}") for i in range(2)]
        with run_agents(second.address, root, specs):
            watch = follow_events(second.address, after=took.id)
            waiting = {spec.node_id for spec in specs}
            while waiting:
                waiting.discard(wait_for(watch, lambda e: e.kind == "node.registered").node_id)
            before = holding_job(second.address, unique("before"))
            wait_for(watch, lambda e: (e.job_id, e.kind) == (before.id, "job.running"))

            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
            handover = wait_for(watch, lambda e: e.kind == "scheduler.leader")
            # About one lease period after the kill (expiry, then the standby's next
            # campaign); the watch's deadline only guards a hang.
            assert second.leading()
            assert handover.attributes["token"] == str(int(took.attributes["token"]) + 1)

            after = holding_job(second.address, unique("after"))
            wait_for(watch, lambda e: (e.job_id, e.kind) == (after.id, "job.running"))

        with psycopg.connect(database) as conn:
            rows = conn.execute(
                "SELECT r.job_id, r.since_generation, r.node_id, r.gpu_index"
                " FROM rank_assignments r"
            ).fetchall()
        placed = {(job, node, gpu) for job, _gen, node, gpu in rows}
        assert {job for job, _n, _g in placed} == {before.id, after.id}
        assert {gen for _j, gen, _n, _g in rows} == {1}  # each gang placed exactly once
        gpus = [(node, gpu) for _job, node, gpu in placed]
        assert len(gpus) == len(set(gpus)) == 4  # no GPU holds two ranks
    finally:
        with contextlib.suppress(Exception):
            first.stop()
        if second is not None:
            second.stop()
