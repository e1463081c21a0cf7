"""Rich tables and detail views of jobs."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from datetime import datetime

from rich.console import Group, RenderableType
from rich.table import Table

from pitstop.client.enums import (
    INCIDENT_KINDS,
    INCIDENT_OUTCOMES,
    JOB_STATES,
    STRAGGLER_ACTIONS,
    enum_word,
)
from pitstop.client.render import (
    add_row,
    details,
    format_age,
    format_seconds,
    format_shape,
    format_time,
    table,
)
from pitstop.v1 import jobs_pb2


def job_state(job: jobs_pb2.Job) -> str:
    """The job's state as a word, e.g. ``running``."""
    return enum_word(JOB_STATES, job.state)


def jobs_table(jobs: Sequence[jobs_pb2.Job], now: datetime) -> Table:
    """One row per job: id, name, state, shape, generation, step, age."""
    result = table("ID", "NAME", "STATE", "SHAPE", "GEN", "STEP", "AGE")
    for job in jobs:
        add_row(
            result,
            (
                job.id,
                job.spec.name,
                job_state(job),
                format_shape(job.spec),
                job.generation,
                job.current_step,
                format_age(job.created_at, now),
            ),
        )
    return result


def queue_table(jobs: Sequence[jobs_pb2.Job]) -> Table | None:
    """The pending jobs in the order they are considered, each with why it waits; None
    when none is pending."""
    waiting = sorted((j for j in jobs if j.queue_position), key=lambda j: j.queue_position)
    if not waiting:
        return None
    result = table("POS", "ID", "NAME", "PROJECT", "PRIORITY", "GPUS", "WAITS BECAUSE")
    for job in waiting:
        spec = job.spec
        add_row(
            result,
            (
                job.queue_position,
                job.id,
                spec.name,
                spec.project or "default",
                spec.priority,
                spec.tp * spec.pp * spec.dp,
                job.reason or "-",
            ),
        )
    return result


def job_summary(job: jobs_pb2.Job, now: datetime) -> Table:
    """Key facts of a job: spec, state and progress."""
    spec = job.spec
    world = spec.tp * spec.pp * spec.dp
    state = job_state(job) + (f" ({job.reason})" if job.reason else "")
    rows: list[tuple[str, object]] = [
        ("id", job.id),
        ("name", spec.name),
        ("state", state),
        ("command", shlex.join(spec.command) or "-"),
        ("shape", f"tp x pp x dp = {format_shape(spec)} ({world} ranks)"),
        ("gpus per node", spec.gpus_per_node),
        ("elastic dp", f"{spec.min_dp or spec.dp}..{spec.dp}"),
        (
            "spares",
            f"{spec.spares}, with standby processes" if spec.standby_processes else spec.spares,
        ),
        ("project", spec.project or "default"),
        ("priority", spec.priority),
        (
            "preemptible",
            f"yes, after {spec.min_run_seconds} s of running; preempted {job.preemptions} times"
            if spec.preemptible
            else "no",
        ),
        ("restarts", f"{job.restarts} of {spec.max_restarts}"),
        ("generation", job.generation),
        (
            "step",
            f"{job.current_step} (committed {job.committed_step}, durable {job.durable_step})",
        ),
        ("created", f"{format_time(job.created_at)} ({format_age(job.created_at, now)} ago)"),
        *([("queue position", job.queue_position)] if job.queue_position else []),
        ("updated", f"{format_time(job.updated_at)} ({format_age(job.updated_at, now)} ago)"),
    ]
    rows.append(("checkpoint", checkpoint_policy(spec.checkpoint)))
    straggler = spec.straggler
    if straggler.action:
        rows.append(
            (
                "stragglers",
                f"{enum_word(STRAGGLER_ACTIONS, straggler.action)} above "
                f"{straggler.threshold:g} deviations for {straggler.windows} windows",
            )
        )
    if spec.working_dir:
        rows.append(("working dir", spec.working_dir))
    if spec.env:
        rows.append(("env", " ".join(f"{k}={v}" for k, v in sorted(spec.env.items()))))
    return details(rows)


def checkpoint_policy(policy: jobs_pb2.CheckpointPolicy) -> str:
    """The snapshot and durable-flush cadence in words."""
    every = policy.snapshot_every_steps
    snapshot = "snapshot every step" if every <= 1 else f"snapshot every {every} steps"
    if policy.auto_interval:
        durable = "durable at the Young/Daly interval"
    elif policy.durable_every_steps:
        durable = f"durable every {policy.durable_every_steps} steps"
    else:
        durable = "never durable"
    where = f" to {policy.durable_url}" if policy.durable_url else ""
    return f"{snapshot}, {durable}{where}"


