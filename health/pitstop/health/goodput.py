"""Goodput accounting, from a job's own event log.

Wall time while a job is RUNNING counts as productive, except the steps it has to redo
after a failure. Every decision the scheduler takes to get a job going again is an
*incident* of its own, whatever became of it:

``job.recovering`` / ``job.reconfigured``
    a node failed (or is swapped out): kind ``node``. A ``job.recovering`` without
    incident data is a recovery waiting for capacity; the node decision that ends the
    wait completes that incident rather than opening another.
``job.restarting``
    a rank's exit restarts the job in place (kind ``rank_exit``), or, with attribute
    ``fallback="true"``, a decision that missed its deadline falls back to a full restart
    (kind ``fallback``). A restart without incident data is a fallback of a scheduler
    that did not yet mark them.

A decision event carries its failure (attributes ``incident.failed_at``,
``incident.detected_at``, ``incident.lost_steps``, ``incident.cause``, epoch seconds as
text): the failure itself (a lost node's last sign of life, an Xid, a rank's exit), when
the scheduler noticed it, and how many steps the restore gives up. The event's own time
is when the decision committed. Each incident ends one way (:class:`Outcome`): the job
steps again (``job.recovered``, ``job.running``: resumed), a later decision replaces its
plan before that (superseded), the job ends first (failed, cancelled; succeeded: its
ranks finished without reporting a step), or none yet (in progress). Once every rank of
the resumed generation has reported a step, ``job.restored`` (attribute
``restored_at``) says when the last of them had loaded the restore step, splitting the
resume in two. So, where both ends are known:

    detect    = detected_at - failed_at
    decide    = decided_at  - detected_at
    resume    = resumed_at  - decided_at      (restore and re-form)
      restore = restored_at - decided_at      (every rank holds the restore step)
      re-form = resumed_at  - restored_at     (the process group again, the first step)
    recompute = lost_steps * step_seconds     (time spent redoing those steps)

Incidents that follow one another before the job steps again share their lost time, so
it is counted once. Pure: events in, numbers out. The scheduler stores the result on
the job.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

RUNNING = "running"
INCIDENT = "incident."
FALLBACK = "fallback"
NODE_DECISIONS = ("job.recovering", "job.reconfigured")
RESTART = "job.restarting"
RESTORED = "job.restored"
MAX_STORED_INCIDENTS = 50


class IncidentKind(enum.StrEnum):
    """What the decision answered (the proto's IncidentKind, less its prefix)."""

    NODE = "node"
    RANK_EXIT = "rank_exit"
    FALLBACK = "fallback"


class Outcome(enum.StrEnum):
    """How an incident ended (the proto's IncidentOutcome, less its prefix)."""

    IN_PROGRESS = "in_progress"
    RESUMED = "resumed"
    SUPERSEDED = "superseded"
    JOB_FAILED = "job_failed"
    JOB_CANCELLED = "job_cancelled"
    JOB_SUCCEEDED = "job_succeeded"


JOB_ENDS = {
    "failed": Outcome.JOB_FAILED,
    "cancelled": Outcome.JOB_CANCELLED,
    "succeeded": Outcome.JOB_SUCCEEDED,
}


@dataclass(frozen=True)
class JobEvent:
    """What the account needs of one event of the job."""

    time: float  # epoch seconds
    kind: str
    from_state: str
    to_state: str
    attributes: Mapping[str, str] = field(default_factory=dict)
    reason: str = ""


@dataclass
class Incident:
    """One decision to get the job going again, and what became of it. Times are epoch
    seconds; None where unknown (a fallback has no failure of its own, a recovery waiting
    for capacity no decision yet)."""

    kind: IncidentKind
    cause: str
    opened_at: float  # the decision event's time
    failed_at: float | None = None
    detected_at: float | None = None
    decided_at: float | None = None
    lost_steps: int = 0
    outcome: Outcome = Outcome.IN_PROGRESS
    ended_at: float | None = None  # when the outcome was settled
    restored_at: float | None = None  # the last rank held the restore step (resumed only)

    @property
    def resumed(self) -> bool:
        """The job got going again on this decision (its ranks stepped, or finished)."""
        return self.outcome in (Outcome.RESUMED, Outcome.JOB_SUCCEEDED)

    @property
    def resumed_at(self) -> float | None:
        return self.ended_at if self.outcome is Outcome.RESUMED else None

    @property
    def waiting_for_capacity(self) -> bool:
        """A node recovery that found no spare and no replica to shrink by: undecided."""
        return self.kind is IncidentKind.NODE and self.decided_at is None

    @property
    def began_at(self) -> float:
        """The earliest moment the incident is known to have cost."""
        return _first(self.failed_at, self.detected_at, self.decided_at, self.opened_at)

    @property
    def noticed_at(self) -> float:
        return _first(self.detected_at, self.decided_at, self.opened_at)

    @property
    def detect_seconds(self) -> float | None:
        return _span(self.failed_at, self.detected_at)

    @property
    def decide_seconds(self) -> float | None:
        return _span(self.detected_at, self.decided_at)

    @property
    def resume_seconds(self) -> float | None:
        return _span(self.decided_at, self.resumed_at)

    @property
    def restore_seconds(self) -> float | None:
        return _span(self.decided_at, self.restored_at)

    @property
    def reform_seconds(self) -> float | None:
        return _span(self.restored_at, self.resumed_at)

    def to_json(self) -> dict[str, Any]:
        """The proto's GoodputIncident: unknown times and spans are 0."""
        return {
            "kind": f"INCIDENT_KIND_{self.kind.value.upper()}",
            "cause": self.cause,
            "outcome": f"INCIDENT_OUTCOME_{self.outcome.value.upper()}",
            "failed_at": self.failed_at or 0.0,
            "detected_at": self.detected_at or 0.0,
            "decided_at": self.decided_at or 0.0,
            "resumed_at": self.resumed_at or 0.0,
            "ended_at": self.ended_at or 0.0,
            "detect_seconds": round(self.detect_seconds or 0.0, 4),
            "decide_seconds": round(self.decide_seconds or 0.0, 4),
            "resume_seconds": round(self.resume_seconds or 0.0, 4),
            "restored_at": self.restored_at or 0.0,
            "restore_seconds": round(self.restore_seconds or 0.0, 4),
            "reform_seconds": round(self.reform_seconds or 0.0, 4),
            "lost_steps": self.lost_steps,
            "resumed": self.resumed,
        }


@dataclass
class Goodput:
    productive_seconds: float = 0.0
    detect_seconds: float = 0.0
    recovery_seconds: float = 0.0
    recompute_seconds: float = 0.0
    recoveries: int = 0
    incidents: list[Incident] = field(default_factory=list)

    @property
    def lost_seconds(self) -> float:
        return self.detect_seconds + self.recovery_seconds + self.recompute_seconds

    @property
    def ratio(self) -> float:
        total = self.productive_seconds + self.lost_seconds
        return self.productive_seconds / total if total > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The stored form: the proto's Goodput fields, the newest incidents among them."""
        return {
            "productive_seconds": round(self.productive_seconds, 4),
            "detect_seconds": round(self.detect_seconds, 4),
            "recovery_seconds": round(self.recovery_seconds, 4),
            "recompute_seconds": round(self.recompute_seconds, 4),
            "ratio": round(self.ratio, 6),
            "recoveries": self.recoveries,
            "incident_count": len(self.incidents),
            "incidents": [i.to_json() for i in self.incidents[-MAX_STORED_INCIDENTS:]],
        }


def incident_attributes(
    *, cause: str, failed_at: float, detected_at: float, lost_steps: int
) -> dict[str, str]:
    """The attributes that describe a decision's failure on its event."""
    return {
        f"{INCIDENT}cause": cause,
        f"{INCIDENT}failed_at": f"{failed_at:.6f}",
        f"{INCIDENT}detected_at": f"{detected_at:.6f}",
        f"{INCIDENT}lost_steps": str(max(0, lost_steps)),
    }


def incident_kind(event: JobEvent) -> IncidentKind | None:
    """The kind of incident ``event`` opens; None when it is no decision."""
    if event.kind in NODE_DECISIONS:
        return IncidentKind.NODE
    if event.kind != RESTART:
        return None
    marked = event.attributes.get(FALLBACK) == "true"
    if marked or f"{INCIDENT}failed_at" not in event.attributes:
        return IncidentKind.FALLBACK
    return IncidentKind.RANK_EXIT


def describe(event: JobEvent, incident: Incident) -> None:
    """Fill ``incident`` with the decision ``event`` records: its failure's times (a
    failure never after its detection, neither after the decision) and the steps lost.
    A node event without them leaves its incident undecided: waiting for capacity."""
    attrs = event.attributes
    incident.cause = attrs.get(f"{INCIDENT}cause") or event.reason or event.kind
    failed_at = _number(attrs.get(f"{INCIDENT}failed_at"))
    if failed_at is None and incident.kind is IncidentKind.NODE:
        return
    incident.decided_at = event.time
    if failed_at is not None:
        failed_at = min(failed_at, event.time)
        detected_at = _number(attrs.get(f"{INCIDENT}detected_at"))
        detected_at = failed_at if detected_at is None else detected_at
        incident.failed_at = failed_at
        incident.detected_at = min(max(detected_at, failed_at), event.time)
    lost = _number(attrs.get(f"{INCIDENT}lost_steps"))
    incident.lost_steps = max(0, int(lost)) if lost is not None else 0


def account(events: Iterable[JobEvent], *, now: float, step_seconds: float) -> Goodput:
    """The account of a job whose events (oldest first) are ``events``, as of ``now``.
    ``step_seconds`` is the job's typical step time (what a redone step costs)."""
    out = Goodput()
    running_since: float | None = None
    groups: list[list[Incident]] = []  # decisions between two times the job stepped
    open_group: list[Incident] = []
    resumed: Incident | None = None  # the decision the job last got going on
    for event in events:
        if event.kind == RESTORED:
            restored_at = _number(event.attributes.get("restored_at"))
            decided = resumed.decided_at if resumed is not None else None
            back = resumed.resumed_at if resumed is not None else None
            if resumed is not None and restored_at is not None and decided and back:
                # Another host's clock: kept between the decision and the resumption.
                resumed.restored_at = min(max(restored_at, decided), back)
            resumed = None
            continue
        kind = incident_kind(event)
        if kind is not None:
            latest = open_group[-1] if open_group else None
            if kind is IncidentKind.NODE and latest is not None and latest.waiting_for_capacity:
                describe(event, latest)  # the decision the wait was for
            else:
                resumed = None
                if latest is not None:
                    latest.outcome, latest.ended_at = Outcome.SUPERSEDED, event.time
                incident = Incident(kind=kind, cause="", opened_at=event.time)
                describe(event, incident)
                if not open_group:
                    groups.append(open_group)
                open_group.append(incident)
                out.incidents.append(incident)
            if running_since is not None:
                # Time after the failure was not productive: it is counted as detection.
                began = open_group[-1].began_at
                out.productive_seconds += max(0.0, min(began, event.time) - running_since)
                running_since = None
        if event.from_state == RUNNING and event.to_state != RUNNING and running_since is not None:
            out.productive_seconds += max(0.0, event.time - running_since)
            running_since = None
        ended = Outcome.RESUMED if event.to_state == RUNNING else JOB_ENDS.get(event.to_state)
        if ended is not None and open_group:
            last = open_group[-1]
            last.outcome, last.ended_at = ended, event.time
            open_group = []
            decided = last.decided_at is not None
            resumed = last if ended is Outcome.RESUMED and decided else None
        if event.to_state == RUNNING:
            running_since = event.time
    if running_since is not None:
        out.productive_seconds += max(0.0, now - running_since)
    for group in groups:
        last = group[-1]
        start = min(i.began_at for i in group)
        noticed = min(i.noticed_at for i in group)
        end = last.ended_at if last.ended_at is not None else max(now, last.opened_at)
        out.detect_seconds += max(0.0, noticed - start)
        out.recovery_seconds += max(0.0, end - noticed)
        redo = max(i.lost_steps for i in group) * max(step_seconds, 0.0)
        out.recompute_seconds += redo
        out.productive_seconds -= redo
        if last.resumed:
            # Failures the job got past, on their own decision or a later one's.
            out.recoveries += sum(1 for i in group if i.kind is not IncidentKind.FALLBACK)
    out.productive_seconds = max(0.0, out.productive_seconds)
    return out


def epoch(value: dt.datetime) -> float:
    """A stored timestamp as epoch seconds (naive means UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()


def _number(text: str | None) -> float | None:
    """An attribute's number; None when absent or not a finite number."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _first(*times: float | None) -> float:
    return next(t for t in times if t is not None)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)
