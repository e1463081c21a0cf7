"""The /metrics a running scheduler and a running agent serve, scraped over HTTP while a
job steps: promtool's `check metrics` accepts both, and the scheduler's per-job series
say what the ranks reported (steps, tokens, loss, model FLOPs and peak for the MFU)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import AGENT_BINARY, SchedulerThread, StoreUrls, scheduler_settings, unique
from fake_rank import FAKE_RANK
from monitoring import needs_promtool, promtool
from prometheus_client.parser import text_string_to_metric_families

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


def wait_until(what: str, check: object, timeout: float = 60.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="pm-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def leading(stores: StoreUrls, tmp_path: Path) -> Iterator[SchedulerThread]:
    thread = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path / "scheduler",
            database_url=stores.fresh_database(),
            redis_prefix=f"{stores.redis_prefix}{unique('metrics')}:",
            leader_loops=True,
            metrics_port=0,
            heartbeat_interval_seconds=0.5,
            liveness_timeout_intervals=5.0,
            liveness_startup_grace_seconds=0.0,
        )
    )
    yield thread
    thread.stop()


@pytest.fixture
def agent(leading: SchedulerThread, short_dir: Path) -> Iterator[str]:
    """One real agent on simulated GPUs; yields its /metrics URL (as it printed it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    proc = subprocess.Popen(
        [
            str(AGENT_BINARY),
            "run",
            "--node-id",
            "m0",
            "--scheduler",
            leading.address,
            "--gpus",
            "sim:2",
            "--state-dir",
            str(short_dir / "m0"),
            "--metrics-port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
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
        assert proc.wait(30) == 0


@needs_promtool
def test_scheduler_and_agent_metrics_pass_promtool_while_a_job_steps(
    leading: SchedulerThread, agent: str
) -> None:
    scheduler_url = f"http://127.0.0.1:{leading.scheduler.metrics_port}/metrics"
    wait_until(
        "the scheduler to lead", lambda: "pitstop_scheduler_leader 1.0" in scrape(scheduler_url)
    )
    wait_until("the agent's stream", lambda: "pitstop_agent_scheduler_connected{" in scrape(agent))
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
        return samples(scrape(scheduler_url)).get(
            ("pitstop_scheduler_job_steps_total", labels)
        ) == STEPS and bool(
            samples(scrape(scheduler_url)).get(("pitstop_scheduler_job_loss", labels))
        )

    wait_until(f"{STEPS} steps of {job.id} on the scheduler's /metrics", stepped)
    scheduler_text, agent_text = scrape(scheduler_url), scrape(agent)
    for name, text in (("scheduler", scheduler_text), ("agent", agent_text)):
        checked = promtool("check", "metrics", stdin=text)
        assert checked.returncode == 0, f"{name}: {checked.stdout}{checked.stderr}\n{text}"

    seen = samples(scheduler_text)
    tokens = 2 * STEPS * TOKENS_PER_STEP  # two ranks
    assert seen[("pitstop_scheduler_job_tokens_total", labels)] == tokens
    assert seen[("pitstop_scheduler_job_model_flops_total", labels)] == tokens * FLOPS_PER_TOKEN
    assert seen[("pitstop_scheduler_job_peak_flops", labels)] == 2 * PEAK_FLOPS
    assert seen[("pitstop_scheduler_job_loss", labels)] == pytest.approx(1.0 / STEPS)
    assert seen[("pitstop_scheduler_job_step", labels)] == STEPS
    assert seen[("pitstop_scheduler_job_state", labels | {("state", "running")})] == 1
    assert seen[("pitstop_scheduler_job_info", labels | {("name", spec.name)})] == 1
    reported = samples(agent_text)[
        ("pitstop_agent_steps_reported_total", frozenset({("node", "m0"), ("job_id", job.id)}))
    ]
    assert reported == 2 * STEPS

    jobs.Cancel(jobs_pb2.JobControlRequest(job_id=job.id))
    wait_until(
        "the cancelled job's series to go",
        lambda: f'job_id="{job.id}"' not in scrape(scheduler_url),
    )
