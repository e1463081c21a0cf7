"""What the scheduler holding a node's stream stops of the processes the node reports:
everything of an ended job, and ranks a running job left behind on a node no longer in
its rank map; never ranks of a job still recovering, nor of a node still in the map."""

from __future__ import annotations

from typing import Any

import pytest

from kit.schedulers import SchedulerThread
from kit.stores import StoreUrls, unique
from pitstop.scheduler.api.agent_writes import JobGenerations
from pitstop.scheduler.db.engine import create_engine_for, session_factory
from pitstop.scheduler.services.jobs import stale_processes
from pitstop.scheduler.store import Store
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc


def job_at(scheduler: SchedulerThread, db: Any, state: str, here: str, gone: str) -> str:
    """A job in `state` at generation 2, ranks 0 on `here` and 1 elsewhere; generation 1
    had rank 1 on `gone`."""
    jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
    spec = jobs_pb2.JobSpec(name=unique("stale"), command=["x"], dp=2, gpus_per_node=1)
    job_id = str(jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job.id)
    db.execute("UPDATE jobs SET state = %s, generation = 2 WHERE id = %s", (state, job_id))
    # Rank 0 stays on `here` from generation 1 on; rank 1 moves from `gone` to "other".
    for since, until, rank, node in ((1, None, 0, here), (1, 2, 1, gone), (2, None, 1, "other")):
        db.execute(
            "INSERT INTO rank_assignments (job_id, since_generation, until_generation, rank,"
            " node_id, gpu_index, local_rank, dp, pp, tp)"
            " VALUES (%s, %s, %s, %s, %s, 0, 0, %s, 0, 0)",
            (job_id, since, until, rank, node, rank),
        )
    return job_id


@pytest.mark.parametrize(
    ("state", "node", "expected"),
    [
        ("running", "gone", {"J": [1]}),  # left behind: stopped
        ("paused", "gone", {"J": [1]}),
        ("recovering", "gone", {}),  # about to leave on its own
        ("running", "here", {}),  # still placed here: may not have reported gen 2 yet
        ("succeeded", "here", {"J": []}),  # ended: everything of it
        ("pending", "here", {"J": None}),  # preempted: everything of it, at a step boundary
    ],
)
async def test_stale_processes(
    scheduler: SchedulerThread, stores: StoreUrls, db: Any, state: str, node: str, expected: Any
) -> None:
    here, gone = unique("here"), unique("gone")
    scheduler.register_node(here)
    scheduler.register_node(gone)
    if db.execute("SELECT 1 FROM nodes WHERE id = 'other'").fetchone() is None:
        scheduler.register_node("other")
    job_id = job_at(scheduler, db, state, here, gone)
    reporting = here if node == "here" else gone
    rank = 0 if node == "here" else 1
    running = [(job_id, 1, rank, False), (job_id, 1, 7, True)]
    engine = create_engine_for(stores.database_url, 1)
    try:
        async with session_factory(engine)() as session:
            found = await stale_processes(session, reporting, running)
        # The cheap check every heartbeat goes through first (one read a second for all
        # the streams): it may send a report on to the full check needlessly, never
        # keep one that the full check would stop.
        cheap = JobGenerations(Store(session_factory(engine), scheduler.scheduler.bus))
        nothing = await cheap.nothing_to_stop(running)
    finally:
        await engine.dispose()
    assert found == {job_id if k == "J" else k: v for k, v in expected.items()}
    assert not (nothing and found)
    # A job still recovering has every node report its old generation until its
    # command arrives: none of those reports may cost a full check.
    assert nothing == (state == "recovering")
