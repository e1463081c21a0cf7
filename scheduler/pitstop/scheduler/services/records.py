"""The experiment record of a job (`pitstop job record`): what was submitted, what each
generation ran, what came out.

Each generation's rank 0 reports its code, environment and data digest through its
agent (pitstop.trainer.runrecord); `store_run_record` keeps one per generation. The
rest is read where it already lives: the job's row (spec, submitter, the code the
submitting client saw, goodput, skipped steps, result), the checkpoint catalog's durable
shards (an ended job's, once retention moved them, its kept checkpoints) and the job's
preemption events.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format
from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.auth import require_project
from pitstop.scheduler.convert import job_to_pb, timestamp
from pitstop.scheduler.db import models
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.jobspec import check_text
from pitstop.scheduler.services.catalog import DURABLE_NODE, world_size
from pitstop.scheduler.services.jobs import get_job, spec_from_json
from pitstop.v1 import agent_pb2, jobs_pb2

MAX_TEXT = 4096
"""The longest text of a run record kept (a path, a digest, a version)."""
INT64_MAX = 2**63 - 1
PREEMPTED = "job.preempted"
"""The event a preemption records, with attributes "by" (the job it made room for)
and "step" (the job's newest step when it was decided)."""
RESUMING = "job.resuming"
"""The event of a preempted job placed again, with attribute "step" (its restore step)."""

_TEXTS = {
    "code": ("git_commit", "dirty_digest", "working_dir"),
    "environment": ("python", "torch", "pitstop", "cuda", "nccl", "image"),
}


def check_run_record(record: agent_pb2.RunRecord) -> None:
    """InvalidArgument, naming the field, for a report that cannot be kept."""
    for part, names in _TEXTS.items():
        for name in names:
            check_text(
                f"run_record.{part}.{name}", getattr(getattr(record, part), name), max_len=MAX_TEXT
            )
    check_text("run_record.data_digest", record.data_digest, max_len=MAX_TEXT)
    check_text("run_record.data_source", record.data_source, max_len=MAX_TEXT)
    if record.generation > INT64_MAX:
        raise InvalidArgument("run_record.generation", record.generation, "not a generation")


async def store_run_record(
    session: AsyncSession, node_id: str, record: agent_pb2.RunRecord
) -> bool:
    """Keep `record`, from node `node_id`'s agent, as its job's generation's report (a
    second report of a generation replaces the first). The environment variables are
    the job's spec's: the agent starts every rank with them (a rank cannot tell them
    from the rest of its environment). False, nothing kept, for an unknown job;
    InvalidArgument for a report that cannot be kept."""
    check_run_record(record)
    job = await session.get(models.Job, record.job_id) if record.job_id else None
    if job is None:
        return False
    kept = agent_pb2.RunRecord()
    kept.CopyFrom(record)
    kept.environment.env.clear()
    kept.environment.env.update(spec_from_json(job.spec).env)
    body = json_format.MessageToDict(kept, preserving_proto_field_name=True)
    upsert = insert(models.RunRecord).values(
        job_id=job.id, generation=record.generation, node_id=node_id, body=body
    )
    await session.execute(
        upsert.on_conflict_do_update(
            index_elements=["job_id", "generation"],
            set_={
                "node_id": upsert.excluded.node_id,
                "body": upsert.excluded.body,
                "recorded_at": func.now(),
            },
        )
    )
    return True


async def job_record(session: AsyncSession, job_id: str) -> jobs_pb2.JobRecord:
    """The job's record. NotFound for an unknown job; PermissionDenied for a caller
    limited to other projects."""
    job = await get_job(session, job_id)
    require_project(job.project, f"read the record of job {job.id}")
    summary = job_to_pb(job)
    record = jobs_pb2.JobRecord(
        job_id=job.id,
        spec=summary.spec,
        state=summary.state,
        created_at=summary.created_at,
        submitted_by=job.submitted_by,
        goodput=summary.goodput,
        skipped_steps=summary.skipped_steps,
        result=summary.result,
        final_weights_hash=summary.result.get("final_weights_sha256", ""),
        current_step=job.current_step,
    )
    if job.submitted_code:
        json_format.ParseDict(job.submitted_code, record.submitted_code, ignore_unknown_fields=True)
    record.generations.extend(await _generations(session, job.id))
    record.durable_checkpoints.extend(await _durable_checkpoints(session, job))
    record.preemptions.extend(await _preemptions(session, job.id))
    return record


async def _generations(session: AsyncSession, job_id: str) -> list[jobs_pb2.GenerationRecord]:
    rows = await session.scalars(
        select(models.RunRecord)
        .where(models.RunRecord.job_id == job_id)
        .order_by(models.RunRecord.generation)
    )
    found = []
    for row in rows:
        reported = json_format.ParseDict(
            row.body, agent_pb2.RunRecord(), ignore_unknown_fields=True
        )
        found.append(
            jobs_pb2.GenerationRecord(
                generation=row.generation,
                recorded_at=timestamp(row.recorded_at),
                code=reported.code,
                environment=reported.environment,
                data_digest=reported.data_digest,
                data_source=reported.data_source,
                start_step=reported.start_step,
                node_id=row.node_id,
            )
        )
    return found


async def _durable_checkpoints(
    session: AsyncSession, job: models.Job
) -> list[jobs_pb2.DurableCheckpoint]:
    """The job's whole durable checkpoints, oldest first: those retention moved out of
    the catalog (an ended job's) and those still in it."""
    kept = await session.scalars(
        select(models.KeptCheckpoint).where(models.KeptCheckpoint.job_id == job.id)
    )
    found = {
        row.step: jobs_pb2.DurableCheckpoint(
            step=row.step, digest=row.digest, shards=row.shards, bytes=row.size_bytes
        )
        for row in kept
    }
    for checkpoint in await whole_durable_checkpoints(session, job):
        found[checkpoint.step] = checkpoint
    return [found[step] for step in sorted(found)]


async def whole_durable_checkpoints(
    session: AsyncSession, job: models.Job
) -> list[jobs_pb2.DurableCheckpoint]:
    """The steps in the catalog whose every rank (of the generation that wrote them)
    has its durable shard, oldest first: digest, shard count and bytes of each."""
    shard = models.CheckpointShard
    rows = (
        await session.execute(
            select(
                shard.step,
                shard.rank,
                shard.checksum,
                shard.size_bytes,
                models.Checkpoint.generation,
            )
            .join(
                models.Checkpoint,
                (models.Checkpoint.job_id == shard.job_id) & (models.Checkpoint.step == shard.step),
            )
            .where(shard.job_id == job.id)
            .where(shard.node_id == DURABLE_NODE)
            .order_by(shard.step, shard.rank)
        )
    ).all()
    by_step: dict[int, list[Any]] = {}
    for row in rows:
        by_step.setdefault(row.step, []).append(row)
    sizes: dict[int, int] = {}
    found = []
    for step, shards in by_step.items():
        generation = shards[0].generation
        if generation not in sizes:
            sizes[generation] = await world_size(session, job, generation)
        if len(shards) < sizes[generation]:
            continue  # still being flushed, or partly pruned
        found.append(
            jobs_pb2.DurableCheckpoint(
                step=step,
                digest=shards_digest([s.checksum for s in shards]),
                shards=len(shards),
                bytes=sum(s.size_bytes for s in shards),
            )
        )
    return found


def shards_digest(checksums: Sequence[str]) -> str:
    """A durable checkpoint's digest: SHA-256 over its shards' checksums in rank order,
    each followed by a newline."""
    digest = hashlib.sha256()
    for checksum in checksums:
        digest.update(checksum.encode() + b"\n")
    return digest.hexdigest()


async def _preemptions(session: AsyncSession, job_id: str) -> list[jobs_pb2.PreemptionRecord]:
    """Each preemption, with the step the job resumed from (the resume's job.resuming
    event): the step its ranks stopped at, which the decision's own `step` (the newest
    step when it was taken) may trail by the one the ranks were in."""
    events = await session.scalars(
        select(models.Event)
        .where(models.Event.job_id == job_id)
        .where(models.Event.kind.in_((PREEMPTED, RESUMING)))
        .order_by(models.Event.id)
    )
    found: list[jobs_pb2.PreemptionRecord] = []
    for event in events:
        step = str(event.attributes.get("step", ""))
        if event.kind == RESUMING:
            if found and step.isdecimal():
                found[-1].step = int(step)
            continue
        found.append(
            jobs_pb2.PreemptionRecord(
                at=timestamp(event.time),
                by_job_id=str(event.attributes.get("by", "")),
                step=int(step) if step.isdecimal() else 0,
            )
        )
    return found
