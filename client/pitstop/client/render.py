"""Turning wire messages into words, JSON and rich tables for people and scripts.

Pure functions of their arguments (the current time is passed in), so they test
without a server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.table import Table
from rich.text import Text

from pitstop.v1 import common_pb2, jobs_pb2

TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "cancelled"})


def state_word(state: str) -> str:
    """An event's from/to state as a word, whether the server wrote ``"JOB_STATE_RUNNING"``
    or ``"running"``."""
    lowered = state.lower()
    for prefix in ("job_state_", "node_state_", "node_role_"):
        lowered = lowered.removeprefix(prefix)
    return lowered


def to_json(message: Message) -> dict[str, Any]:
    """A message as the JSON object ``--json`` prints: field names as in the proto,
    enums as names, fields left at their default included so the keys are stable."""
    return json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def timestamp_is_set(ts: Timestamp) -> bool:
    """Whether a Timestamp field holds a time (proto3 leaves unset ones at the epoch)."""
    return ts.seconds != 0 or ts.nanos != 0


def format_time(ts: Timestamp) -> str:
    """``2024-05-01T12:03:04Z``, or ``-`` when unset."""
    if not timestamp_is_set(ts):
        return "-"
    return ts.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_age(ts: Timestamp, now: datetime) -> str:
    """Time since ``ts`` in the largest whole unit: ``45s``, ``3m``, ``2h``, ``5d``."""
    if not timestamp_is_set(ts):
        return "-"
    seconds = int((now - ts.ToDatetime(tzinfo=UTC)).total_seconds())
    if seconds < 0:
        return "0s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def format_shape(spec: jobs_pb2.JobSpec) -> str:
    """The model-parallel shape as ``tpxppxdp (tp varies fastest in rank order)``."""
    return f"{spec.tp}x{spec.pp}x{spec.dp}"


def format_seconds(value: float) -> str:
    """A duration in seconds with sensible precision."""
    if value == 0:
        return "0s"
    if value >= 100:
        return f"{value:.0f}s"
    if value >= 1:
        return f"{value:.2f}s"
    return f"{value * 1000:.1f}ms"


def event_line(event: common_pb2.Event) -> str:
    """One event as one line: id, time, kind, subject, transition, reason, actor."""
    parts = [f"#{event.id}", format_time(event.time), event.kind]
    if event.job_id:
        parts.append(f"job={event.job_id}")
    if event.node_id:
        parts.append(f"node={event.node_id}")
    if event.from_state or event.to_state:
        parts.append(f"{state_word(event.from_state) or '-'} -> {state_word(event.to_state)}")
    if event.attributes:
        parts.append(" ".join(f"{k}={v}" for k, v in sorted(event.attributes.items())))
    if event.reason:
        parts.append(f'"{_one_line(event.reason)}"')
    if event.actor:
        parts.append(f"by {event.actor}")
    return "  ".join(parts)


def ends_job(event: common_pb2.Event) -> bool:
    """Whether the event moves its job into a final state (succeeded, failed, cancelled)."""
    return bool(event.job_id) and state_word(event.to_state) in TERMINAL_JOB_STATES


def table(*columns: str, title: str | None = None) -> Table:
    """A plain table with the given column headers."""
    result = Table(title=title, title_justify="left", header_style="bold", box=None)
    for column in columns:
        result.add_column(column, overflow="fold")
    return result


def add_row(target: Table, cells: Iterable[object]) -> None:
    """Add a row of literal text: values from the server are never read as rich markup."""
    target.add_row(*(Text(str(cell)) for cell in cells))


def details(rows: Sequence[tuple[str, object]], title: str | None = None) -> Table:
    """A two-column key/value grid."""
    grid = Table.grid(padding=(0, 2))
    grid.title = title
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for key, value in rows:
        grid.add_row(Text(key), Text(str(value)))
    return grid


def _one_line(text: str) -> str:
    return " ".join(text.split())
