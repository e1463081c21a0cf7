"""The agent's Kubernetes side: its health published as a NodeCondition and a taint, and
its zone, block and rack read from the Node's labels.

The official client talks real HTTP to `kube_api`, a stand-in for the API server's
Node endpoints (no API server runs here): what is checked is what the client sends, as
an API server would receive it, and what the agent does with the Node it reads.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from kit.agents import running_agent
from kit.kube_api import NodeStore, gpu_node, kube_api, write_kubeconfig
from kit.schedulers import SchedulerThread
from kit.stores import unique
from kit.waits import until
from pitstop.agent.config import AgentSettings
from pitstop.agent.k8s_publisher import NodeConditionPublisher, connect
from pitstop.agent.metrics import AgentMetrics
from pitstop.client.launch import agent_command, clean_env
from pitstop.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

TIMEOUT = 15.0
STRATEGIC_MERGE = "application/strategic-merge-patch+json"

HEALTHY = common_pb2.NodeHealth(verdict=common_pb2.HEALTH_VERDICT_HEALTHY)
FATAL = common_pb2.NodeHealth(verdict=common_pb2.HEALTH_VERDICT_FATAL, reasons=["GPU 2: lost"])


def core_api(url: str) -> Any:
    return client.CoreV1Api(client.ApiClient(client.Configuration(host=url)))


def our_taints(store: NodeStore) -> list[tuple[str, str]]:
    return [
        (t.get("value", ""), t["effect"]) for t in store.taints() if t["key"].startswith("pitstop")
    ]


async def test_the_publisher_patches_the_node_and_its_status_by_strategic_merge() -> None:
    verdict = FATAL
    with kube_api(gpu_node("gpu-1")) as (url, store):
        publisher = NodeConditionPublisher(
            core_api(url), "gpu-1", lambda: verdict, AgentMetrics("gpu-1"), interval=10, taints=True
        )
        await publisher.publish()
        assert [(r.method, r.path) for r in store.requests] == [
            ("GET", "/api/v1/nodes/gpu-1"),
            ("PATCH", "/api/v1/nodes/gpu-1"),  # fenced by the version read: before the status
            ("PATCH", "/api/v1/nodes/gpu-1/status"),
        ]
        assert {r.content_type for r in store.patches()} == {STRATEGIC_MERGE}
        condition = store.condition("PitstopNodeProblem")
        assert condition is not None
        assert (condition["status"], condition["reason"], condition["message"]) == (
            "True",
            "PitstopFatal",
            "GPU 2: lost",
        )
        assert store.condition("Ready") is not None, "the kubelet's conditions stay"
        assert store.taints() == [
            {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
            {"key": "pitstop.io/node-problem", "value": "fatal", "effect": "NoSchedule"},
        ]

        verdict = HEALTHY  # the node heals: the taint goes, the condition turns False
        await publisher.publish()
        assert our_taints(store) == []
        assert [t["key"] for t in store.taints()] == ["nvidia.com/gpu"]
        condition = store.condition("PitstopNodeProblem")
        assert condition is not None
        assert (condition["status"], condition["reason"]) == ("False", "PitstopHealthy")
        # Healthy and untainted: the next round patches the status only.
        before = len(store.patches())
        await publisher.publish()
        assert [r.path for r in store.patches()[before:]] == ["/api/v1/nodes/gpu-1/status"]


async def test_the_publisher_re_applies_every_round_and_outlives_api_failures() -> None:
    verdict = HEALTHY
    metrics = AgentMetrics("gpu-1")

    def failures() -> float:
        sample = "pitstop_agent_kubernetes_publish_failures_total"
        return metrics.registry.get_sample_value(sample, {"node": "gpu-1"}) or 0.0

    with kube_api(gpu_node("gpu-1")) as (url, store):
        publisher = NodeConditionPublisher(
            core_api(url), "gpu-1", lambda: verdict, metrics, interval=0.2, taints=True
        )
        stop = asyncio.Event()
        task = asyncio.create_task(publisher.run(stop))
        try:
            await until(lambda: publisher.rounds >= 3, "three rounds, one every 0.2 s", TIMEOUT)
            store.fail_with = 500  # the API server away
            await until(lambda: failures() >= 2, "failures counted, rounds going on", TIMEOUT)
            store.fail_with = 0
            rounds = publisher.rounds
            await until(
                lambda: publisher.rounds > rounds, "a round after the API came back", TIMEOUT
            )
        finally:
            stop.set()
            await asyncio.wait_for(task, TIMEOUT)


async def test_a_new_verdict_is_published_within_a_second_not_a_period() -> None:
    verdict = HEALTHY
    with kube_api(gpu_node("gpu-1")) as (url, store):
        publisher = NodeConditionPublisher(
            core_api(url), "gpu-1", lambda: verdict, AgentMetrics("gpu-1"), interval=60, taints=True
        )
        stop = asyncio.Event()
        task = asyncio.create_task(publisher.run(stop))
        try:
            await until(lambda: publisher.rounds == 1, "the first round", TIMEOUT)
            verdict = FATAL
            await until(lambda: our_taints(store) == [("fatal", "NoSchedule")], "taint", 5.0)
        finally:
            stop.set()
            await asyncio.wait_for(task, TIMEOUT)


async def test_a_lost_verdict_stands_for_a_grace_then_turns_unknown() -> None:
    now = [1000.0]
    verdict: list[common_pb2.NodeHealth | None] = [FATAL]
    with kube_api(gpu_node("gpu-1")) as (url, store):
        publisher = NodeConditionPublisher(
            core_api(url),
            "gpu-1",
            lambda: verdict[0],
            AgentMetrics("gpu-1"),
            interval=10,
            taints=True,
            clock=lambda: now[0],
        )
        await publisher.publish()
        verdict[0] = None  # the scheduler stream broke: no heartbeat judges the node
        now[0] += 29  # within 3 periods: a reconnect, no news
        await publisher.publish()
        condition = store.condition("PitstopNodeProblem")
        assert condition is not None
        assert condition["reason"] == "PitstopFatal"
        now[0] += 2
        await publisher.publish()
        condition = store.condition("PitstopNodeProblem")
        assert condition is not None
        assert (condition["status"], condition["reason"]) == ("Unknown", "PitstopNoVerdict")
        assert our_taints(store) == [("fatal", "NoSchedule")], "taints stay without a verdict"


async def test_an_agent_publishes_its_health_and_registers_its_nodes_labels(
    scheduler: SchedulerThread, short_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = unique("gpu")
    labels = {
        "topology.kubernetes.io/zone": "us-east-1a",
        "cloud.google.com/gce-topology-block": "block-7",
        "cloud.google.com/gce-topology-subblock": "sub-3",
    }
    state_dir = short_dir  # a Unix socket's path is limited to 107 bytes
    with kube_api(gpu_node(name, labels)) as (url, store):
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", url)))
        settings = AgentSettings(
            node_id=name,
            scheduler=scheduler.address,
            gpus="sim:4",
            state_dir=state_dir,
            metrics_port=0,
            rack="given-rack",  # given: the label does not override it
            kubernetes_node_conditions=True,
            kubernetes_topology_labels=True,
            kubernetes_publish_seconds=0.5,
        )
        async with (
            running_agent(settings) as agent,
            grpc.aio.insecure_channel(scheduler.address) as channel,
        ):
            await agent.link.wait_registered(timeout=TIMEOUT)
            nodes = nodes_pb2_grpc.NodeServiceStub(channel)
            node = await nodes.Get(nodes_pb2.GetNodeRequest(node_id=name))
            assert (node.labels.zone, node.labels.block, node.labels.rack) == (
                "us-east-1a",
                "block-7",
                "given-rack",
            )

            def reason() -> str:
                condition = store.condition("PitstopNodeProblem")
                return "" if condition is None else str(condition["reason"])

            await until(lambda: reason() == "PitstopHealthy", "a healthy condition", TIMEOUT)
            assert our_taints(store) == []
            fault = common_pb2.Fault(gpu_index=2, gpu_lost=True)
            await nodes.InjectFault(nodes_pb2.InjectFaultRequest(node_id=name, fault=fault))
            await until(
                lambda: (
                    reason() == "PitstopFatal" and our_taints(store) == [("fatal", "NoSchedule")]
                ),
                "the fatal condition and the taint",  # the taint goes first, then the status
                TIMEOUT,
            )
            condition = store.condition("PitstopNodeProblem")
            assert condition is not None
            assert "GPU 2: lost" in condition["message"]


def test_an_agent_asked_to_publish_outside_kubernetes_says_what_is_missing(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in clean_env().items() if not k.startswith("KUBERNETES_")}
    env.update(
        HOME=str(tmp_path),
        KUBECONFIG=str(tmp_path / "no-such-kubeconfig"),
        PITSTOP_AGENT_KUBERNETES_NODE_CONDITIONS="true",
    )
    result = subprocess.run(
        agent_command(gpus="sim:1", state_dir=tmp_path / "s"),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "no Kubernetes credentials" in result.stderr
    assert "kubernetes_node_conditions" in result.stderr
    assert "Traceback" not in result.stderr


def test_connect_uses_the_kubeconfig_outside_a_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with kube_api(gpu_node("gpu-9")) as (url, store):
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", url)))
        api = connect()
        assert api.read_node("gpu-9").metadata.name == "gpu-9"
        assert store.requests[-1].path == "/api/v1/nodes/gpu-9"
