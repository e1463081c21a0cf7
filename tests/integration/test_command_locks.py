"""Writers of a job's node commands take their rows in one order, so they never deadlock.

A decision writes the job's whole plan while ingest processes record acknowledgements
in batches; at 1,000 nodes an ack batch and a plan write deadlocked (PostgreSQL aborts
one of them after a second). Here the interleaving that deadlocked is forced: the plan
write waits for node a's row, an ack batch that names node b before node a starts
behind it, and then node a's row is let go."""

from __future__ import annotations

import asyncio

import psycopg

from kit.stores import unique
from pitstop.scheduler.db import models
from pitstop.scheduler.db.engine import session_factory
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.services import node_commands as plan
from pitstop.scheduler.services.node_commands import NodeAction

WAIT_SECONDS = 30.0


async def waiting_on_locks(url: str, count: int) -> None:
    """Until `count` backends of the database wait on a row lock."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
        while True:
            cursor = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            row = await cursor.fetchone()
            if row is not None and row[0] >= count:
                return
            assert asyncio.get_running_loop().time() < deadline, f"{row} of {count} waiting"
            await asyncio.sleep(0.01)


async def test_an_ack_batch_beside_a_plan_write_never_deadlocks(
    migrated_database: tuple[str, session_factory],
) -> None:
    url, sessions = migrated_database
    job_id = unique("job")[:32]
    async with sessions() as session, session.begin():
        job = models.Job(id=job_id, name="locks", spec={}, state=JobState.RECOVERING, generation=2)
        session.add(job)
        await session.flush()
        await plan.replace_plan(
            session, job, {"node-a": NodeAction.START, "node-b": NodeAction.RECONFIGURE}
        )

    async def write_plan() -> None:
        async with sessions() as session, session.begin():
            job = await session.get(models.Job, job_id)
            assert job is not None
            job.generation = 3
            await plan.replace_plan(
                session, job, {"node-a": NodeAction.RECONFIGURE, "node-b": NodeAction.RECONFIGURE}
            )

    async def acknowledge() -> None:
        async with sessions() as session, session.begin():
            # b's group first: the order the batch's groups come in, not the nodes'.
            await plan.acknowledge_batch(
                session,
                {
                    (job_id, 2, (NodeAction.RECONFIGURE, NodeAction.LEAVE)): {"node-b"},
                    (job_id, 2, (NodeAction.START,)): {"node-a"},
                },
            )

    async with await psycopg.AsyncConnection.connect(url) as gate:
        await gate.execute(
            "SELECT 1 FROM node_commands WHERE job_id = %s AND node_id = 'node-a' FOR UPDATE",
            (job_id,),
        )
        writing = asyncio.create_task(write_plan())
        await waiting_on_locks(url, 1)  # the plan write waits for node a
        acking = asyncio.create_task(acknowledge())
        await waiting_on_locks(url, 2)  # the batch waits too (holding b, before the fix)
        await gate.commit()
        done = await asyncio.gather(writing, acking, return_exceptions=True)
    assert [d for d in done if d is not None] == []

    with psycopg.connect(url) as db:
        rows = db.execute(
            "SELECT node_id, generation, action, acked_generation FROM node_commands"
            " WHERE job_id = %s ORDER BY node_id",
            (job_id,),
        ).fetchall()
    # The plan was written (the ack came after it, for the older generation: it counts
    # for nothing) and the new generation waits for both nodes' acknowledgements.
    assert rows == [("node-a", 3, "reconfigure", 0), ("node-b", 3, "reconfigure", 0)]
