"""Which pending jobs start, which wait and why, and which running jobs make room:
pure functions over the fleet as one pass of the leader read it.

Pending jobs are taken highest priority first, then oldest. Each one, in turn:

1. waits when its GPUs would take its project over its quota;
2. is placed when a gang fits (``placement.place_gang``), booking its GPUs for the jobs
   after it;
3. else, when running preemptible jobs of lower priority hold enough, makes room with
   them, chosen to lose the least: lowest priority first, then the fewest steps since
   their last durable checkpoint; a job inside its minimum run time is never chosen.
   Shrinking comes first: when dropping data-parallel replicas down to the jobs'
   `min_dp` frees enough, those replicas go and the jobs run on; else the fewest whole
   jobs that make room are preempted. It waits for them (the next pass places it);
4. else waits, with the reason in words: capacity, topology, or the priority of jobs
   placed ahead of it.

A later, smaller job may still start where an earlier one does not fit (backfill).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pitstop.scheduler.placement import GangRequest, place_gang
from pitstop.scheduler.topology import NodeInfo, Placement, Topology

PREEMPT_GRACE_SECONDS = 60.0
"""How long a preempted job's ranks get to reach a step boundary and exit on their own
before their agent signals what is left (SIGTERM, then SIGKILL)."""


@dataclass(frozen=True)
class Pending:
    """A pending job as admission sees it."""

    request: GangRequest
    project: str

    @property
    def job_id(self) -> str:
        return self.request.job_id


@dataclass(frozen=True)
class Running:
    """A running job that may be preempted: preemptible, and past its minimum run time."""

    job_id: str
    priority: int
    unsaved_steps: int
    """Steps since its last durable checkpoint (what a lost node would cost it)."""
    gpus: tuple[tuple[str, int], ...]
    """The (node, GPU) pairs it holds."""
    replicas: tuple[tuple[tuple[str, int], ...], ...] = ()
    """Those pairs by data-parallel replica, in dp order (empty: none may be dropped)."""
    min_dp: int = 0
    """The fewest replicas it may shrink to."""

    @property
    def droppable(self) -> tuple[tuple[tuple[str, int], ...], ...]:
        """The replicas a shrink may drop, the last first."""
        keep = max(self.min_dp, 1)
        return tuple(reversed(self.replicas[keep:])) if len(self.replicas) > keep else ()


@dataclass
class Admission:
    """One pass's verdict."""

    placed: dict[str, Placement] = field(default_factory=dict)
    waiting: dict[str, str] = field(default_factory=dict)
    """Why each pending job that was not placed waits."""
    preempt: dict[str, str] = field(default_factory=dict)
    """Victim job id -> the job it makes room for."""
    shrink: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Job id -> (replicas it drops, the last first; the job they make room for)."""


def admit(
    nodes: Sequence[NodeInfo],
    booked: Sequence[tuple[str, int]],
    pending: Iterable[Pending],
    *,
    quotas: Mapping[str, tuple[int | None, int]] | None = None,
    preemptible: Sequence[Running] = (),
) -> Admission:
    """Decide one pass. `booked`: the GPUs live jobs hold; `quotas`: project -> (its GPU
    quota or None, GPUs its jobs hold now); `preemptible`: the running jobs that may be
    preempted now."""
    out = Admission()
    queue = sorted(pending, key=lambda p: (-p.request.priority, p.request.sequence, p.job_id))
    if not queue:
        return out
    before = Topology.build(nodes, booked)
    topology = Topology.build(nodes, booked)
    used = {project: in_use for project, (_, in_use) in (quotas or {}).items()}
    limits = {project: quota for project, (quota, _) in (quotas or {}).items()}
    booked_now = list(booked)
    taken: set[str] = set()
    for job in queue:
        request, project = job.request, job.project
        need = request.world_size
        quota, in_use = limits.get(project), used.get(project, 0)
        if quota is not None and in_use + need > quota:
            out.waiting[job.job_id] = (
                f"quota: project {project} holds {in_use} of its {quota} GPUs and this job "
                f"needs {need}; it waits until the project's jobs free "
                f"{in_use + need - quota} (or an admin raises the quota: pitstop quota set)"
            )
            continue
        placement = place_gang(topology, request)
        if placement is not None:
            topology.book(placement)
            booked_now += [(s.node_id, s.gpu_index) for s in placement.ranks]
            used[project] = in_use + need
            out.placed[job.job_id] = placement
            continue
        eligible = [
            r for r in preemptible if r.job_id not in taken and r.priority < request.priority
        ]
        shrinks = _shrinks(nodes, booked_now, request, eligible)
        if shrinks:
            taken.update(shrinks)
            out.shrink.update({j: (n, job.job_id) for j, n in shrinks.items()})
            out.waiting[job.job_id] = (
                "shrinking "
                + ", ".join(f"{j} by {n} replica(s)" for j, n in sorted(shrinks.items()))
                + ": their dropped replicas leave at the next step boundary, then this job "
                "starts on their GPUs"
            )
            continue
        victims = _victims(nodes, booked_now, request, eligible)
        if victims:
            taken.update(victims)
            out.preempt.update(dict.fromkeys(victims, job.job_id))
            out.waiting[job.job_id] = (
                f"preempting {', '.join(victims)}: they stop at their next step boundary, "
                "then this job starts on their GPUs"
            )
            continue
        out.waiting[job.job_id] = _why_not(before, topology, request, preemptible)
    return out


def _fits(
    nodes: Sequence[NodeInfo],
    booked: Sequence[tuple[str, int]],
    request: GangRequest,
    freed: set[tuple[str, int]],
) -> bool:
    trial = Topology.build(nodes, [pair for pair in booked if pair not in freed])
    return place_gang(trial, request) is not None


def _shrinks(
    nodes: Sequence[NodeInfo],
    booked: Sequence[tuple[str, int]],
    request: GangRequest,
    eligible: Sequence[Running],
) -> dict[str, int]:
    """The fewest replicas of `eligible` to drop (job -> how many, the last first) that
    make `request` fit, least loss first; {} when dropping all they may is not enough."""
    order = sorted(eligible, key=lambda r: (r.priority, r.unsaved_steps, r.job_id))
    freed: set[tuple[str, int]] = set()
    dropped: dict[str, int] = {}
    for candidate in order:
        for replica in candidate.droppable:
            freed.update(replica)
            dropped[candidate.job_id] = dropped.get(candidate.job_id, 0) + 1
            if _fits(nodes, booked, request, freed):
                return dropped
    return {}


def _victims(
    nodes: Sequence[NodeInfo],
    booked: Sequence[tuple[str, int]],
    request: GangRequest,
    eligible: Sequence[Running],
) -> list[str]:
    """The fewest of `eligible` whose GPUs make `request` fit, least loss first; [] when
    all of them together are not enough."""
    order = sorted(eligible, key=lambda r: (r.priority, r.unsaved_steps, r.job_id))

    def fits(chosen: Sequence[Running]) -> bool:
        return _fits(nodes, booked, request, {pair for r in chosen for pair in r.gpus})

    chosen: list[Running] = []
    for candidate in order:
        chosen.append(candidate)
        if fits(chosen):
            break
    else:
        return []
    # Keep only those needed: one taken early may be spared by one taken later.
    for candidate in reversed(chosen[:-1]):
        rest = [r for r in chosen if r is not candidate]
        if fits(rest):
            chosen = rest
    return [r.job_id for r in chosen]


def _why_not(
    before: Topology, now: Topology, request: GangRequest, preemptible: Sequence[Running]
) -> str:
    need, per_node, nodes = request.world_size, request.gpus_needed, request.node_count
    shape = f"{need} GPUs ({nodes} node{'s' if nodes > 1 else ''} with {per_node} free each)"
    workers = [n for ids in now.worker_racks().values() for n in ids]
    if place_gang(before, request) is not None:
        return f"priority: higher-priority jobs placed ahead of it took the GPUs; needs {shape}"
    free = sum(now.free_count(n) for n in workers)
    roomy = sum(1 for n in workers if now.free_count(n) >= per_node)
    lower = [r for r in preemptible if r.priority < request.priority]
    note = (
        ""
        if lower
        else "; no running job of lower priority may be preempted (none is preemptible, "
        "or all are inside their minimum run time)"
    )
    if free >= need:
        return (
            f"topology: {free} GPUs are free on READY workers but only {roomy} node(s) have "
            f"{per_node} free; needs {shape}{note}"
        )
    return f"capacity: needs {shape}; {free} free on READY workers{note}"
