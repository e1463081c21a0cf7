"""`pitstop job show`'s goodput account: every incident with its kind and outcome,
unknown spans as "-", recoveries under way as far as they got."""

from __future__ import annotations

import io
from datetime import UTC, datetime

from rich.console import Console, RenderableType

from pitstop.client.render import to_json
from pitstop.client.render_jobs import incident_row, job_view
from pitstop.v1 import common_pb2, jobs_pb2

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
T = NOW.timestamp() - 100


def text(renderable: RenderableType) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def incident(**fields: object) -> jobs_pb2.GoodputIncident:
    return jobs_pb2.GoodputIncident(**fields)


RESUMED_NODE = incident(
    kind=jobs_pb2.INCIDENT_KIND_NODE,
    outcome=jobs_pb2.INCIDENT_OUTCOME_RESUMED,
    cause="n2 lost",
    failed_at=T,
    detected_at=T + 1.5,
    decided_at=T + 1.75,
    resumed_at=T + 4,
    ended_at=T + 4,
    detect_seconds=1.5,
    decide_seconds=0.25,
    resume_seconds=2.25,
    lost_steps=2,
    resumed=True,
)
SUPERSEDED_FALLBACK = incident(
    kind=jobs_pb2.INCIDENT_KIND_FALLBACK,
    outcome=jobs_pb2.INCIDENT_OUTCOME_SUPERSEDED,
    cause="the recovery did not resume before its deadline",
    decided_at=T + 40,
    ended_at=T + 41,
)
RANK_UNDER_WAY = incident(
    kind=jobs_pb2.INCIDENT_KIND_RANK_EXIT,
    outcome=jobs_pb2.INCIDENT_OUTCOME_IN_PROGRESS,
    cause="rank 3 exited with code 1",
    failed_at=T + 80,
    detected_at=T + 80,
    decided_at=T + 80,
    lost_steps=1,
)
NODE_WAITING = incident(
    kind=jobs_pb2.INCIDENT_KIND_NODE,
    outcome=jobs_pb2.INCIDENT_OUTCOME_IN_PROGRESS,
    cause="waiting for capacity: no spare and no shrink left",
)


def test_each_incident_shows_its_kind_outcome_and_known_spans() -> None:
    assert incident_row(RESUMED_NODE, NOW) == (
        "node", "resumed", "n2 lost", "1.50s", "250.0ms", "2.25s", "4.00s", "2"
    )  # fmt: skip
    assert incident_row(SUPERSEDED_FALLBACK, NOW) == (
        "fallback", "superseded", SUPERSEDED_FALLBACK.cause, "-", "-", "-", "-", "0"
    )  # fmt: skip


def test_a_recovery_under_way_shows_how_long_it_has_run() -> None:
    assert incident_row(RANK_UNDER_WAY, NOW)[:2] == ("rank exit", "in progress")
    assert incident_row(RANK_UNDER_WAY, NOW)[5] == "20.00s so far"
    assert incident_row(NODE_WAITING, NOW)[3:7] == ("-", "waiting", "-", "-")


def test_an_account_stored_before_incident_kinds_still_shows() -> None:
    legacy = incident(cause="n4 lost", detect_seconds=1.0, decide_seconds=0.5, resumed=False)
    assert incident_row(legacy, NOW) == ("-", "in progress", "n4 lost", "1.00s",
                                         "500.0ms", "-", "-", "0")  # fmt: skip


def test_job_show_lists_the_incidents_and_says_when_older_ones_are_left_out() -> None:
    goodput = jobs_pb2.Goodput(
        recoveries=1,
        incident_count=7,
        incidents=[RESUMED_NODE, SUPERSEDED_FALLBACK, RANK_UNDER_WAY, NODE_WAITING],
    )
    job = jobs_pb2.Job(id="j-1", state=common_pb2.JOB_STATE_RECOVERING, goodput=goodput)
    shown = text(job_view(job, NOW))
    assert "incidents (newest 4 of 7)" in shown
    for fragment in ("rank exit", "fallback", "superseded", "in progress", "waiting"):
        assert fragment in shown
    printed = to_json(job)["goodput"]
    assert printed["incident_count"] == 7
    assert [i["outcome"] for i in printed["incidents"]] == [
        "INCIDENT_OUTCOME_RESUMED",
        "INCIDENT_OUTCOME_SUPERSEDED",
        "INCIDENT_OUTCOME_IN_PROGRESS",
        "INCIDENT_OUTCOME_IN_PROGRESS",
    ]
    assert printed["incidents"][2]["kind"] == "INCIDENT_KIND_RANK_EXIT"