def goodput_view(goodput: jobs_pb2.Goodput) -> Table:
    """Where the job's GPU time went."""
    rows: list[tuple[str, object]] = [
        ("ratio", f"{goodput.ratio:.1%}"),
        ("productive", format_seconds(goodput.productive_seconds)),
        ("detect", format_seconds(goodput.detect_seconds)),
        ("recovery", format_seconds(goodput.recovery_seconds)),
        ("recompute", format_seconds(goodput.recompute_seconds)),
        ("recoveries", goodput.recoveries),
    ]
    incidents = max(goodput.incident_count, len(goodput.incidents))
    if incidents:
        rows.append(("incidents", incidents))
    return details(rows, title="goodput")


def _span(start: float, end: float, seconds: float) -> str:
    """A span between two epoch times, or "-" when an end is unknown (0)."""
    return format_seconds(seconds) if start and end else "-"


def incident_row(incident: jobs_pb2.GoodputIncident, now: datetime) -> tuple[str, ...]:
    """KIND, OUTCOME, CAUSE, DETECT, DECIDE, RESUME, TOTAL, STEPS LOST of one incident.
    An account stored before incidents had a kind shows its spans as they are."""
    spans = incident.detect_seconds + incident.decide_seconds + incident.resume_seconds
    if incident.kind == jobs_pb2.INCIDENT_KIND_UNSPECIFIED:
        outcome = "resumed" if incident.resumed else "in progress"
        detect = format_seconds(incident.detect_seconds)
        decide = format_seconds(incident.decide_seconds)
        resume = format_seconds(incident.resume_seconds) if incident.resumed else "-"
        total = format_seconds(spans) if incident.resumed else "-"
    else:
        outcome = enum_word(INCIDENT_OUTCOMES, incident.outcome).replace("_", " ")
        detect = _span(incident.failed_at, incident.detected_at, incident.detect_seconds)
        decide = _span(incident.detected_at, incident.decided_at, incident.decide_seconds)
        resume = _span(incident.decided_at, incident.resumed_at, incident.resume_seconds)
        total = _span(incident.failed_at, incident.resumed_at, spans)
        if incident.outcome == jobs_pb2.INCIDENT_OUTCOME_IN_PROGRESS:
            if not incident.decided_at:
                decide = "waiting"
            else:
                resume = f"{format_seconds(max(0.0, now.timestamp() - incident.decided_at))} so far"
    kind = enum_word(INCIDENT_KINDS, incident.kind).replace("_", " ")
    return (
        kind if incident.kind != jobs_pb2.INCIDENT_KIND_UNSPECIFIED else "-",
        outcome,
        incident.cause,
        detect,
        decide,
        resume,
        total,
        str(incident.lost_steps),
    )


def incidents_table(goodput: jobs_pb2.Goodput, now: datetime) -> Table:
    """Every recovery, restart and fallback (the newest the account keeps): what it
    answered, how it ended, and how long detection, decision and resumption took."""
    shown = len(goodput.incidents)
    title = "incidents"
    if goodput.incident_count > shown:
        title += f" (newest {shown} of {goodput.incident_count})"
    result = table(
        "KIND",
        "OUTCOME",
        "CAUSE",
        "DETECT",
        "DECIDE",
        "RESUME",
        "TOTAL",
        "STEPS LOST",
        title=title,
    )
    for incident in goodput.incidents:
        add_row(result, incident_row(incident, now))
    return result


def rank_map_table(job: jobs_pb2.Job) -> Table:
    """Where each rank runs in the current generation."""
    result = table(
        "RANK",
        "NODE",
        "GPU",
        "LOCAL",
        "DP",
        "PP",
        "TP",
        title=f"rank map (generation {job.rank_map.generation}, "
        f"world size {job.rank_map.world_size})",
    )
    for rank in job.rank_map.ranks:
        add_row(
            result,
            (rank.rank, rank.node_id, rank.gpu_index, rank.local_rank, rank.dp, rank.pp, rank.tp),
        )
    return result


def rank_stats_table(job: jobs_pb2.Job) -> Table:
    """Per-rank step-time percentiles, stragglers flagged."""
    result = table("RANK", "NODE", "P50", "P99", "STRAGGLER", title="step times")
    for stats in job.rank_stats:
        add_row(
            result,
            (
                stats.rank,
                stats.node_id,
                format_seconds(stats.p50_seconds),
                format_seconds(stats.p99_seconds),
                "yes" if stats.straggler else "",
            ),
        )
    return result


def job_view(job: jobs_pb2.Job, now: datetime) -> RenderableType:
    """Everything ``pitstop job show`` prints, sections left out when empty."""
    parts: list[RenderableType] = [job_summary(job, now), "", goodput_view(job.goodput)]
    if job.goodput.incidents:
        parts += ["", incidents_table(job.goodput, now)]
    if job.rank_map.ranks:
        parts += ["", rank_map_table(job)]
    if job.rank_stats:
        parts += ["", rank_stats_table(job)]
    if job.result:
        parts += ["", details(sorted(job.result.items()), title="result")]
    return Group(*parts)
