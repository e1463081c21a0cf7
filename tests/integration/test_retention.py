"""What an ended job left behind goes after the retention (`ended_job_retention_seconds`):
in Redis its step stream, straggler windows and rank statistics, in PostgreSQL its
events, node commands and checkpoint rows (its whole durable checkpoints kept apart, as
its record lists them); a running job's stay, and keys of a job PostgreSQL does not
know go at once. A running job's superseded checkpoint rows go too, and events of no job
as old. What `pitstop job show` and `pitstop job record` print stays. A real scheduler
with its deciding loops, real Redis and PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import redis

from kit.schedulers import hand_driven_leader
from kit.stores import StoreUrls, unique
from kit.waits import wait_until
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2, jobs_pb2_grpc

RETENTION = 3.0


def test_an_ended_jobs_redis_keys_go_after_the_retention_and_a_running_jobs_stay(
    stores: StoreUrls, tmp_path: Path
) -> None:
    prefix = f"{stores.redis_prefix}{unique('retention')}:"
    database = stores.fresh_database()
    thread = hand_driven_leader(
        stores,
        tmp_path,
        database=database,
        prefix=prefix,
        ended_job_retention_seconds=RETENTION,
    )
    client = redis.Redis.from_url(stores.redis_url)
    try:
        jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
        streams, ids, generations = [], [], []
        for i in range(2):
            stream = thread.open_stream(f"w{i}", gpus=1, rack=f"r{i}")
            spec = jobs_pb2.JobSpec(name=unique("kept"), command=["train"], dp=1, gpus_per_node=1)
            job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
            command = stream.acked_start()
            assert command.job_id == job.id
            summary = agent_pb2.StepSummary(
                job_id=job.id,
                generation=command.generation,
                ranks=1,
                slowest_step=1,
                newest_step=1,
                samples=1,
            )
            stream.send(step_summary=summary)
            streams.append(stream)
            ids.append(job.id)
            generations.append(command.generation)
        ended, running = ids
        for job_id in ids:
            wait_until(lambda j=job_id: client.exists(f"{prefix}steps:{j}"), f"{job_id} steps kept")
        client.xadd(f"{prefix}steps:j-nobodyknows", {"summaries": b""})

        # The job about to end: a whole durable checkpoint at 20 (its one rank's shard in
        # the store, and in a node's memory), one flushed by none of its ranks at 30.
        with psycopg.connect(database) as db:
            for step in (20, 30):
                db.execute(
                    "INSERT INTO checkpoints (job_id, step, generation, committed, durable,"
                    " manifest_url) VALUES (%s, %s, %s, true, %s, '')",
                    (ended, step, generations[0], step == 20),
                )
            for step, node in [(20, ""), (20, "w0"), (30, "w0")]:
                db.execute(
                    "INSERT INTO checkpoint_shards (job_id, step, rank, node_id, tier, checksum,"
                    " size_bytes) VALUES (%s, %s, 0, %s, %s, 'c0', 7)",
                    (ended, step, node, "durable" if node == "" else "memory"),
                )
        kept = list(jobs.Record(jobs_pb2.JobRecordRequest(job_id=ended)).durable_checkpoints)
        assert [(d.step, d.shards, d.bytes) for d in kept] == [(20, 1, 7)]

        # The running job, weeks in: a checkpoint row a step, most long superseded.
        with psycopg.connect(database) as db:
            db.execute("UPDATE jobs SET committed_step = 10 WHERE id = %s", (running,))
            for step, durable in [(3, False), (4, True), (5, False), (10, False), (12, False)]:
                db.execute(  # 12: snapshotted, not committed yet
                    "INSERT INTO checkpoints (job_id, step, generation, committed, durable,"
                    " manifest_url, created_at) VALUES (%s, %s, 1, %s, %s, '',"
                    " now() - interval '1 hour')",
                    (running, step, step <= 10, durable),
                )
            db.execute(
                "INSERT INTO checkpoint_shards (job_id, step, rank, node_id, tier, checksum,"
                " size_bytes) VALUES (%s, 5, 0, 'w1', 'memory', 'x', 1)",
                (running,),
            )
            # A node's event of long ago (no job): it goes too.
            db.execute(
                "INSERT INTO events (time, kind, node_id, from_state, to_state, reason, actor,"
                " attributes) VALUES (now() - interval '1 hour', 'node.lost', 'w9', '', '',"
                " 'retention test', 'test', '{}')"
            )

        cancelled_at = time.monotonic()  # the job ends after this, however slow the call
        jobs.Cancel(jobs_pb2.JobControlRequest(job_id=ended))
        shown = jobs.Get(jobs_pb2.GetJobRequest(job_id=ended))
        assert shown.state == common_pb2.JOB_STATE_CANCELLED

        wait_until(
            lambda: not client.exists(f"{prefix}steps:j-nobodyknows"),
            "the unknown job's stream deleted",
            timeout=30,
        )
        wait_until(
            lambda: not client.exists(f"{prefix}steps:{ended}"),
            "the ended job's stream deleted",
            timeout=30,
        )
        assert time.monotonic() - cancelled_at >= RETENTION - 0.05  # not before its time
        assert client.exists(f"{prefix}steps:{running}")

        def rows(table: str, job_id: str) -> int:
            with psycopg.connect(database) as db:
                found = db.execute(f"SELECT count(*) FROM {table} WHERE job_id = %s", (job_id,))
                return int(found.fetchone()[0])  # type: ignore[index]

        # The rows went in the same sweep as the keys, or one sweep before.
        wait_until(lambda: rows("events", ended) == 0, "the ended job's events deleted", 10)
        assert rows("node_commands", ended) == 0
        # Its checkpoint rows went with them, the whole durable checkpoint kept apart.
        assert rows("checkpoint_shards", ended) == 0
        assert rows("checkpoints", ended) == 0
        assert rows("kept_checkpoints", ended) == 1

        def steps(job_id: str) -> list[int]:
            with psycopg.connect(database) as db:
                found = db.execute(
                    "SELECT step FROM checkpoints WHERE job_id = %s ORDER BY step", (job_id,)
                )
                return [int(row[0]) for row in found]

        # Superseded: below the committed step, on no node, not durable. The rest stays.
        wait_until(lambda: 3 not in steps(running), "the superseded checkpoint deleted", 10)
        assert steps(running) == [4, 5, 10, 12]
        with psycopg.connect(database) as db:
            found = db.execute("SELECT count(*) FROM events WHERE node_id = 'w9'").fetchone()
            assert found == (0,)
        assert rows("events", running) > 0
        assert rows("node_commands", running) > 0
        shown = jobs.Get(jobs_pb2.GetJobRequest(job_id=ended))  # the job stays
        assert shown.state == common_pb2.JOB_STATE_CANCELLED
        record = jobs.Record(jobs_pb2.JobRecordRequest(job_id=ended))
        assert record.state == common_pb2.JOB_STATE_CANCELLED
        assert list(record.durable_checkpoints) == kept
    finally:
        thread.stop()
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
