"""A job's experiment record for people (`pitstop job record`), and two records compared
(`pitstop job diff`).

The comparison flattens each record (as `--json` prints it) to dotted keys, list items
by index (`generations.0.code.git_commit`, `spec.env.SEED`), and reports every key
whose value differs or that only one record has. Nothing is left out, but the keys that
name a run rather than describe it (IDENTITY: its id, when it was created, when and
where each generation reported, when a preemption happened and for which job) differ
between any two runs, so they are kept apart from the differences that matter.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from pitstop.client.enums import JOB_STATES, enum_word
from pitstop.client.render import add_row, details, format_shape, format_time, table, to_json
from pitstop.client.render_jobs import goodput_view
from pitstop.v1 import agent_pb2, jobs_pb2

IDENTITY = frozenset(
    {
        "job_id",
        "created_at",
        "generations.*.recorded_at",
        "generations.*.node_id",
        "preemptions.*.at",
        "preemptions.*.by_job_id",
    }
)
"""Keys (list indexes as `*`) that name a run, not what it ran: `pitstop job diff`
lists their differences apart, under "identity"."""
ABSENT = "(absent)"
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a JSON value, in its order; an empty list or
    object has no leaves."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}{key}.")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}{index}.")
    else:
        yield prefix.removesuffix("."), value


def is_identity(key: str) -> bool:
    """Whether `key` names the run rather than what it ran (see IDENTITY)."""
    return _INDEX.sub("*", key) in IDENTITY


@dataclass
class RecordDiff:
    """What tells two records apart, keys in record order."""

    only_in_a: dict[str, Any] = field(default_factory=dict)
    only_in_b: dict[str, Any] = field(default_factory=dict)
    differ: dict[str, list[Any]] = field(default_factory=dict)
    """Keys both have, with different values: [a, b]."""
    identity: dict[str, list[Any]] = field(default_factory=dict)
    """The IDENTITY keys among them, kept apart."""

    def to_json(self) -> dict[str, Any]:
        return {
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "differ": self.differ,
            "identity": self.identity,
        }

    @property
    def same(self) -> bool:
        """Whether the records agree on all but their identity."""
        return not (self.only_in_a or self.only_in_b or self.differ)


def diff_records(a: jobs_pb2.JobRecord, b: jobs_pb2.JobRecord) -> RecordDiff:
    """Every key of the two flattened records whose value differs or that one lacks."""
    left, right = dict(flatten(to_json(a))), dict(flatten(to_json(b)))
    found = RecordDiff()
    for key, value in left.items():
        if key not in right:
            found.only_in_a[key] = value
        elif right[key] != value:
            (found.identity if is_identity(key) else found.differ)[key] = [value, right[key]]
    found.only_in_b = {k: v for k, v in right.items() if k not in left}
    return found


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def diff_view(diff: RecordDiff, a: str, b: str) -> RenderableType:
    """KEY | A | B of every difference, then the identity keys apart."""
    parts: list[RenderableType] = []
    if diff.same:
        parts.append(f"jobs {a} and {b} have the same record but for their identity")
    else:
        rows = table("KEY", a, b, title="differences")
        for key, (left, right) in diff.differ.items():
            add_row(rows, (key, _cell(left), _cell(right)))
        for key, value in diff.only_in_a.items():
            add_row(rows, (key, _cell(value), ABSENT))
        for key, value in diff.only_in_b.items():
            add_row(rows, (key, ABSENT, _cell(value)))
        parts.append(rows)
    if diff.identity:
        names = table("KEY", a, b, title="identity (differs between any two runs)")
        for key, (left, right) in diff.identity.items():
            add_row(names, (key, _cell(left), _cell(right)))
        parts += ["", names]
    return Group(*parts)


def _code(code: agent_pb2.CodeVersion) -> str:
    if not code.git_commit:
        return f"no git commit known\nin {code.working_dir or '-'}"
    state = "clean"
    if code.dirty:
        state = f"dirty: changes sha256 {code.dirty_digest or 'unknown'}"
    return f"commit {code.git_commit}\n{state}\nin {code.working_dir or '-'}"


def _environment(env: agent_pb2.EnvironmentVersion) -> str:
    named = [
        ("python", env.python),
        ("torch", env.torch),
        ("pitstop", env.pitstop),
        ("cuda", env.cuda),
        ("nccl", env.nccl),
    ]
    versions = ", ".join(f"{name} {value or '-'}" for name, value in named)
    return f"{versions}\nimage {env.image or '-'}"


def code_view(record: jobs_pb2.JobRecord) -> Table:
    """The code at submit and in each generation."""
    rows = []
    if record.HasField("submitted_code"):
        rows.append(("submitted", _code(record.submitted_code)))
    rows += [(f"generation {g.generation}", _code(g.code)) for g in record.generations]
    return details(rows or [("submitted", "not told")], title="code")


def environment_view(record: jobs_pb2.JobRecord) -> Table:
    """Each generation's software, and the spec's environment variables."""
    rows = [(f"generation {g.generation}", _environment(g.environment)) for g in record.generations]
    newest = record.generations[-1].environment.env  # the spec's: every generation's
    rows.append(("env (the spec's)", " ".join(f"{k}={v}" for k, v in sorted(newest.items()))))
    return details([(k, v or "none") for k, v in rows], title="environment")


def data_view(record: jobs_pb2.JobRecord) -> Table:
    """Each generation's data digest, and where it started."""
    rows = [
        (
            f"generation {g.generation}",
            f"from step {g.start_step} on node {g.node_id or '-'}\n"
            f"digest {g.data_digest or 'not stated'}\nsource {g.data_source or '-'}",
        )
        for g in record.generations
    ]
    return details(rows, title="data")


