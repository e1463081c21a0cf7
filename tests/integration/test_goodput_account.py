"""A job's goodput account against a real scheduler: the scheduler's refresh reads the
job's events from PostgreSQL, stores the account on the row, and `pitstop job show`
(and its --json) lists every recovery, restart and fallback with its outcome."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker
from typer.testing import CliRunner

from kit.schedulers import SchedulerThread
from kit.stores import unique
from pitstop.client.cli import app
from pitstop.health.goodput import incident_attributes
from pitstop.scheduler.db import models
from pitstop.scheduler.services import goodput
from pitstop.scheduler.services.events import record_event
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc

# (seconds after the start, kind, from, to, attributes, reason): a node recovery that
# misses its deadline, the fallback that resumes it, then a crash loop of rank exits
# that ends the job.
START = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)


def failure(at: float, cause: str, lost: int) -> dict[str, str]:
    epoch = START.timestamp() + at
    return incident_attributes(cause=cause, failed_at=epoch - 1, detected_at=epoch, lost_steps=lost)


HISTORY: list[tuple[float, str, str, str, dict[str, str], str]] = [
    (0, "job.starting", "placed", "starting", {}, ""),
    (2, "job.running", "starting", "running", {}, "ranks are stepping"),
    (20, "job.recovering", "running", "recovering", failure(20, "n2 lost", 3), "moved"),
    (50, "job.restarting", "", "", {"fallback": "true", **failure(50, "deadline", 4)}, ""),
    (55, "job.recovered", "recovering", "running", {}, "ranks are stepping"),
    (80, "job.restarting", "running", "recovering", failure(80, "rank 1 exited", 1), ""),
    (81, "job.restarting", "", "", failure(81, "rank 1 exited", 1), ""),
    (90, "job.failed", "recovering", "failed", {}, "restarts exhausted (3)"),
]


def submit(scheduler: SchedulerThread) -> str:
    stub: Any = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
    spec = jobs_pb2.JobSpec(name=unique("goodput"), command=["python", "t.py"], tp=1, pp=1, dp=1)
    response = stub.Submit(jobs_pb2.SubmitJobRequest(spec=spec, request_id=unique("req")))
    return str(response.job.id)


async def write_history(scheduler: SchedulerThread, job_id: str) -> None:
    sessions = async_sessionmaker(scheduler.scheduler.engine, expire_on_commit=False)
    async with sessions() as session, session.begin():
        job = await session.get(models.Job, job_id)
        assert job is not None
        for at, kind, src, dst, attrs, reason in HISTORY:
            event = record_event(
                session,
                kind,
                actor="test",
                job_id=job_id,
                from_state=src,
                to_state=dst,
                reason=reason,
                attributes=attrs,
            )
            event.time = START + dt.timedelta(seconds=at)
        await session.flush()
        await goodput.refresh(session, job, step_seconds=0.5)


def show(scheduler: SchedulerThread, job_id: str, *flags: str) -> str:
    result = CliRunner().invoke(
        app,
        ["--server", scheduler.address, "job", "show", job_id, *flags],
        env={"COLUMNS": "160"},  # one line a row, whatever the terminal running the test
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return result.stdout


def test_job_show_lists_every_incident_with_its_outcome(scheduler: SchedulerThread) -> None:
    job_id = submit(scheduler)
    scheduler._call(write_history(scheduler, job_id))
    account = json.loads(show(scheduler, job_id, "--json"))["goodput"]
    incidents = [(i["kind"], i["outcome"], i["resumed"]) for i in account["incidents"]]
    assert incidents == [
        ("INCIDENT_KIND_NODE", "INCIDENT_OUTCOME_SUPERSEDED", False),
        ("INCIDENT_KIND_FALLBACK", "INCIDENT_OUTCOME_RESUMED", True),
        ("INCIDENT_KIND_RANK_EXIT", "INCIDENT_OUTCOME_SUPERSEDED", False),
        ("INCIDENT_KIND_RANK_EXIT", "INCIDENT_OUTCOME_JOB_FAILED", False),
    ]
    assert account["incident_count"] == 4
    assert account["recoveries"] == 1  # the node failure; the fallback is no failure
    fallback = account["incidents"][1]
    assert fallback["resume_seconds"] == 5.0
    assert fallback["lost_steps"] == 4
    # The failed job's last incident ended when the job failed, not at the refresh.
    assert account["incidents"][-1]["ended_at"] == pytest.approx(START.timestamp() + 90)
    assert account["recovery_seconds"] == pytest.approx((55 - 20) + (90 - 80))

    human = show(scheduler, job_id)
    for fragment in (
        "incidents",
        "node",
        "fallback",
        "rank exit",
        "superseded",
        "job failed",
        "n2 lost",
        "rank 1 exited",
    ):
        assert fragment in human, human
