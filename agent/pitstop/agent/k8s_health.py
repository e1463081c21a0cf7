"""The node's health as Kubernetes sees it: a NodeCondition and a taint, the convention
node-problem-detector and NVIDIA's NVSentinel follow, so that other schedulers (the
default scheduler, Kueue, Volcano) avoid a node pitstop finds sick.

Pure: the agent's verdict and the Node as last read go in; the patch bodies to send come
out, built of the official client's models. Nothing here reads a clock or the network.

- HEALTHY and APPLICATION (a rank failed, the GPU is fine): condition False, no taint.
- DEGRADED (a node daemon is down, its ranks train on): condition True, a
  PreferNoSchedule taint: new work goes elsewhere where it can.
- WARNING (drain at the next checkpoint) and FATAL (replace now): condition True, a
  NoSchedule taint. NoExecute is never set: evicting the node's pods is pitstop's own
  decision (it moves the ranks to a spare), not the taint's.
- No fresh verdict (the agent has not judged the node lately): condition Unknown, and
  the taints stay as they are.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client import V1Node, V1NodeCondition, V1Taint

from pitstop.v1 import common_pb2

CONDITION_TYPE = "PitstopNodeProblem"
"""The condition's type; True means pitstop finds something wrong with the node."""
TAINT_KEY = "pitstop.io/node-problem"
"""The taint's key; its value is the verdict (degraded, warning, fatal)."""
MESSAGE_LIMIT = 1024
"""Longest condition message: the reasons, cut here."""

_V = common_pb2
_TAINTED: dict[int, tuple[str, str, str]] = {
    # verdict: (condition reason, taint value, taint effect)
    _V.HEALTH_VERDICT_DEGRADED: ("PitstopDegraded", "degraded", "PreferNoSchedule"),
    _V.HEALTH_VERDICT_WARNING: ("PitstopWarning", "warning", "NoSchedule"),
    _V.HEALTH_VERDICT_FATAL: ("PitstopFatal", "fatal", "NoSchedule"),
}


@dataclass(frozen=True)
class NodePatches:
    """What to send: `status` to nodes/status (always: re-applied every time), `spec` to
    the node (only when its taints must change; None otherwise)."""

    status: dict[str, Any]
    spec: dict[str, Any] | None


def node_condition(
    health: common_pb2.NodeHealth | None,
    now: datetime.datetime,
    previous: V1NodeCondition | None = None,
) -> V1NodeCondition:
    """The `PitstopNodeProblem` condition for `health` (None: no fresh verdict), heard
    `now`; it keeps `previous`'s transition time while its status stays the same."""
    if health is None:
        status, reason = "Unknown", "PitstopNoVerdict"
        message = "pitstop's agent has no recent verdict on this node"
    elif health.verdict in _TAINTED:
        status, reason = "True", _TAINTED[health.verdict][0]
        message = "; ".join(health.reasons) or _V.HealthVerdict.Name(health.verdict)
    else:
        status, reason = "False", "PitstopHealthy"
        message = "pitstop finds no problem with this node"
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    transition = now
    if previous is not None and previous.status == status and previous.last_transition_time:
        transition = previous.last_transition_time
    return V1NodeCondition(
        type=CONDITION_TYPE,
        status=status,
        reason=reason,
        message=message,
        last_heartbeat_time=now,
        last_transition_time=transition,
    )


def wanted_taint(health: common_pb2.NodeHealth) -> V1Taint | None:
    """pitstop's taint for `health`, or None for a node that should carry none."""
    if health.verdict not in _TAINTED:
        return None
    _, value, effect = _TAINTED[health.verdict]
    return V1Taint(key=TAINT_KEY, value=value, effect=effect)


def taints_after(
    current: Sequence[V1Taint], health: common_pb2.NodeHealth | None
) -> list[V1Taint] | None:
    """The node's whole taint list with pitstop's taint as `health` calls for (every
    other taint kept, in order), or None when nothing is to change: the taint is already
    right, or there is no fresh verdict."""
    if health is None:
        return None
    others = [t for t in current if t.key != TAINT_KEY]
    ours = [t for t in current if t.key == TAINT_KEY]
    wanted = wanted_taint(health)
    target = [] if wanted is None else [wanted]
    if [(t.value, t.effect) for t in ours] == [(t.value, t.effect) for t in target]:
        return None
    return [*others, *target]


def plan_patches(
    node: V1Node,
    health: common_pb2.NodeHealth | None,
    now: datetime.datetime,
    *,
    taints: bool,
) -> NodePatches:
    """The patches that bring `node` (as just read) to what `health` calls for.

    Both are strategic merge patches. The condition list merges by type, so the status
    patch names only pitstop's condition. The taint list has no merge key: the spec
    patch carries the whole list and the node's resourceVersion, so it fails (409)
    rather than drop a taint another controller added since the read.
    """
    conditions = (node.status.conditions if node.status else None) or []
    previous = next((c for c in conditions if c.type == CONDITION_TYPE), None)
    status = {"status": {"conditions": [node_condition(health, now, previous)]}}
    spec = None
    if taints:
        current = (node.spec.taints if node.spec else None) or []
        after = taints_after(current, health)
        if after is not None:
            version = node.metadata.resource_version if node.metadata else None
            spec = {"metadata": {"resourceVersion": version}, "spec": {"taints": after}}
    return NodePatches(status=status, spec=spec)


def topology_from_labels(
    labels: Mapping[str, str], keys: Mapping[str, Sequence[str]]
) -> dict[str, str]:
    """For each failure domain in `keys` (zone, block, ...), the value of the first of
    its label keys that `labels` carries non-empty; domains with none are left out."""
    found = {}
    for domain, candidates in keys.items():
        value = next((labels[k] for k in candidates if labels.get(k)), "")
        if value:
            found[domain] = value
    return found
