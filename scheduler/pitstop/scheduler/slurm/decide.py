"""What the Slurm adapter does in one pass, decided from plain data: the nodes pitstop
holds failed (desired: drained in Slurm with pitstop's reason), the adapter's records of
them (PostgreSQL), and what Slurm shows. Level-triggered: a drain is asked for again in
every pass until Slurm shows it; a replacement is named (durably) before it is asked
for, and asked for only while no job of that name is in Slurm.

pitstop's node daemons run inside Slurm allocations, so a node lost when its allocation
ends is no failure: one that Slurm shows in no running job, or in a job whose comment
says it is ending (ENDING_COMMENT, which the recipe sets before it stops its daemons),
is recorded as such at once and never drained, even once a new allocation holds it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pitstop.scheduler.slurm.commands import Allocation, SlurmNode

REASON_PREFIX = "pitstop: "
"""Every reason the adapter drains with starts so: a drain Slurm shows with another
reason is someone else's (an admin's, a health check's) and is left as it is."""
MAX_REASON = 200
ENDING_COMMENT = "pitstop: ending"
"""The comment deploy/slurm/pitstop.sbatch gives its Slurm job before its node daemons
stop: their nodes' loss is the allocation ending, not a failure."""


def drain_reason(state: str, reason: str) -> str:
    """The reason a failed node is drained with in Slurm: pitstop's state and reason, one
    line, at most MAX_REASON characters."""
    text = " ".join(f"{REASON_PREFIX}{state}: {reason or 'no reason given'}".split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


@dataclass(frozen=True)
class FailedNode:
    """A node pitstop holds unhealthy or lost, and the drain it wants in Slurm."""

    node_id: str
    slurm_node: str
    reason: str


@dataclass(frozen=True)
class DrainRecord:
    """The adapter's record of a failed node (a `slurm_drains` row)."""

    node_id: str
    slurm_node: str
    reason: str
    drained: bool = False
    replacement_name: str = ""
    replacement_job_id: str = ""
    allocation_ended: bool = False
    """The node was lost as its Slurm allocation ended: nothing to drain."""


@dataclass(frozen=True)
class Confirmation:
    """Slurm shows the node drained: with pitstop's reason, or (`foreign`) with a reason
    of someone else's, which the adapter leaves alone."""

    node_id: str
    slurm: SlurmNode
    foreign: bool


@dataclass(frozen=True)
class Release:
    """A node lost as its allocation ended (`job_id`: the ending job; "": none left)."""

    node: FailedNode
    job_id: str


@dataclass
class DrainPlan:
    """One pass's decisions. The record changes (create, retarget, clear, confirm, name)
    commit in one transaction before any command runs; `drain` is then sent."""

    create: list[FailedNode] = field(default_factory=list)
    retarget: list[FailedNode] = field(default_factory=list)
    """Records whose wanted drain changed (another reason): drained again."""
    clear: list[str] = field(default_factory=list)
    """Node ids no longer failed: their records go (Slurm's drain stays for an admin)."""
    confirm: list[Confirmation] = field(default_factory=list)
    drain: list[FailedNode] = field(default_factory=list)
    release: list[Release] = field(default_factory=list)
    """Newly failed nodes whose allocation ended: recorded so, never drained."""
    unknown: list[FailedNode] = field(default_factory=list)
    """Failed nodes Slurm does not list: nothing to drain (a node outside Slurm, or a
    wrong slurm_node_names entry)."""
    name_replacement: list[str] = field(default_factory=list)
    """Node ids to ask a replacement allocation for: drained in Slurm, none asked for yet,
    and no idle spare left."""


def plan_drains(
    failed: Mapping[str, FailedNode],
    records: Mapping[str, DrainRecord],
    observed: Mapping[str, SlurmNode],
    allocations: Mapping[str, Sequence[Allocation]],
    *,
    idle_spares: int,
    replacements: bool,
) -> DrainPlan:
    """Compare the failed nodes with their records and with what Slurm shows: `observed`
    needs only the nodes not `settled`, `allocations` (the running jobs on a node) only
    the failed nodes without a record yet, by Slurm name; a node missing there is
    decided in a later pass."""
    plan = DrainPlan(clear=sorted(set(records) - set(failed)))
    for node_id in sorted(failed):
        want = failed[node_id]
        record = records.get(node_id)
        if record is not None and record.allocation_ended:
            continue
        if record is not None and settled(want, record):
            drained = True
        elif (seen := observed.get(want.slurm_node)) is None:
            plan.unknown.append(want)
            continue
        elif record is None:
            jobs = allocations.get(want.slurm_node)
            if jobs is None:
                continue
            ending = [job for job in jobs if job.comment.startswith(ENDING_COMMENT)]
            if not jobs or ending:
                plan.release.append(Release(want, ending[0].job_id if ending else ""))
                continue
            plan.create.append(want)
            drained = _drive(plan, want, seen)
        elif (record.slurm_node, record.reason) != (want.slurm_node, want.reason):
            plan.retarget.append(want)
            drained = _drive(plan, want, seen)
        else:
            drained = _drive(plan, want, seen)
        asked = record is not None and bool(record.replacement_name)
        if replacements and drained and not asked and idle_spares <= 0:
            plan.name_replacement.append(node_id)
    return plan


def settled(want: FailedNode, record: DrainRecord) -> bool:
    """Nothing to ask Slurm about this failed node: its allocation ended, or Slurm was
    seen showing the very drain wanted."""
    same = (record.slurm_node, record.reason) == (want.slurm_node, want.reason)
    return record.allocation_ended or (record.drained and same)


def _drive(plan: DrainPlan, want: FailedNode, seen: SlurmNode) -> bool:
    """Confirm the drain Slurm shows (True), or ask for it (False)."""
    theirs = not seen.reason.startswith(REASON_PREFIX)
    if seen.drained and (seen.reason == want.reason or theirs):
        plan.confirm.append(Confirmation(want.node_id, seen, foreign=theirs))
        return True
    plan.drain.append(want)
    return False


@dataclass
class SubmissionPlan:
    """Replacements named but without a Slurm job id: found in Slurm by name (`adopt`:
    node id -> job id; the request went out before a restart), or asked for (`submit`)."""

    adopt: dict[str, str] = field(default_factory=dict)
    submit: list[DrainRecord] = field(default_factory=list)


def plan_submissions(records: Iterable[DrainRecord], in_slurm: Mapping[str, str]) -> SubmissionPlan:
    """`in_slurm`: job name -> id of the pending or running jobs of those names."""
    plan = SubmissionPlan()
    for record in sorted(records, key=lambda r: r.node_id):
        if not record.replacement_name or record.replacement_job_id:
            continue
        found = in_slurm.get(record.replacement_name)
        if found:
            plan.adopt[record.node_id] = found
        else:
            plan.submit.append(record)
    return plan
