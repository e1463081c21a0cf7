"""What the scheduler makes of a rank's integrity finding (pitstop.trainer.integrity),
in the caller's transaction:

* silent data corruption named on a rank -> its node UNHEALTHY (quarantined, reason
  "sdc"), so the job's recovery moves the node's ranks to a spare from the last step
  the replicas agreed on (the bad step was never snapshotted);
* a NaN/Inf loss or a spike rolled back -> an event, and the step whose batch is
  skipped kept in the job's record (every later generation's ranks skip it too);
* rollbacks that reached the policy's maximum, or replicas that disagree with no rank
  to blame -> the job PAUSED with the reason (a person decides).
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.services import lifecycle
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.health import live, locked_node, quarantine
from pitstop.v1 import agent_pb2

_EVENTS = {
    agent_pb2.FINDING_KIND_SDC: "job.sdc_detected",
    agent_pb2.FINDING_KIND_SDC_UNLOCATED: "job.sdc_unlocated",
    agent_pb2.FINDING_KIND_NONFINITE: "job.rolled_back",
    agent_pb2.FINDING_KIND_SPIKE: "job.rolled_back",
}


async def record_finding(
    session: AsyncSession, node_id: str, finding: agent_pb2.IntegrityFinding
) -> models.Job | None:
    """Record `finding` from node `node_id`'s agent and act on it. Returns the job when
    it was paused (its agents are to be told), else None."""
    job = await session.get(models.Job, finding.job_id, with_for_update=True)
    actor = f"agent:{node_id}"
    known = agent_pb2.FindingKind.DESCRIPTOR.values_by_number.get(finding.kind)
    if known is not None:
        kind = known.name.removeprefix("FINDING_KIND_").lower()
    else:  # an agent newer than this scheduler (or garbage): recorded as its number
        kind = f"unknown kind {finding.kind}"
    attributes = {
        "kind": kind,
        "step": str(finding.step),
        "rank": str(finding.rank),
        "gpu": str(finding.gpu_index),
        "generation": str(finding.generation),
        "rolled_back_to": str(finding.rolled_back_to),
        "ranks": ",".join(str(r) for r in finding.ranks),
    }
    if finding.digest or finding.expected_digest:
        attributes |= {"digest": finding.digest, "expected_digest": finding.expected_digest}
    if finding.skipped_step:
        attributes["skipped_step"] = str(finding.skipped_step)
    reason = finding.detail[:1000] or kind
    record_event(
        session,
        _EVENTS.get(finding.kind, "job.integrity"),
        actor=actor,
        job_id=job.id if job is not None else None,
        node_id=node_id,
        reason=f"step {finding.step}: {reason}",
        attributes=attributes,
    )
    if finding.kind == agent_pb2.FINDING_KIND_SDC:
        await _quarantine(session, node_id, finding, attributes)
    if job is None or job.state.terminal:
        return None
    if finding.skipped_step:
        skipped = set(job.integrity.get("skipped_steps", [])) | {int(finding.skipped_step)}
        job.integrity = {**job.integrity, "skipped_steps": sorted(skipped)}
    if finding.pause and job.state is JobState.RUNNING:
        lifecycle.transition(
            session,
            job,
            JobState.PAUSED,
            kind="job.pause",
            reason=(
                f"paused by its integrity checks at step {finding.step}: {reason}"
                if finding.kind == agent_pb2.FINDING_KIND_SDC_UNLOCATED
                else "paused by its integrity checks: rollbacks reached the policy's maximum "
                f"(spec.integrity.max_rollbacks), the last at step {finding.step}: {reason}"
            ),
        )
        return job
    return None


async def _quarantine(
    session: AsyncSession,
    node_id: str,
    finding: agent_pb2.IntegrityFinding,
    attributes: dict[str, str],
) -> None:
    node = await locked_node(session, node_id)
    if node is None or not live(node):
        return
    await quarantine(
        session,
        node,
        reason=(
            f"sdc: GPU {finding.gpu_index} computed a wrong result at step {finding.step} of "
            f"job {finding.job_id} (rank {finding.rank}: digest {finding.digest}, its "
            f"replicas {finding.expected_digest})"
        ),
        actor=f"agent:{node_id}",
        attributes={**attributes, "cause": "sdc"},
    )
