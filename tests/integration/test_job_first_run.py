"""`job.running` says a job trains for the first time, whatever happened before: a job
whose rank failed before its first step restarts, and its first step after that is
`job.running`, not `job.recovered` (a script waiting for `job.running` would wait
through it). A real scheduler with its deciding loops, a hand-driven agent stream."""

from __future__ import annotations

from pathlib import Path

from kit.events import follow_events
from kit.schedulers import hand_driven_leader
from kit.stores import StoreUrls, unique
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2, jobs_pb2_grpc


def test_a_job_restarted_before_its_first_step_says_job_running_when_it_trains(
    stores: StoreUrls, tmp_path: Path
) -> None:
    thread = hand_driven_leader(stores, tmp_path)
    try:
        worker = thread.open_stream("w0", gpus=1, rack="r0")
        jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
        spec = jobs_pb2.JobSpec(name=unique("first"), command=["train"], dp=1, gpus_per_node=1)
        job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
        events = follow_events(thread.address, timeout=60)
        try:
            first = worker.acked_start()
            worker.send(
                rank_exited=agent_pb2.RankExited(
                    job_id=job.id, generation=first.generation, rank=0, exit_code=1
                )
            )
            again = worker.acked_start()
            assert again.generation > first.generation
            worker.send(
                step_summary=agent_pb2.StepSummary(
                    job_id=job.id,
                    generation=again.generation,
                    ranks=1,
                    slowest_step=1,
                    newest_step=1,
                    samples=1,
                )
            )
            kinds = []
            for event in events:
                if event.job_id == job.id:
                    kinds.append(event.kind)
                if event.kind in ("job.running", "job.recovered"):
                    break
            assert kinds[-1] == "job.running", kinds
            assert "job.restarting" in kinds, kinds
            shown = jobs.Get(jobs_pb2.GetJobRequest(job_id=job.id))
            assert shown.state == common_pb2.JOB_STATE_RUNNING
        finally:
            events.close()
    finally:
        thread.stop()
