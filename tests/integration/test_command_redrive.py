"""The leader's commands are desired state in PostgreSQL, re-sent until acknowledged:
agents driven by hand here never ack at first, or a leader stops between decision and
commands, and the next tick (or the next leader) sends them again."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from kit.events import follow_events, wait_for
from kit.schedulers import SchedulerThread, hand_driven_leader
from kit.stores import StoreUrls, unique
from kit.streams import AgentStream
from pitstop.scheduler.services.node_commands import RESEND_SECONDS
from pitstop.v1 import agent_pb2, jobs_pb2, jobs_pb2_grpc


@pytest.fixture
def database(stores: StoreUrls) -> str:
    return stores.fresh_database()


def leader(stores: StoreUrls, tmp_path: Path, database: str, prefix: str) -> SchedulerThread:
    return hand_driven_leader(stores, tmp_path, database=database, prefix=prefix)


@pytest.fixture
def prefix(stores: StoreUrls) -> str:
    return f"{stores.redis_prefix}{unique('redrive')}:"


def submit(thread: SchedulerThread) -> jobs_pb2.Job:
    jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
    spec = jobs_pb2.JobSpec(name=unique("redrive"), command=["train"], dp=2, gpus_per_node=1)
    return jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job


def next_start(stream: AgentStream, job_id: str) -> tuple[float, agent_pb2.SchedulerMessage]:
    """The next StartRanks of `job_id` down the stream, and when it came."""
    while True:
        message = stream.next_command(timeout=30)
        if message.WhichOneof("body") == "start_ranks" and message.start_ranks.job_id == job_id:
            return time.monotonic(), message


def ack(stream: AgentStream, message: agent_pb2.SchedulerMessage) -> None:
    stream.send(ack=agent_pb2.CommandAck(command_id=message.command_id, ok=True))


def node_commands(database: str, job_id: str) -> dict[str, tuple[int, int, int]]:
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT node_id, generation, acked_generation, sends FROM node_commands "
            "WHERE job_id = %s",
            (job_id,),
        ).fetchall()
    return {node: (gen, acked, sends) for node, gen, acked, sends in rows}


def test_an_unacknowledged_start_is_sent_again_until_acknowledged(
    stores: StoreUrls, tmp_path: Path, database: str, prefix: str
) -> None:
    thread = leader(stores, tmp_path, database, prefix)
    try:
        events = follow_events(thread.address)
        with thread.agent_stream("ra", rack="r1") as a, thread.agent_stream("rb", rack="r2") as b:
            job = submit(thread)
            wait_for(events, lambda e: e.job_id == job.id and e.kind == "job.starting")
            first_a, start_a = next_start(a, job.id)
            _, start_b = next_start(b, job.id)
            ack(b, start_b)
            # Node a never acknowledged: the same generation's StartRanks comes again,
            # no sooner than the re-send interval (and under a new command id).
            again_at, again = next_start(a, job.id)
            assert again.start_ranks == start_a.start_ranks
            assert again.command_id != start_a.command_id
            assert again_at - first_a >= RESEND_SECONDS * 0.9
            ack(a, again)

            def settled() -> bool:
                rows = node_commands(database, job.id)
                return all(acked == gen for gen, acked, _ in rows.values())

            deadline = time.monotonic() + 30
            while not settled():
                assert time.monotonic() < deadline, node_commands(database, job.id)
                time.sleep(0.05)
            rows = node_commands(database, job.id)
            assert rows["rb"][2] == 1, rows  # acknowledged at once: sent once
            assert rows["ra"][2] >= 2, rows
    finally:
        thread.stop()


def test_a_new_leader_sends_the_commands_the_old_one_decided(
    stores: StoreUrls, tmp_path: Path, database: str, prefix: str
) -> None:
    """The first leader decides the start and stops before any agent acknowledged it;
    a new scheduler process on the same database finds the decision and sends it."""
    first = leader(stores, tmp_path, database, prefix)
    try:
        events = follow_events(first.address)
        a, b = first.open_stream("na", rack="r1"), first.open_stream("nb", rack="r2")
        job = submit(first)
        wait_for(events, lambda e: e.job_id == job.id and e.kind == "job.starting")
        next_start(a, job.id)
        next_start(b, job.id)
    finally:
        first.stop()  # the streams close with it: a scheduler's own shutdown loses no node
    second = leader(stores, tmp_path, database, prefix)
    try:
        with second.agent_stream("na", rack="r1") as a, second.agent_stream("nb", rack="r2") as b:
            _, start_a = next_start(a, job.id)
            _, start_b = next_start(b, job.id)
            assert start_a.start_ranks.generation == start_b.start_ranks.generation == 1
            # The deadline the first leader stored is the one in force.
            with psycopg.connect(database, autocommit=True) as conn:
                (deadline,) = conn.execute(
                    "SELECT deadline > now() FROM jobs WHERE id = %s", (job.id,)
                ).fetchone() or (None,)
            assert deadline is True
    finally:
        second.stop()


def test_an_ack_for_a_command_the_node_no_longer_has_acknowledges_nothing(
    stores: StoreUrls, tmp_path: Path, database: str, prefix: str
) -> None:
    """A node told to reconfigure is switched to start afresh (its rank died); the late
    ack of the reconfigure must not count as the start's."""
    thread = leader(stores, tmp_path, database, prefix)
    try:
        events = follow_events(thread.address)
        with thread.agent_stream("ka", rack="r1") as a, thread.agent_stream("kb", rack="r2") as b:
            job = submit(thread)
            wait_for(events, lambda e: e.job_id == job.id and e.kind == "job.starting")
            next_start(a, job.id)
            next_start(b, job.id)
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute(
                    "UPDATE node_commands SET action = 'reconfigure' WHERE job_id = %s", (job.id,)
                )
            # A reconfigure now goes out; switch node ka back to start before acking it.
            while True:
                message = a.next_command(timeout=30)
                if message.WhichOneof("body") == "reconfigure":
                    break
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute(
                    "UPDATE node_commands SET action = 'start', sent_at = NULL "
                    "WHERE job_id = %s AND node_id = 'ka'",
                    (job.id,),
                )
            ack(a, message)
            _, start = next_start(a, job.id)  # still due: the ack was the reconfigure's
            assert start.start_ranks.generation == 1
            assert node_commands(database, job.id)["ka"][1] == 0
    finally:
        thread.stop()


