"""A rank's exit reported on a stream that broke before the scheduler recorded it (its
PostgreSQL restarting, say) is not lost: the agent's next Register reports it again,
and the scheduler records each exit once."""

from __future__ import annotations

from pathlib import Path

import psycopg

from kit.events import follow_events
from kit.schedulers import hand_driven_leader
from kit.stores import StoreUrls, unique
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2, jobs_pb2_grpc


def test_an_exit_never_recorded_is_recorded_from_the_next_register_and_only_once(
    stores: StoreUrls, tmp_path: Path
) -> None:
    database = stores.fresh_database()
    thread = hand_driven_leader(stores, tmp_path, database=database)
    try:
        first = thread.open_stream("w0", gpus=1, rack="r0")
        jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
        spec = jobs_pb2.JobSpec(name=unique("lost"), command=["train"], dp=1, gpus_per_node=1)
        job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
        started = first.acked_start()
        events = follow_events(thread.address, timeout=60)
        try:
            # The rank finished, but its exit went out on a stream that then broke: the
            # scheduler never recorded it. The agent registers again, reporting it.
            exited = agent_pb2.RankExited(
                job_id=job.id,
                generation=started.generation,
                rank=0,
                exit_code=0,
                result={"final_weights_sha256": "ab" * 32},
            )
            first.close()
            again = thread.open_stream("w0", gpus=1, rack="r0", recent_exits=[exited])
            kinds = []
            for event in events:
                if event.job_id == job.id:
                    kinds.append(event.kind)
                if event.kind in ("job.succeeded", "job.failed"):
                    break
            assert kinds[-1] == "job.succeeded", kinds
            assert kinds.count("rank.exited") == 1, kinds
            # The same exit in a later Register (its stream broke again): still one.
            again.close()
            thread.open_stream("w0", gpus=1, rack="r0", recent_exits=[exited])
            with psycopg.connect(database) as db:
                count = db.execute(
                    "SELECT count(*) FROM events WHERE kind = 'rank.exited' AND job_id = %s",
                    (job.id,),
                ).fetchone()
            assert count == (1,)
            shown = jobs.Get(jobs_pb2.GetJobRequest(job_id=job.id))
            assert shown.state == common_pb2.JOB_STATE_SUCCEEDED
            assert shown.result["final_weights_sha256"] == "ab" * 32
        finally:
            events.close()
    finally:
        thread.stop()
