"""The fault matrix, priorities: a higher-priority job preempts a preemptible one, which
resumes losing no step, or, allowed to shrink, gives up replicas instead."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kit.faultcluster import (
    EXAMPLE,
    SPARE,
    STEP_LINE,
    STEPS,
    Cluster,
    check_result,
    finish_all,
    reference_hash,
    restored_steps,
    wait_until,
)
from kit.forking import ForkClient
from kit.stores import unique
from pitstop.client.cli import app
from pitstop.v1 import common_pb2, jobs_pb2, nodes_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


def steps_run(cluster: Cluster, job: jobs_pb2.Job, rank: int) -> list[int]:
    """Every step `rank` printed, over every node and process that ran it, sorted: a
    step run twice (restored from before it) appears twice."""
    steps: list[int] = []
    for node in cluster.nodes.values():
        path = node.rank_log(job.id, rank)
        if path.exists():
            steps += [
                int(m.group(2)) for m in map(STEP_LINE.match, path.read_bytes().splitlines()) if m
            ]
    return sorted(steps)


HIGH_STEPS = 20
"""The preempting job's steps (unpaced)."""


def submit_preemptible(cluster: Cluster, *, min_dp: int = 4) -> jobs_pb2.Job:
    """The example on all four workers, paced, preemptible at once; returns once it
    runs."""
    return cluster.submit_spec(
        jobs_pb2.JobSpec(
            name=unique("low"),
            command=[*EXAMPLE, "--log-every", "1", "--step-seconds", "0.1"],
            dp=4,
            min_dp=min_dp,
            gpus_per_node=1,
            preemptible=True,
            min_run_seconds=0,
            env={"PYTHONUNBUFFERED": "1"},
        )
    )


def submit_urgent(cluster: Cluster) -> jobs_pb2.Job:
    """A dp-2 example of priority 10, submitted (not awaited)."""
    spec = jobs_pb2.JobSpec(
        name=unique("high"),
        command=[*EXAMPLE, "--log-every", "1", "--steps", str(HIGH_STEPS)],
        dp=2,
        gpus_per_node=1,
        priority=10,
        env={"PYTHONUNBUFFERED": "1"},
    )
    return cluster.jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job


def test_a_higher_priority_job_preempts_a_preemptible_one_which_resumes_losing_no_step(
    cluster: Cluster, standalone_hash: str, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A preemptible job on every worker loses one to a node failure first: the spare
    takes its place and its role (the failed node is the spare from then on), so the
    worker pool keeps four. A job of higher priority arrives and runs within 10 s of its
    submit. The preempted job stops at a step boundary with its snapshot sealed, waits
    in the queue with its reason and position, resumes by itself once the other
    finished, and ends with its own fault-free hash, every step run exactly once."""
    low = submit_preemptible(cluster)
    lost = cluster.node_of(low, 3).node_id
    cluster.wait_for_step(low, 3, 3)
    cluster.kill_node(lost)
    cluster.job_event(low.id, "job.recovered")
    roles = {n.id: n.role for n in cluster.node_api.List(nodes_pb2.ListNodesRequest()).nodes}
    assert roles[SPARE] == common_pb2.NODE_ROLE_WORKER, roles
    assert roles[lost] == common_pb2.NODE_ROLE_SPARE, roles
    low = cluster.get(low.id)
    cluster.wait_for_step(low, 0, 8)
    submitted = time.monotonic()
    high = submit_urgent(cluster)
    preempted = cluster.job_event(low.id, "job.preempted")
    assert preempted.attributes["by"] == high.id, preempted
    assert preempted.to_state == "pending", preempted
    running = cluster.job_event(high.id, "job.running", "job.failed")
    waited = time.monotonic() - submitted
    assert running.kind == "job.running", (running, cluster.logs(high.id))
    assert waited <= 10.0, f"the high-priority job ran {waited:.1f} s after its submit"
    print(f"the high-priority job ran {waited:.2f} s after its submit")  # for -s runs
    # While it runs, the preempted job waits first in the queue, and says why.
    wait_until(
        lambda: cluster.get(low.id).reason.startswith("capacity:"), "the queue says why it waits"
    )
    queued = cluster.get(low.id)
    assert queued.state == common_pb2.JOB_STATE_PENDING
    assert queued.queue_position == 1
    assert queued.preemptions == 1
    listed = CliRunner().invoke(app, [*cluster.cli_options(), "job", "list"])
    assert listed.exit_code == 0, listed.output
    assert "queue (pending jobs" in listed.output, listed.output
    assert low.id in listed.output, listed.output
    done = cluster.finish(high.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, HIGH_STEPS)
    resumed = cluster.job_event(low.id, "job.resuming")
    stopped_at = int(resumed.attributes["step"])
    assert stopped_at >= 5, resumed
    finished = cluster.finish(low.id)
    check_result(finished, standalone_hash)
    assert lost not in {a.node_id for a in finished.rank_map.ranks}
    for rank in range(4):
        assert set(steps_run(cluster, finished, rank)) == set(range(1, STEPS + 1)), rank
    assert stopped_at in restored_steps(cluster, finished)
    # The preemption gave up no step: the resume restored the step the job stopped at,
    # and no rank ran any step after it twice.
    for rank in range(4):
        after = [s for s in steps_run(cluster, finished, rank) if s > stopped_at]
        assert after == list(range(stopped_at + 1, STEPS + 1)), (rank, after)


def test_a_job_that_may_shrink_gives_up_replicas_rather_than_stopping(
    cluster: Cluster, standalone_hash: str, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A preemptible job with min_dp 2 on all four workers: a higher-priority dp-2 job
    takes two replicas' nodes while the first runs on at dp 2, and both end with their
    own fault-free hashes (the example splits its global batch into the same shards at
    any world size)."""
    low = submit_preemptible(cluster, min_dp=2)
    cluster.wait_for_step(low, 0, 5)
    submitted = time.monotonic()
    high = submit_urgent(cluster)
    shrunk = cluster.job_event(low.id, "job.shrunk", "job.preempted")
    assert shrunk.kind == "job.shrunk", shrunk
    assert shrunk.attributes["by"] == high.id, shrunk
    assert shrunk.attributes["dp"] == "2", shrunk
    running = cluster.job_event(high.id, "job.running", "job.failed")
    assert running.kind == "job.running", (running, cluster.logs(high.id))
    waited = time.monotonic() - submitted
    assert waited <= 10.0, f"the high-priority job ran {waited:.1f} s after its submit"
    done, finished = finish_all(cluster, [high.id, low.id])
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, HIGH_STEPS)
    check_result(finished, standalone_hash)
    assert finished.rank_map.world_size == 2
    assert finished.preemptions == 0
