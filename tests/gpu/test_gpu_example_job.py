"""The example job on CUDA survives a kill -9 of its rank bitwise: a local cluster (a
scheduler, and for each of a worker and a spare a checkpoint daemon and an agent, as
`pitstop cluster up` starts them) runs `pitstop.trainer.example` with its rank on the
GPU; the rank is killed with SIGKILL mid-run, restarts from its in-memory snapshot and
the job ends `succeeded` with the final-weights hash of a fault-free run on the same GPU.
That run's hash differs from the CPU's, so the job did compute on the GPU.

One rank: every node of a local cluster hands its ranks GPU 0 (CUDA_VISIBLE_DEVICES=0),
and NCCL refuses two ranks of one group on one GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit.gpu import cuda, machine, needs_gpu, report
from pitstop.client.launch import clean_env
from pitstop.client.localcluster import LocalCluster, running_cluster
from pitstop.client.scenario import (
    Driver,
    Fault,
    JobStuck,
    ReferenceRun,
    example_command,
    example_spec,
)
from pitstop.v1 import common_pb2

# A hang guard far above the minute or two the run takes; the driver's own deadlines
# (no step for 90 s, the run's overall deadline) end a stuck job first, with its events.
pytestmark = [pytest.mark.gpu, needs_gpu, pytest.mark.timeout(420)]

STEPS = 60
STEP_SECONDS = 0.1  # paced, so that the kill lands mid-run
KILL_AT = 20


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A short path: the agents' Unix sockets live under it."""
    made = Path(tempfile.mkdtemp(prefix="pst-gpu-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def cpu_hash() -> str:
    """The fault-free run on the CPU (CUDA hidden)."""
    env = clean_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        example_command(STEPS, 0.0, "--log-every", "0"),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return str(json.loads(done.stdout.splitlines()[-1])["final_weights_sha256"])


def rank_logs(cluster: LocalCluster, job_id: str, chars: int = 3000) -> str:
    """The tail of every rank and standby log of the job, for a failure's message."""
    parts = []
    for path in sorted(cluster.state_dir.glob(f"nodes/*/agent/ranks/{job_id}/*.log")):
        text = path.read_text(errors="replace")[-chars:]
        parts.append(f"--- {path.relative_to(cluster.state_dir)}:\n{text}")
    return "\n".join(parts) or "(no rank logs)"


def test_the_example_on_cuda_ends_with_the_fault_free_hash_after_a_rank_kill(
    state_dir: Path,
) -> None:
    cuda()
    spec = example_spec("gpu-check", dp=1, steps=STEPS, step_seconds=STEP_SECONDS, spares=1)
    with (
        ReferenceRun(STEPS) as reference,
        running_cluster(state_dir, nodes=1, spares=1, port=0) as cluster,
        Driver(cluster) as driver,
    ):
        try:
            run = driver.run(spec, [Fault(KILL_AT, "rank_kill")])
        except JobStuck as stuck:
            pytest.fail(f"{stuck}\n{rank_logs(cluster, stuck.job.id)}")
        logs = rank_logs(cluster, run.job.id)
        expected = reference.final_hash()
    on_cpu = cpu_hash()
    job = run.job
    got = job.result.get("final_weights_sha256", "")
    numbers = {
        **machine(),
        "steps": STEPS,
        "state": common_pb2.JobState.Name(job.state),
        "generation": job.generation,
        "killed_at_step": [i.step for i in run.injected],
        "final_weights_sha256": got,
        "fault_free_cuda_sha256": expected,
        "fault_free_cpu_sha256": on_cpu,
        "run_seconds": round(run.seconds, 2),
        "incidents": [
            {
                "detect_s": round(i.detect_seconds, 3),
                "decide_s": round(i.decide_seconds, 3),
                "resume_s": round(i.resume_seconds, 3),
                "lost_steps": i.lost_steps,
            }
            for i in job.goodput.incidents
        ],
        "goodput": round(job.goodput.ratio, 4),
    }
    report("example_job_rank_kill", numbers)
    context = f"{numbers}\n{logs}"
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, context
    assert job.current_step == STEPS, context
    assert len(run.injected) == 1, context  # the rank was killed mid-run
    assert job.generation >= 2, context  # and recovered
    assert got == expected, context
    assert expected != on_cpu, context  # the job computed on the GPU, not the CPU
