"""Goodput accounting, from a job's own event log.

Wall time while a job is RUNNING counts as productive, except the steps it has to redo
after a failure. Each failure is an *incident*, written by the scheduler on the event
that starts its recovery (attributes ``incident.failed_at``, ``incident.detected_at``,
``incident.lost_steps``, ``incident.cause``, epoch seconds as text): the failure itself
(a last heartbeat, an Xid, a rank's exit), when the scheduler noticed it, and how many
committed-but-unreplicated steps the restore gives up. The event's own time is when the
decision committed; the next RUNNING transition is when training resumed. So:

    detect   = detected_at - failed_at
    decide   = decided_at  - detected_at
    resume   = resumed_at  - decided_at      (restore and re-form)
    recompute = lost_steps * step_seconds    (time spent redoing those steps)

Pure: events in, numbers out. The scheduler stores the result on the job.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

RUNNING = "running"
INCIDENT = "incident."


@dataclass(frozen=True)
class JobEvent:
    """What the account needs of one event of the job."""

    time: float  # epoch seconds
    kind: str
    from_state: str
    to_state: str
    attributes: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Incident:
    """One failure and its recovery; times are epoch seconds."""

    cause: str
    failed_at: float
    detected_at: float
    decided_at: float
    lost_steps: int
    resumed_at: float | None = None

    @property
    def detect_seconds(self) -> float:
        return max(0.0, self.detected_at - self.failed_at)

    @property
    def decide_seconds(self) -> float:
        return max(0.0, self.decided_at - self.detected_at)

    @property
    def resume_seconds(self) -> float:
        end = self.resumed_at if self.resumed_at is not None else self.decided_at
        return max(0.0, end - self.decided_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "failed_at": self.failed_at,
            "detect_seconds": round(self.detect_seconds, 4),
            "decide_seconds": round(self.decide_seconds, 4),
            "resume_seconds": round(self.resume_seconds, 4),
            "lost_steps": self.lost_steps,
            "resumed": self.resumed_at is not None,
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
        """The stored form: the proto's Goodput fields, plus the incidents."""
        return {
            "productive_seconds": round(self.productive_seconds, 4),
            "detect_seconds": round(self.detect_seconds, 4),
            "recovery_seconds": round(self.recovery_seconds, 4),
            "recompute_seconds": round(self.recompute_seconds, 4),
            "ratio": round(self.ratio, 6),
            "recoveries": self.recoveries,
            "incidents": [i.to_json() for i in self.incidents[-50:]],
        }


def incident_attributes(
    *, cause: str, failed_at: float, detected_at: float, lost_steps: int
) -> dict[str, str]:
    """The attributes that open an incident on a recovery's first event."""
    return {
        f"{INCIDENT}cause": cause,
        f"{INCIDENT}failed_at": f"{failed_at:.6f}",
        f"{INCIDENT}detected_at": f"{detected_at:.6f}",
        f"{INCIDENT}lost_steps": str(max(0, lost_steps)),
    }


def account(events: Iterable[JobEvent], *, now: float, step_seconds: float) -> Goodput:
    """The account of a job whose events (oldest first) are ``events``, as of ``now``.
    ``step_seconds`` is the job's typical step time (what a redone step costs)."""
    out = Goodput()
    running_since: float | None = None
    groups: list[list[Incident]] = []  # incidents ended by the same resumption
    open_incidents: list[Incident] = []
    for event in events:
        attrs = event.attributes
        if f"{INCIDENT}failed_at" in attrs:
            failed_at = min(float(attrs[f"{INCIDENT}failed_at"]), event.time)
            detected_at = float(attrs.get(f"{INCIDENT}detected_at", failed_at))
            incident = Incident(
                cause=str(attrs.get(f"{INCIDENT}cause", "")),
                failed_at=failed_at,
                detected_at=min(max(detected_at, failed_at), event.time),
                decided_at=event.time,
                lost_steps=int(attrs.get(f"{INCIDENT}lost_steps", "0")),
            )
            if not open_incidents:
                groups.append(open_incidents)
            open_incidents.append(incident)
            out.incidents.append(incident)
            if running_since is not None:
                # Time after the failure was not productive: it is counted as detection.
                out.productive_seconds += max(0.0, failed_at - running_since)
                running_since = None
        if event.from_state == RUNNING and event.to_state != RUNNING and running_since is not None:
            out.productive_seconds += max(0.0, event.time - running_since)
            running_since = None
        if event.to_state == RUNNING:
            running_since = event.time
            for incident in open_incidents:
                incident.resumed_at = event.time
            open_incidents = []
    if running_since is not None:
        out.productive_seconds += max(0.0, now - running_since)
    for group in groups:
        # Failures that overlap (one during another's recovery) share their lost time.
        start = min(i.failed_at for i in group)
        noticed = min(i.detected_at for i in group)
        resumed = group[0].resumed_at
        end = resumed if resumed is not None else max(now, max(i.decided_at for i in group))
        out.detect_seconds += max(0.0, noticed - start)
        out.recovery_seconds += max(0.0, end - noticed)
        redo = max(i.lost_steps for i in group) * max(step_seconds, 0.0)
        out.recompute_seconds += redo
        out.productive_seconds -= redo
        if resumed is not None:
            out.recoveries += len(group)
    out.productive_seconds = max(0.0, out.productive_seconds)
    return out


def epoch(value: dt.datetime) -> float:
    """A stored timestamp as epoch seconds (naive means UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()
