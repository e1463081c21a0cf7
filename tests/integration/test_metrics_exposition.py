"""The /metrics a running scheduler and a running agent serve, scraped over HTTP while a
job steps: the scheduler's per-job series say what the ranks reported (steps, tokens,
loss, model FLOPs and peak for the MFU); a rank killed and restarted is one recovery in
the phase histograms; promtool's `check metrics` accepts both outputs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kit.monitoring import needs_promtool, promtool
from kit.ranks import FAKE_RANK
from kit.schedulers import SchedulerThread, agents_leader
from kit.stores import StoreUrls, unique
from kit.waits import wait_until
from pitstop.client.launch import agent_command, clean_env
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc

STEPS = 20
FLOPS_PER_TOKEN, PEAK_FLOPS = 6e6, 1e12
TOKENS_PER_STEP = 64  # what fake_rank reports


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def rank_pid(job_id: str, rank: int) -> int:
    """The pid of the job's rank `rank` (not a standby), by its environment."""
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if (env.get("PITSTOP_JOB_ID"), env.get("RANK")) == (job_id, str(rank)) and env.get(
            "PITSTOP_STANDBY"
        ) != "1":
            return int(proc.pid)
    raise AssertionError(f"no process of rank {rank} of {job_id}")


@pytest.fixture
def leading(stores: StoreUrls, tmp_path: Path) -> Iterator[SchedulerThread]:
    thread = agents_leader(stores, tmp_path, "metrics", metrics_port=0)
    yield thread
    thread.stop()


@pytest.fixture
def agent(leading: SchedulerThread, short_dir: Path) -> Iterator[str]:
    """One real agent on simulated GPUs; yields its /metrics URL (as it printed it)."""
    env = clean_env()
    log = short_dir / "agent.log"
    with log.open("w") as errors:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            agent_command(
                fork_server="off",  # fake ranks or none: no zygote to import torch
                node_id="m0",
                scheduler=leading.address,
                gpus="sim:2",
                state_dir=short_dir / "m0",
                metrics_port=0,
                log_level="WARNING",
            ),
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        )
    try:
        assert proc.stdout is not None
        started = proc.stdout.readline()
        found = re.search(r"metrics on (\S+),", started)
        assert found is not None, f"the agent did not say where its metrics are: {started!r}"
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
        assert code == 0, f"the agent exited {code}:\n{log.read_text()[-3000:]}"


@needs_promtool
def test_scheduler_and_agent_metrics_pass_promtool_while_a_job_steps(
    leading: SchedulerThread, agent: str
) -> None:
    scheduler_url = f"http://127.0.0.1:{leading.scheduler.metrics_port}/metrics"
    wait_until(
        lambda: "pitstop_scheduler_leader 1.0" in scrape(scheduler_url),
        "the scheduler to lead",
        poll=0.1,
    )
    wait_until(
        lambda: "pitstop_agent_scheduler_connected{" in scrape(agent),
        "the agent's stream",
        poll=0.1,
    )
    jobs = jobs_pb2_grpc.JobServiceStub(leading.channel())
    command = [
        sys.executable,
        str(FAKE_RANK),
        "--attach",
        "--steps",
        str(STEPS),
        "--step-seconds",
        "0.01",
        "--flops-per-token",
        str(FLOPS_PER_TOKEN),
        "--peak-flops",
        str(PEAK_FLOPS),
        "--hold",
    ]
    spec = jobs_pb2.JobSpec(name=unique("metrics"), dp=2, gpus_per_node=2, command=command)
    job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
    labels = frozenset({("job_id", job.id)})

    def stepped() -> bool:
        # The loss is the mean at the newest step every rank reached: at the last step's
        # value, both ranks' reports are in (a lagging rank's tokens too).
        now = samples(scrape(scheduler_url))
        last_loss = now.get(("pitstop_scheduler_job_loss", labels)) == pytest.approx(1.0 / STEPS)
        return now.get(("pitstop_scheduler_job_steps_total", labels)) == STEPS and last_loss

    wait_until(stepped, f"{STEPS} steps of {job.id} on the scheduler's /metrics", poll=0.1)
    seen = samples(scrape(scheduler_url))
    tokens = 2 * STEPS * TOKENS_PER_STEP  # two ranks
    assert seen[("pitstop_scheduler_job_tokens_total", labels)] == tokens
    assert seen[("pitstop_scheduler_job_model_flops_total", labels)] == tokens * FLOPS_PER_TOKEN
    assert seen[("pitstop_scheduler_job_peak_flops", labels)] == 2 * PEAK_FLOPS
    assert seen[("pitstop_scheduler_job_loss", labels)] == pytest.approx(1.0 / STEPS)
    assert seen[("pitstop_scheduler_job_step", labels)] == STEPS
    assert seen[("pitstop_scheduler_job_state", labels | {("state", "running")})] == 1
    assert seen[("pitstop_scheduler_job_info", labels | {("name", spec.name)})] == 1

    # Rank 0 dies: the job restarts it and steps again, a recovery of cause rank_exit.
    os.kill(rank_pid(job.id, 0), signal.SIGKILL)
    resumed = ("pitstop_scheduler_recovery_seconds_count", frozenset({("cause", "rank_exit")}))
    wait_until(
        lambda: samples(scrape(scheduler_url)).get(resumed), "the recovery on /metrics", poll=0.1
    )
    wait_until(
        lambda: (
            samples(scrape(scheduler_url))[("pitstop_scheduler_job_steps_total", labels)]
            == 2 * STEPS
        ),  # the new generation's steps count again
        "the restarted rank's steps",
        poll=0.1,
    )
    scheduler_text, agent_text = scrape(scheduler_url), scrape(agent)
    for name, text in (("scheduler", scheduler_text), ("agent", agent_text)):
        checked = promtool("check", "metrics", stdin=text)
        assert checked.returncode == 0, f"{name}: {checked.stdout}{checked.stderr}\n{text}"
    seen = samples(scheduler_text)
    for phase in ("detect", "decide", "resume"):
        key = frozenset({("phase", phase), ("cause", "rank_exit")})
        assert seen[("pitstop_scheduler_recovery_phase_seconds_count", key)] == 1, phase
    assert seen[resumed] == 1
    assert seen[("pitstop_scheduler_job_generation", labels)] == 2
    reported = samples(agent_text)[
        ("pitstop_agent_steps_reported_total", frozenset({("node", "m0"), ("job_id", job.id)}))
    ]
    assert reported == 4 * STEPS  # its node starts both its ranks anew

    jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id))
    wait_until(
        lambda: f'job_id="{job.id}"' not in scrape(scheduler_url),
        "the cancelled job's series to go",
        poll=0.1,
    )
