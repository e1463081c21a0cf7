"""Rendering helpers: enum words, ages, event lines, JSON, tables, error lines."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console, RenderableType

from pitstop.client.cli import describe_error
from pitstop.client.enums import (
    JOB_STATES,
    NODE_ROLES,
    NODE_STATES,
    enum_word,
    enum_words,
    parse_enum_word,
)
from pitstop.client.errors import PitstopError
from pitstop.client.render import (
    ends_job,
    event_line,
    format_age,
    format_shape,
    format_time,
    to_json,
)
from pitstop.client.render_jobs import job_view, jobs_table
from pitstop.client.render_nodes import node_view, nodes_table
from pitstop.v1 import common_pb2, jobs_pb2, nodes_pb2

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def _timestamp(at: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(at)
    return ts


def _text(renderable: RenderableType) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


@pytest.mark.parametrize(
    ("enum", "value", "word"),
    [
        (JOB_STATES, common_pb2.JOB_STATE_RUNNING, "running"),
        (JOB_STATES, common_pb2.JOB_STATE_CANCELLED, "cancelled"),
        (NODE_ROLES, common_pb2.NODE_ROLE_SPARE, "spare"),
        (NODE_STATES, common_pb2.NODE_STATE_CORDONED, "cordoned"),
        (NODE_STATES, 99, "99"),
    ],
)
def test_enum_word(enum: EnumDescriptor, value: int, word: str) -> None:
    assert enum_word(enum, value) == word


def test_enum_words_round_trip_and_leave_out_unspecified() -> None:
    words = enum_words(NODE_ROLES)
    assert words == ["worker", "spare"]
    assert [parse_enum_word(NODE_ROLES, w) for w in words] == [1, 2]
    assert parse_enum_word(NODE_ROLES, "NODE_ROLE_SPARE") == common_pb2.NODE_ROLE_SPARE
    with pytest.raises(ValueError, match="not one of: worker, spare"):
        parse_enum_word(NODE_ROLES, "unspecified")


@pytest.mark.parametrize(
    ("ago", "shown"),
    [
        (timedelta(seconds=5), "5s"),
        (timedelta(seconds=125), "2m"),
        (timedelta(hours=3, minutes=59), "3h"),
        (timedelta(days=2, hours=1), "2d"),
        (timedelta(seconds=-3), "0s"),
    ],
)
def test_format_age(ago: timedelta, shown: str) -> None:
    assert format_age(_timestamp(NOW - ago), NOW) == shown


def test_unset_timestamps_show_a_dash() -> None:
    assert format_age(Timestamp(), NOW) == "-"
    assert format_time(Timestamp()) == "-"
    assert format_time(_timestamp(NOW)) == "2025-03-01T12:00:00Z"


def test_event_line_and_job_end() -> None:
    event = common_pb2.Event(
        id=7,
        time=_timestamp(NOW),
        kind="job.state",
        job_id="j-1",
        from_state="JOB_STATE_RUNNING",
        to_state="cancelled",
        reason="user asked\nnicely",
        actor="user:ada",
        attributes={"generation": "2"},
    )
    line = event_line(event)
    assert line.startswith("#7  2025-03-01T12:00:00Z  job.state  job=j-1")
    assert "running -> cancelled" in line
    assert '"user asked nicely"' in line
    assert "generation=2" in line
    assert line.endswith("by user:ada")
    assert ends_job(event)
    running = common_pb2.Event(id=8, kind="job.state", job_id="j-1", to_state="running")
    assert not ends_job(running)
    assert not ends_job(common_pb2.Event(id=9, kind="node.state", to_state="lost"))


def test_to_json_keeps_proto_names_enum_names_and_defaults() -> None:
    job = jobs_pb2.Job(
        id="j-1", state=common_pb2.JOB_STATE_PENDING, generation=3, spec=jobs_pb2.JobSpec(dp=2)
    )
    data = to_json(job)
    assert data["id"] == "j-1"
    assert data["state"] == "JOB_STATE_PENDING"
    assert data["generation"] == 3  # uint64 as a number, not a string
    assert data["spec"]["dp"] == 2
    assert data["current_step"] == 0  # defaults present, so scripts can rely on the keys


def test_jobs_table_and_view() -> None:
    spec = jobs_pb2.JobSpec(name="tiny", command=["python", "t.py"], tp=2, pp=1, dp=4)
    job = jobs_pb2.Job(
        id="j-abc",
        spec=spec,
        state=common_pb2.JOB_STATE_RUNNING,
        generation=2,
        current_step=40,
        created_at=_timestamp(NOW - timedelta(minutes=3)),
        rank_map=common_pb2.RankMap(
            generation=2,
            world_size=8,
            ranks=[common_pb2.RankAssignment(rank=0, node_id="n-1", gpu_index=0)],
        ),
        rank_stats=[
            jobs_pb2.RankStepStats(
                rank=5, node_id="n-2", p50_seconds=0.5, p99_seconds=2.0, straggler=True
            )
        ],
        result={"final_weights_sha256": "abc123"},
    )
    assert format_shape(spec) == "2x1x4"
    row = _text(jobs_table([job], NOW))
    for cell in ("j-abc", "tiny", "running", "2x1x4", "40", "3m"):
        assert cell in row
    view = _text(job_view(job, NOW))
    for fragment in ("python t.py", "rank map", "n-1", "step times", "yes", "abc123", "goodput"):
        assert fragment in view


def test_server_text_is_not_rich_markup() -> None:
    node = nodes_pb2.Node(id="n-[bold]1[/bold]", reason="[red]bad[/red]")
    assert "n-[bold]1[/bold]" in _text(nodes_table([node], NOW))
    assert "[red]bad[/red]" in _text(node_view(node, NOW))


def test_node_view_shows_gpus_and_xids() -> None:
    node = nodes_pb2.Node(
        id="n-1",
        role=common_pb2.NODE_ROLE_SPARE,
        state=common_pb2.NODE_STATE_UNHEALTHY,
        reason="Xid 79 on GPU 3",
        labels=common_pb2.TopologyLabels(zone="z1", block="b1", rack="r1"),
        health=common_pb2.NodeHealth(
            gpus=[common_pb2.GpuHealth(index=3, lost=True, verdict=common_pb2.HEALTH_VERDICT_FATAL)]
        ),
        xid_history=[common_pb2.XidEvent(gpu_index=3, xid=79, message="fell off the bus")],
        standby_job_ids=["j-waiting"],
    )
    text = _text(node_view(node, NOW))
    for fragment in (
        "spare",
        "unhealthy (Xid 79 on GPU 3)",
        "z1/b1/r1",
        "fatal",
        "79",
        "fell off the bus",
        "standbys waiting",
        "j-waiting",
    ):
        assert fragment in text


@pytest.mark.parametrize(
    ("error", "token", "line"),
    [
        (
            PitstopError(grpc.StatusCode.NOT_FOUND, "job 'j-1' not found"),
            False,
            "job 'j-1' not found (NOT_FOUND)",
        ),
        (
            PitstopError(
                grpc.StatusCode.UNAVAILABLE,
                "failed to connect to all addresses; last error: Connection refused",
            ),
            False,
            "cannot reach the pitstop scheduler at h:1 (UNAVAILABLE); start it with "
            "pitstop-scheduler or pass --server",
        ),
        (
            PitstopError(grpc.StatusCode.UNAVAILABLE, "redis is down;\nretry later"),
            False,
            "redis is down; retry later (UNAVAILABLE)",
        ),
        (
            PitstopError(grpc.StatusCode.UNAUTHENTICATED, "no bearer token"),
            False,
            "no bearer token (UNAUTHENTICATED); pass --token or set PITSTOP_TOKEN",
        ),
        (
            PitstopError(grpc.StatusCode.UNAUTHENTICATED, "token expired"),
            True,
            "token expired (UNAUTHENTICATED)",
        ),
    ],
)
def test_error_lines(error: PitstopError, token: bool, line: str) -> None:
    assert describe_error(error, "h:1", token) == line


def test_pitstop_error_str() -> None:
    error = PitstopError(grpc.StatusCode.FAILED_PRECONDITION, "job j-1 already ended")
    assert str(error) == "job j-1 already ended (FAILED_PRECONDITION)"
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION
    assert error.details == "job j-1 already ended"
    assert not error.unreachable


def test_an_unreachable_scheduler_without_a_ca_suggests_tls() -> None:
    error = PitstopError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    line = describe_error(error, "h:1", token_given=False, tls=False)
    assert line.endswith("if it serves TLS (the default), pass --ca-cert or set PITSTOP_CA_CERT")
