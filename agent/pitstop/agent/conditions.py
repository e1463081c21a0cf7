"""Node conditions: what is wrong with a node beyond its GPUs (a node daemon that is
down), folded into the health every heartbeat carries.

The scheduler reads one verdict and one list of reasons per node; a condition adds its
reason and raises the verdict to its own where that is worse. Pure: nothing here reads
a clock, a device or the network.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from pitstop.health.verdict import worst_verdict
from pitstop.v1 import common_pb2


@dataclass(frozen=True)
class NodeCondition:
    """One thing wrong with the node: the verdict it calls for and why, in words."""

    verdict: common_pb2.HealthVerdict
    reason: str


class ConditionSource(Protocol):
    """A part of the agent that knows of conditions. `conditions` is asked once per
    heartbeat, so a source may report there what happened since the last one."""

    def conditions(self) -> list[NodeCondition]: ...


def with_conditions(
    health: common_pb2.NodeHealth, conditions: Iterable[NodeCondition]
) -> common_pb2.NodeHealth:
    """`health` with every condition's reason after the GPUs' reasons, and the worst of
    its verdict and theirs. A new message; `health` is not changed."""
    found = list(conditions)
    merged = common_pb2.NodeHealth()
    merged.CopyFrom(health)
    if not found:
        return merged
    merged.verdict = worst_verdict([health.verdict, *(c.verdict for c in found)])
    merged.reasons.extend(c.reason for c in found)
    return merged