def checkpoints_view(record: jobs_pb2.JobRecord) -> Table:
    """The complete durable checkpoints."""
    rows = [
        (f"step {c.step}", f"{c.shards} shards, {c.bytes} bytes\nsha256 {c.digest}")
        for c in record.durable_checkpoints
    ]
    return details(rows, title="durable checkpoints")


def record_view(record: jobs_pb2.JobRecord) -> RenderableType:
    """Everything `pitstop job record` prints: spec summary, code, environment, data,
    durable checkpoints, goodput, preemptions, skipped steps, result."""
    spec = record.spec
    summary: list[tuple[str, object]] = [
        ("job", record.job_id),
        ("name", spec.name),
        ("state", enum_word(JOB_STATES, record.state)),
        ("project", spec.project or "default"),
        ("submitted by", record.submitted_by or "-"),
        ("created", format_time(record.created_at)),
        ("command", shlex.join(spec.command) or "-"),
        ("shape", f"tp x pp x dp = {format_shape(spec)}"),
        ("step", record.current_step),
    ]
    if spec.working_dir:
        summary.append(("working dir", spec.working_dir))
    parts: list[RenderableType] = [details(summary, title="spec"), "", code_view(record), ""]
    if record.generations:
        parts += [environment_view(record), "", data_view(record), ""]
    else:
        parts += ["environment and data: no generation has reported yet", ""]
    if record.durable_checkpoints:
        parts += [checkpoints_view(record), ""]
    else:
        parts += ["durable checkpoints: none complete", ""]
    parts += [goodput_view(record.goodput), ""]
    if record.preemptions:
        preempted = table("AT", "FOR JOB", "STEP", title="preemptions")
        for p in record.preemptions:
            add_row(preempted, (format_time(p.at), p.by_job_id or "-", p.step))
        parts += [preempted, ""]
    skipped = ", ".join(str(s) for s in record.skipped_steps) or "none"
    parts += [details([("skipped steps", skipped)]), ""]
    result = sorted(record.result.items())
    parts.append(details(result, title="result") if result else "result: none reported")
    return Group(*parts)