def next_generation(stream: AgentStream, job_id: str) -> agent_pb2.SchedulerMessage:
    """The next command of `job_id` that moves the node's ranks to a generation."""
    while True:
        message = stream.next_command(timeout=30)
        kind = message.WhichOneof("body") or ""
        moves = kind in ("reconfigure", "reconfigure_kept", "start_ranks")
        if moves and getattr(message, kind).job_id == job_id:
            return message


def test_survivors_get_one_shared_reconfigure_and_a_resend_names_their_ranks(
    stores: StoreUrls, tmp_path: Path, database: str, prefix: str
) -> None:
    """A recovery's survivors keep their ranks: each gets the same reconfigure_kept (no
    ranks, the new generation's digest), the spare its own start; a survivor that does
    not ack gets its full Reconfigure, with its ranks, when the command goes again (its
    agent may not know the kept kind)."""
    thread = leader(stores, tmp_path, database, prefix)
    try:
        events = follow_events(thread.address)
        a = thread.open_stream("ka", gpus=1, rack="r1")
        b = thread.open_stream("kb", gpus=1, rack="r2")
        c = thread.open_stream("kc", gpus=1, rack="r3")
        spare = thread.open_stream("ks", gpus=1, rack="r4", role="spare")
        jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
        spec = jobs_pb2.JobSpec(name=unique("kept"), command=["train"], dp=3, gpus_per_node=1)
        job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
        for stream in (a, b, c):
            _, start = next_start(stream, job.id)
            ack(stream, start)
        for stream in (a, b, c):  # the ranks step: the job runs (a start is not under way)
            summary = agent_pb2.StepSummary(
                job_id=job.id, generation=1, ranks=1, slowest_step=1, newest_step=1
            )
            stream.send(step_summary=summary)
        wait_for(events, lambda e: e.job_id == job.id and e.kind == "job.running")
        c.close()  # its agent is gone (no host address: asked for a second)
        wait_for(events, lambda e: e.job_id == job.id and e.kind == "job.recovering")
        got_a, got_b = next_generation(a, job.id), next_generation(b, job.id)
        assert got_a.WhichOneof("body") == got_b.WhichOneof("body") == "reconfigure_kept"
        assert got_a.reconfigure_kept == got_b.reconfigure_kept
        assert got_a.reconfigure_kept.generation == 2
        assert not got_a.reconfigure_kept.rank_map.ranks
        assert got_a.reconfigure_kept.rank_map.digest
        assert next_generation(spare, job.id).WhichOneof("body") == "start_ranks"
        ack(b, got_b)
        again = next_generation(a, job.id)  # a never acked: its own, with its ranks
        assert again.WhichOneof("body") == "reconfigure"
        assert [r.node_id for r in again.reconfigure.rank_map.ranks] == ["ka"]
        assert again.reconfigure.rank_map.digest == got_a.reconfigure_kept.rank_map.digest
    finally:
        thread.stop()
