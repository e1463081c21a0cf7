"""The agent's Kubernetes I/O: publish the node's health on its Node object, and read the
Node's topology labels at start. The decisions are `k8s_health`'s; this module only
reads the Node, sends the patches it is given and keeps going.

Level-triggered, as a controller: every `kubernetes_publish_seconds` the Node is read
and the condition (and taint) re-applied from the latest verdict, whatever was sent
before; a new verdict is published within a second (new reasons with the same verdict
wait for the next round). A failed call costs a
log line and a count (`pitstop_agent_kubernetes_publish_failures_total`); the next
round tries again. It never touches the heartbeat path: it reads the verdict the last
heartbeat computed.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from pitstop.agent.config import AgentSettings
from pitstop.agent.metrics import AgentMetrics
from pitstop.v1 import common_pb2

# `kubernetes` (and `k8s_health`, built on its models) is imported only once `connect`
# has found it: an agent without the extra imports this module and says what to install.

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
"""How often the latest verdict is compared with the published one (no API call)."""
REQUEST_TIMEOUT_SECONDS = 10.0
"""Deadline of each call to the API server."""


class NodeApi(Protocol):
    """What the publisher needs of `kubernetes.client.CoreV1Api`."""

    def read_node(self, name: str, **kwargs: Any) -> Any: ...
    def patch_node(self, name: str, body: Any, **kwargs: Any) -> Any: ...
    def patch_node_status(self, name: str, body: Any, **kwargs: Any) -> Any: ...


class KubernetesUnavailable(RuntimeError):
    """The Kubernetes client or its credentials are missing; the message says what to do."""


def connect() -> NodeApi:
    """A CoreV1Api with the pod's service account (in a cluster), else the kubeconfig
    (`KUBECONFIG`, else ~/.kube/config)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesUnavailable(
            "kubernetes_node_conditions and kubernetes_topology_labels need the Kubernetes "
            "client: pip install 'pitstop[kubernetes]'"
        ) from None
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as in_cluster:
        try:
            config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG") or None,
                client_configuration=configuration,
            )
        except (config.ConfigException, OSError) as kubeconfig:
            raise KubernetesUnavailable(
                f"no Kubernetes credentials: not in a pod ({in_cluster}) and no usable "
                f"kubeconfig ({_first_line(kubeconfig)}); run the agent in a pod with a "
                "service account (the Helm chart's), or turn kubernetes_node_conditions and "
                "kubernetes_topology_labels off"
            ) from None
    api: NodeApi = client.CoreV1Api(client.ApiClient(configuration))
    return api


def node_name(settings: AgentSettings) -> str:
    """The Kubernetes Node this agent runs on."""
    return settings.kubernetes_node_name or settings.node_id


async def topology_from_node(settings: AgentSettings, api: NodeApi) -> dict[str, str]:
    """Zone, block, rack and nvlink_domain from the Node's labels, for those of them
    `settings` leaves empty; none (and a warning logged) when the Node cannot be read."""
    from pitstop.agent.k8s_health import topology_from_labels

    name = node_name(settings)
    try:
        node = await asyncio.to_thread(
            api.read_node, name, _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
    except Exception as exc:
        log.warning(
            "cannot read node %s's labels for zone, block and rack (%s: %s); going on "
            "without them: give --zone/--block/--rack or let the service account get nodes",
            name,
            type(exc).__name__,
            _first_line(exc),
        )
        return {}
    labels = (node.metadata.labels if node.metadata else None) or {}
    keys = {
        "zone": settings.kubernetes_zone_labels,
        "block": settings.kubernetes_block_labels,
        "rack": settings.kubernetes_rack_labels,
        "nvlink_domain": settings.kubernetes_nvlink_domain_labels,
    }
    found = topology_from_labels(labels, keys)
    return {k: v for k, v in found.items() if not getattr(settings, k)}


class NodeConditionPublisher:
    """Keeps the Node's `PitstopNodeProblem` condition (and taint) at the latest verdict."""

    def __init__(
        self,
        api: NodeApi,
        name: str,
        verdict: Callable[[], common_pb2.NodeHealth | None],
        metrics: AgentMetrics,
        *,
        interval: float,
        taints: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._name = name
        self._verdict = verdict
        self._metrics = metrics
        self._interval = interval
        self._taints = taints
        self._clock = clock
        # While the agent has no verdict (its stream to the scheduler is down, so no
        # heartbeat judges the node), the last one stands this long, then the condition
        # turns Unknown: a reconnect is no news, an outage is.
        self._grace = 3 * interval
        self._last: common_pb2.NodeHealth | None = None
        self._last_seen = 0.0
        self._published: int | None = None
        self.rounds = 0
        """Rounds that reached the API server (read the Node, patched what was due)."""

    def fresh_health(self) -> common_pb2.NodeHealth | None:
        """The latest verdict; the last one within the grace after it went; else None."""
        now = self._clock()
        latest = self._verdict()
        if latest is not None:
            self._last, self._last_seen = latest, now
            return latest
        if self._last is not None and now - self._last_seen <= self._grace:
            return self._last
        return None

    @staticmethod
    def _key(health: common_pb2.NodeHealth | None) -> int:
        # Only a new verdict goes out early: reasons that merely reword themselves (a
        # temperature) wait for the next round, or a fleet would patch every second.
        return -1 if health is None else health.verdict

    async def publish(self) -> None:
        """Read the Node and apply what the latest verdict calls for, once."""
        from pitstop.agent.k8s_health import plan_patches

        health = self.fresh_health()
        node = await asyncio.to_thread(
            self._api.read_node, self._name, _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
        now = datetime.datetime.fromtimestamp(self._clock(), datetime.UTC)
        patches = plan_patches(node, health, now, taints=self._taints)
        # The taints first: fenced by the resourceVersion just read, which the status
        # patch would move on.
        if patches.spec is not None:
            await asyncio.to_thread(
                self._api.patch_node,
                self._name,
                patches.spec,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        await asyncio.to_thread(
            self._api.patch_node_status,
            self._name,
            patches.status,
            _request_timeout=REQUEST_TIMEOUT_SECONDS,
        )
        self._published = self._key(health)
        self.rounds += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Publish every `interval`, and within a second of a new verdict, until `stop`."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            ok = False
            try:
                await self.publish()
                ok = True
            except Exception as exc:  # the API server away, a conflict, a denial
                self._metrics.kubernetes_publish_failures.labels(self._metrics.node_id).inc()
                log.warning(
                    "publishing node %s's health to Kubernetes failed (%s: %s); trying "
                    "again next round",
                    self._name,
                    type(exc).__name__,
                    _first_line(exc),
                )
            deadline = loop.time() + self._interval
            while not stop.is_set() and loop.time() < deadline:
                try:
                    await asyncio.wait_for(stop.wait(), min(POLL_SECONDS, self._interval))
                except TimeoutError:
                    # A new verdict goes out at once; after a failure, only next round.
                    if ok and self._key(self.fresh_health()) != self._published:
                        break


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""
