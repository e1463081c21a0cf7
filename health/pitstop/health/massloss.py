"""Mass loss: many nodes gone silent at once are a partition (or the scheduler's own
overload), not many failures.

A node whose stream ends while its host still answers is a failure: its agent is gone,
and it is replaced at once. A node that went *silent* (neither its stream nor its host
answers: a host without power, a cut network) may be one of many: a switch, a rack's
power, a partition between the nodes and the scheduler, or a scheduler too starved to
answer its streams' keepalive pings. As Kubernetes' node lifecycle controller stops
evicting when a large share of a zone goes unready, a job touched by a mass loss is
held: its ranks stay, nothing of it is replaced. It goes on when its nodes are back;
those still away after a longer deadline are replaced, a bounded number at a time.

Pure functions over plain data (no clock, no I/O): the leader's recovery pass counts the
silent nodes (lost silently within the window, or suspect: their stream ended and their
host has not answered yet) and asks these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class MassLossPolicy:
    """When silent losses are a mass loss, and what happens to the nodes that stay away.
    The scheduler's settings (`mass_loss_*`) fill it; see docs/operations.md."""

    nodes: int = 16
    """This many nodes silent within the window, fleet-wide, is a mass loss for every job
    they touch: a fleet of thousands loses a node every few hours, a rack (8 nodes) at
    worst, not two racks in seconds."""
    job_share: float = 0.5
    """More than this share of one job's nodes silent within the window (and at least
    two) is a mass loss for that job, whatever the fleet's count: a small job behind one
    switch."""
    window_seconds: float = 10.0
    """How far back a silent loss counts."""
    replace_after_seconds: float = 60.0
    """A held job's node still away this long after it was lost is replaced (with the
    nodes lost within `settle_seconds` after it)."""
    replace_batch: int = 16
    """At most this many such nodes are replaced per window, fleet-wide."""
    settle_seconds: float = 2.0
    """A node lost silently is replaced once it has been lost this long, not at once: a
    partition's streams end over a few seconds when the processes holding them are
    busy (7 s for 99 nodes cut at once beside 1,000 on two loaded cores), and the first
    of them must not be replaced before the rest count toward the mass loss. A node
    whose host answered (its agent is gone) or that reported its failure is not
    waited for."""

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError(f"mass_loss_nodes={self.nodes}: give 2 or more")
        if not 0 < self.job_share <= 1:
            raise ValueError(f"mass_loss_job_share={self.job_share}: give a share in (0, 1]")
        if self.window_seconds <= 0 or self.replace_after_seconds <= 0:
            raise ValueError("mass_loss_window_seconds and _replace_after_seconds: give > 0")
        if self.replace_batch < 1:
            raise ValueError(f"mass_loss_replace_batch={self.replace_batch}: give 1 or more")
        if not 0 <= self.settle_seconds < self.window_seconds:
            raise ValueError(
                f"mass_loss_settle_seconds={self.settle_seconds}: give 0 or more, and less "
                f"than mass_loss_window_seconds ({self.window_seconds})"
            )


def touches_job(policy: MassLossPolicy, fleet_silent: int, job_silent: int, job_nodes: int) -> bool:
    """Whether a job with `job_silent` of its `job_nodes` nodes silent (within the
    window), in a fleet with `fleet_silent` silent, is held. A single silent node is
    never a mass loss for its job alone: it is a dead host, and replaced."""
    if job_silent <= 0:
        return False
    if fleet_silent >= policy.nodes:
        return True
    return job_silent >= 2 and job_silent > policy.job_share * job_nodes


def settling(policy: MassLossPolicy, silent_away: Mapping[str, float]) -> set[str]:
    """The nodes lost silently (`silent_away`: node -> seconds since) that are too
    recent to replace yet: the rest of a partition may still be on its way."""
    return {n for n, away in silent_away.items() if away < policy.settle_seconds}


def due_replacements(
    policy: MassLossPolicy, away_seconds: Mapping[str, float], budget: int
) -> list[str]:
    """The held job's nodes to replace now: those away for `replace_after_seconds` or
    longer, and with them those lost within `settle_seconds` of the longest away (the
    same partition, confirmed lost a moment later: replaced in the same decision, not
    one reconfiguration each); the longest away first, at most `budget` (what the
    window's batch has left). Ties go by node id, so every leader picks the same."""
    if not away_seconds:
        return []
    longest = max(away_seconds.values())
    if longest < policy.replace_after_seconds:
        return []
    reach = min(policy.replace_after_seconds, longest - policy.settle_seconds)
    due = [n for n, away in away_seconds.items() if away >= reach]
    due.sort(key=lambda n: (-away_seconds[n], n))
    return due[: max(budget, 0)]


def batch_left(policy: MassLossPolicy, replaced_in_window: int) -> int:
    """How many more nodes of held jobs may be replaced in this window."""
    return max(policy.replace_batch - replaced_in_window, 0)
