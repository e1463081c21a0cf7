"""A generation's rank map is written as a delta on the one before: a recovery writes the
failed node's ranks and bookings, not the job's (100,000 rows at full scale), and every
generation still reads back whole: the current one, a past one (a checkpoint's world
size), and after the schema goes back to one row per rank and generation and forth."""

from __future__ import annotations

import asyncio

import psycopg
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from kit.stores import unique
from pitstop.scheduler.db import models
from pitstop.scheduler.db.engine import (
    MIGRATIONS_DIR,
    psycopg_url,
    session_factory,
)
from pitstop.scheduler.domain import JobState, NodeState
from pitstop.scheduler.reconcile.context import RankMaps
from pitstop.scheduler.services import catalog, lifecycle
from pitstop.scheduler.topology import Placement, RankSlot

NODES = 4
PER_NODE = 2


def spread(nodes: list[str]) -> Placement:
    """Two ranks a node, data parallel."""
    return Placement(
        tuple(
            RankSlot(rank, nodes[rank // PER_NODE], rank % PER_NODE, rank % PER_NODE, rank, 0, 0)
            for rank in range(len(nodes) * PER_NODE)
        )
    )


async def job_on(
    session: AsyncSession, names: list[str], name: str, first: Placement
) -> models.Job:
    """Nodes `names` with PER_NODE GPUs each, and a job whose generation 1 is `first`."""
    for node_id in names:
        session.add(models.Node(id=node_id, state=NodeState.READY))
        for gpu in range(PER_NODE):
            session.add(models.Gpu(node_id=node_id, index=gpu, uuid=f"GPU-{node_id}-{gpu}"))
    job = models.Job(id=unique("job")[:32], name=name, spec={}, state=JobState.PENDING)
    session.add(job)
    await session.flush()
    await lifecycle.write_generation(session, job, first)
    return job


async def test_a_replacement_writes_the_moved_ranks_and_every_generation_reads_whole(
    migrated_database: tuple[str, session_factory],
) -> None:
    url, sessions = migrated_database
    names = [unique("n") for _ in range(NODES + 1)]
    workers, spare = names[:NODES], names[NODES]
    first = spread(workers)
    moved = spread([*workers[:2], spare, workers[3]])  # the third node's ranks move
    shrunk = spread([workers[0], spare])  # renumbered: everything moves
    async with sessions() as session, session.begin():
        job = await job_on(session, names, "delta", first)
        await lifecycle.write_generation(session, job, moved, first)
    with psycopg.connect(url) as db:
        written = db.execute(
            "SELECT since_generation, count(*) FROM rank_assignments WHERE job_id = %s"
            " GROUP BY since_generation ORDER BY since_generation",
            (job.id,),
        ).fetchall()
        closed = db.execute(
            "SELECT rank FROM rank_assignments WHERE job_id = %s AND until_generation = 2"
            " ORDER BY rank",
            (job.id,),
        ).fetchall()
    assert written == [(1, NODES * PER_NODE), (2, PER_NODE)]  # generation 2: two rows
    assert [rank for (rank,) in closed] == [4, 5]
    async with sessions() as session, session.begin():
        job = await session.get(models.Job, job.id)
        assert job is not None
        assert await lifecycle.rank_map(session, job) == moved
        assert await catalog.world_size(session, job, 1) == NODES * PER_NODE
        booked = await session.execute(
            select(models.GpuBooking.node_id, models.GpuBooking.gpu_index, models.GpuBooking.rank)
            .where(models.GpuBooking.job_id == job.id)
            .order_by(models.GpuBooking.rank)
        )
        assert booked.all() == [(s.node_id, s.gpu_index, s.rank) for s in moved.ranks]
        await lifecycle.write_generation(session, job, shrunk)  # read `before` itself
        assert await lifecycle.rank_map(session, job) == shrunk
        assert await catalog.world_size(session, job, 2) == NODES * PER_NODE
        assert await catalog.world_size(session, job, 3) == 2 * PER_NODE
        current = await session.scalar(
            select(func.count()).where(
                models.RankAssignment.job_id == job.id, models.RankAssignment.current()
            )
        )
        assert current == 2 * PER_NODE

    # Back to a row per rank and generation, and forth: every generation is the same.
    def maps() -> dict[int, list[tuple[int, str, int]]]:
        with psycopg.connect(url) as db:
            return {
                generation: db.execute(
                    "SELECT rank, node_id, gpu_index FROM rank_assignments WHERE job_id = %s"
                    " AND since_generation <= %s AND (until_generation IS NULL"
                    " OR until_generation > %s) ORDER BY rank",
                    (job.id, generation, generation),
                ).fetchall()
                for generation in (1, 2, 3)
            }

    def alembic(action: str, revision: str) -> None:
        engine = create_engine(psycopg_url(url))
        try:
            with engine.begin() as conn:
                config = Config()
                config.set_main_option("script_location", str(MIGRATIONS_DIR))
                config.attributes["connection"] = conn
                getattr(command, action)(config, revision)
        finally:
            engine.dispose()

    before = maps()
    await asyncio.to_thread(alembic, "downgrade", "0007")
    with psycopg.connect(url) as db:
        rows = db.execute(
            "SELECT generation, count(*) FROM rank_assignments WHERE job_id = %s"
            " GROUP BY generation ORDER BY generation",
            (job.id,),
        ).fetchall()
    assert rows == [(1, 8), (2, 8), (3, 4)]
    await asyncio.to_thread(alembic, "upgrade", "head")
    assert maps() == before


async def test_the_leader_keeps_the_map_it_writes_and_never_one_rolled_back(
    migrated_database: tuple[str, session_factory],
) -> None:
    """The fan-out after a recovery asks for the map the recovery just wrote: it is the
    one written, without reading the job's ranks back; a write rolled back leaves the
    job's committed map, and the same generation written again is the new map."""
    _, sessions = migrated_database
    names = [unique("n") for _ in range(NODES + 2)]
    first = spread(names[:NODES])
    moved = spread([*names[:2], names[NODES], names[3]])
    other = spread([*names[:2], names[NODES + 1], names[3]])
    engine = sessions.kw["bind"].sync_engine
    statements: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        statements.append(statement)

    maps = RankMaps()
    async with sessions() as session, session.begin():
        job_id = (await job_on(session, names, "kept", first)).id

    async def written(placement: Placement, *, commit: bool) -> None:
        async with sessions() as session:
            row = await session.get(models.Job, job_id)
            assert row is not None
            await maps.write(session, row, placement)
            await (session.commit() if commit else session.rollback())

    async def current() -> tuple[int, Placement, list[str]]:
        statements.clear()
        async with sessions() as session:
            row = await session.get(models.Job, job_id)
            assert row is not None
            found = await maps.of(session, row)
            return row.generation, found, [s for s in statements if "rank_assignments" in s]

    event.listen(engine, "before_cursor_execute", seen)
    try:
        await written(moved, commit=True)
        generation, found, reads = await current()
        assert (generation, found, reads) == (2, moved, [])
        await written(other, commit=False)
        generation, found, reads = await current()
        assert (generation, found, reads) == (2, moved, [])  # what was committed
        await written(other, commit=True)
        generation, found, _ = await current()
        assert (generation, found) == (3, other)
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    async with sessions() as session:
        row = await session.get(models.Job, job_id)
        assert row is not None
        assert await lifecycle.rank_map(session, row) == other  # the database agrees
