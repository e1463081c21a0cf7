"""The node's health as a Kubernetes NodeCondition and taint (pitstop.agent.k8s_health),
checked on the official client's models and on the JSON the client would send."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.client import (
    ApiClient,
    V1Node,
    V1NodeCondition,
    V1NodeSpec,
    V1NodeStatus,
    V1ObjectMeta,
    V1Taint,
)

from pitstop.agent.config import AgentSettings
from pitstop.agent.k8s_health import (
    CONDITION_TYPE,
    MESSAGE_LIMIT,
    TAINT_KEY,
    plan_patches,
    taints_after,
    topology_from_labels,
)
from pitstop.v1 import common_pb2

T0 = datetime.datetime(2026, 11, 26, 8, 0, 0, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(seconds=10)
NVIDIA_TAINT = V1Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")
OTHER_TAINT = V1Taint(key="node.kubernetes.io/unschedulable", effect="NoSchedule")


def health(verdict: int, *reasons: str) -> common_pb2.NodeHealth:
    return common_pb2.NodeHealth(verdict=verdict, reasons=list(reasons))


def node(
    taints: list[V1Taint] | None = None, conditions: list[V1NodeCondition] | None = None
) -> V1Node:
    return V1Node(
        metadata=V1ObjectMeta(name="gpu-1", resource_version="4711"),
        spec=V1NodeSpec(taints=taints),
        status=V1NodeStatus(conditions=conditions),
    )


def wire(body: Any) -> Any:
    """What the client sends for `body`."""
    return ApiClient().sanitize_for_serialization(body)


HEALTHY = health(common_pb2.HEALTH_VERDICT_HEALTHY)
FATAL = health(common_pb2.HEALTH_VERDICT_FATAL, "GPU 2: lost", "GPU 3: Xid 79")


def test_a_healthy_node_gets_a_false_condition_and_no_taint() -> None:
    patches = plan_patches(node(taints=[NVIDIA_TAINT]), HEALTHY, T0, taints=True)
    assert wire(patches.status) == {
        "status": {
            "conditions": [
                {
                    "type": "PitstopNodeProblem",
                    "status": "False",
                    "reason": "PitstopHealthy",
                    "message": "pitstop finds no problem with this node",
                    "lastHeartbeatTime": "2026-11-26T08:00:00+00:00",
                    "lastTransitionTime": "2026-11-26T08:00:00+00:00",
                }
            ]
        }
    }
    assert patches.spec is None  # nothing of ours to remove: the taints are not touched


def test_a_fatal_node_is_tainted_no_schedule_and_keeps_the_other_taints() -> None:
    patches = plan_patches(node(taints=[NVIDIA_TAINT, OTHER_TAINT]), FATAL, T0, taints=True)
    (condition,) = wire(patches.status)["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("True", "PitstopFatal")
    assert condition["message"] == "GPU 2: lost; GPU 3: Xid 79"
    assert patches.spec is not None
    assert wire(patches.spec) == {
        # The whole list goes out (taints have no merge key), fenced by the version read.
        "metadata": {"resourceVersion": "4711"},
        "spec": {
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
                {"key": "pitstop.io/node-problem", "value": "fatal", "effect": "NoSchedule"},
            ]
        },
    }


@pytest.mark.parametrize(
    ("verdict", "status", "reason", "taint"),
    [
        (common_pb2.HEALTH_VERDICT_HEALTHY, "False", "PitstopHealthy", None),
        # A rank failed on a good GPU: restarted in place, the node is fine.
        (common_pb2.HEALTH_VERDICT_APPLICATION, "False", "PitstopHealthy", None),
        # A node daemon is down, the ranks train on: new work had better go elsewhere.
        (
            common_pb2.HEALTH_VERDICT_DEGRADED,
            "True",
            "PitstopDegraded",
            ("degraded", "PreferNoSchedule"),
        ),
        # Drained at the next checkpoint, or replaced now: no new work here.
        (common_pb2.HEALTH_VERDICT_WARNING, "True", "PitstopWarning", ("warning", "NoSchedule")),
        (common_pb2.HEALTH_VERDICT_FATAL, "True", "PitstopFatal", ("fatal", "NoSchedule")),
    ],
)
def test_each_verdict_maps_to_its_condition_and_taint(
    verdict: int, status: str, reason: str, taint: tuple[str, str] | None
) -> None:
    patches = plan_patches(node(), health(verdict, "why"), T0, taints=True)
    (condition,) = patches.status["status"]["conditions"]
    assert (condition.type, condition.status, condition.reason) == (CONDITION_TYPE, status, reason)
    if taint is None:
        assert patches.spec is None
    else:
        assert patches.spec is not None
        (ours,) = patches.spec["spec"]["taints"]
        assert (ours.key, ours.value, ours.effect) == (TAINT_KEY, *taint)


def test_a_node_that_recovers_loses_pitstops_taint_only() -> None:
    ours = V1Taint(key=TAINT_KEY, value="fatal", effect="NoSchedule")
    patches = plan_patches(node(taints=[NVIDIA_TAINT, ours]), HEALTHY, T0, taints=True)
    assert patches.spec is not None
    assert wire(patches.spec)["spec"] == {
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    }
    # The last taint gone: an empty list, which clears the field.
    patches = plan_patches(node(taints=[ours]), HEALTHY, T0, taints=True)
    assert patches.spec is not None
    assert wire(patches.spec)["spec"] == {"taints": []}


def test_a_fatal_node_that_improves_to_degraded_swaps_its_taint() -> None:
    ours = V1Taint(key=TAINT_KEY, value="fatal", effect="NoSchedule")
    degraded = health(common_pb2.HEALTH_VERDICT_DEGRADED, "checkpoint daemon down")
    after = taints_after([ours, NVIDIA_TAINT], degraded)
    assert after is not None
    assert [(t.key, t.value, t.effect) for t in after] == [
        ("nvidia.com/gpu", "present", "NoSchedule"),
        (TAINT_KEY, "degraded", "PreferNoSchedule"),
    ]


def test_the_status_is_re_applied_every_time_and_the_taint_only_when_it_changes() -> None:
    ours = V1Taint(key=TAINT_KEY, value="fatal", effect="NoSchedule")
    patches = plan_patches(node(taints=[ours]), FATAL, T0, taints=True)
    assert patches.spec is None
    assert patches.status["status"]["conditions"][0].status == "True"


def test_the_transition_time_moves_only_when_the_status_does() -> None:
    first = plan_patches(node(), FATAL, T0, taints=True).status["status"]["conditions"][0]
    same = plan_patches(node(conditions=[first]), FATAL, T1, taints=True)
    (again,) = same.status["status"]["conditions"]
    assert (again.last_transition_time, again.last_heartbeat_time) == (T0, T1)
    healed = plan_patches(node(conditions=[again]), HEALTHY, T1, taints=True)
    (cleared,) = healed.status["status"]["conditions"]
    assert (cleared.status, cleared.last_transition_time) == ("False", T1)


def test_without_a_fresh_verdict_the_condition_is_unknown_and_the_taints_stay() -> None:
    ours = V1Taint(key=TAINT_KEY, value="fatal", effect="NoSchedule")
    patches = plan_patches(node(taints=[ours]), None, T0, taints=True)
    (condition,) = patches.status["status"]["conditions"]
    assert (condition.status, condition.reason) == ("Unknown", "PitstopNoVerdict")
    assert patches.spec is None


def test_taints_can_be_left_to_another_controller() -> None:
    patches = plan_patches(node(), FATAL, T0, taints=False)
    assert patches.spec is None
    assert patches.status["status"]["conditions"][0].reason == "PitstopFatal"


def test_a_long_message_is_cut() -> None:
    many = health(common_pb2.HEALTH_VERDICT_WARNING, *(f"GPU {i}: " + "x" * 200 for i in range(8)))
    (condition,) = plan_patches(node(), many, T0, taints=True).status["status"]["conditions"]
    assert len(condition.message) == MESSAGE_LIMIT
    assert condition.message.startswith("GPU 0: x")
    assert condition.message.endswith("...")


_VERDICTS = st.sampled_from(
    [None, *(v for v in common_pb2.HealthVerdict.values() if v)]  # None: no fresh verdict
)
_TAINTS = st.lists(
    st.builds(
        V1Taint,
        key=st.sampled_from([TAINT_KEY, "nvidia.com/gpu", "example.com/a", "example.com/b"]),
        value=st.sampled_from([None, "fatal", "warning", "degraded", "x"]),
        effect=st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
    ),
    max_size=5,
)


@given(current=_TAINTS, verdict=_VERDICTS)
def test_applying_the_plan_leaves_exactly_pitstops_taint_and_every_other(
    current: list[V1Taint], verdict: int | None
) -> None:
    state = None if verdict is None else health(verdict)
    after = taints_after(current, state)
    result = current if after is None else after
    others = [t for t in current if t.key != TAINT_KEY]
    assert [t for t in result if t.key != TAINT_KEY] == others
    if state is None:
        assert after is None
        return
    ours = [(t.value, t.effect) for t in result if t.key == TAINT_KEY]
    tainting = verdict in (
        common_pb2.HEALTH_VERDICT_DEGRADED,
        common_pb2.HEALTH_VERDICT_WARNING,
        common_pb2.HEALTH_VERDICT_FATAL,
    )
    assert len(ours) == (1 if tainting else 0)
    # Level-triggered: once applied, the next round changes nothing.
    assert taints_after(result, state) is None


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({}, {}),
        (
            {"topology.kubernetes.io/zone": "us-east-1a", "nvidia.com/gpu.clique": "c1.7"},
            {"zone": "us-east-1a", "nvlink_domain": "c1.7"},
        ),
        # GKE's block and sub-block.
        (
            {
                "cloud.google.com/gce-topology-block": "b-9",
                "cloud.google.com/gce-topology-subblock": "sb-3",
            },
            {"block": "b-9", "rack": "sb-3"},
        ),
        # EKS's network node layers; an empty label counts as none.
        (
            {
                "topology.k8s.aws/network-node-layer-2": "nn-2",
                "topology.k8s.aws/network-node-layer-3": "nn-3",
                "cloud.google.com/gce-topology-block": "",
            },
            {"block": "nn-2", "rack": "nn-3"},
        ),
    ],
)
def test_topology_comes_from_the_first_label_present(
    labels: dict[str, str], expected: dict[str, str]
) -> None:
    defaults = AgentSettings(node_id="n", gpus="sim:1")
    keys = {
        "zone": defaults.kubernetes_zone_labels,
        "block": defaults.kubernetes_block_labels,
        "rack": defaults.kubernetes_rack_labels,
        "nvlink_domain": defaults.kubernetes_nvlink_domain_labels,
    }
    assert topology_from_labels(labels, keys) == expected


def test_label_keys_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PITSTOP_AGENT_KUBERNETES_RACK_LABELS", '["example.com/rack"]')
    monkeypatch.setenv("PITSTOP_AGENT_KUBERNETES_NODE_CONDITIONS", "true")
    settings = AgentSettings(node_id="n", gpus="sim:1")
    assert settings.kubernetes_rack_labels == ["example.com/rack"]
    assert settings.kubernetes_node_conditions
    assert settings.kubernetes_taints  # on by default with the conditions
    assert topology_from_labels({"example.com/rack": "r9"}, {"rack": ["example.com/rack"]}) == {
        "rack": "r9"
    }
