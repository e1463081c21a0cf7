"""The agent's Prometheus metrics and the small HTTP server for /metrics and /healthz.

Metrics live in the agent's own registry, not the process-global one, so two agents in
one process (the tests) never collide. NVML counters (ECC, remapped rows, NVLink errors)
are exported as gauges of the driver's cumulative counts: they are readings that can
reset with a driver reload, not events this process counted.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import threading
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from pitstop.agent.host.metrics import HostMetrics
from pitstop.v1 import common_pb2

log = logging.getLogger(__name__)

_PREFIX = "pitstop_agent_"
_GPU = ("node", "gpu", "uuid")

VERDICT_VALUES = {
    common_pb2.HEALTH_VERDICT_UNSPECIFIED: 0,
    common_pb2.HEALTH_VERDICT_HEALTHY: 0,
    common_pb2.HEALTH_VERDICT_APPLICATION: 1,
    common_pb2.HEALTH_VERDICT_WARNING: 2,
    common_pb2.HEALTH_VERDICT_FATAL: 3,
    common_pb2.HEALTH_VERDICT_DEGRADED: 0,  # a node's daemon, never a GPU's verdict
}
"""Value of the GPU verdict gauge: 0 healthy, 1 application, 2 warning, 3 fatal."""


class AgentMetrics:
    """Every metric of one agent (node `node_id`), in a registry of its own."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry(auto_describe=True)
        self._connected = False
        r = self.registry

        def gpu_gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(_PREFIX + name, doc, [*_GPU, *extra], registry=r)

        self.temperature = gpu_gauge("gpu_temperature_celsius", "GPU core temperature.")
        self.power = gpu_gauge("gpu_power_watts", "GPU power draw.")
        self.utilization = gpu_gauge(
            "gpu_utilization_ratio",
            "Share of the last sample period a kernel ran on the GPU (NVML), 0 to 1.",
        )
        self.memory_used = gpu_gauge("gpu_memory_used_bytes", "GPU device memory in use.")
        self.ecc_errors = gpu_gauge(
            "gpu_ecc_errors",
            "ECC error count as NVML reports it (cumulative reading, may reset with the driver).",
            "type",
            "scope",
        )
        self.remapped_rows = gpu_gauge(
            "gpu_remapped_rows", "Rows remapped, by cause (cumulative reading).", "cause"
        )
        self.remap_pending = gpu_gauge("gpu_remapped_rows_pending", "1 while a remap waits.")
        self.remap_failure = gpu_gauge("gpu_remapped_rows_failure", "1 if a row remap failed.")
        self.nvlink_errors = gpu_gauge(
            "gpu_nvlink_errors",
            "NVLink error count per link and kind (cumulative reading).",
            "link",
            "kind",
        )
        self.nvlink_active = gpu_gauge("gpu_nvlink_active", "1 while the link is up.", "link")
        self.lost = gpu_gauge("gpu_lost", "1 when the GPU fell off the bus or NVML lost it.")
        self.verdict = gpu_gauge(
            "gpu_verdict", "Agent verdict: 0 healthy, 1 application, 2 warning, 3 fatal."
        )
        self.xids = Counter(
            _PREFIX + "xid_total", "Xid errors reported by the driver.", [*_GPU, "xid"], registry=r
        )
        node = ("node",)
        self.heartbeats = Counter(
            _PREFIX + "heartbeats_sent_total", "Heartbeats sent.", node, registry=r
        )
        self.scheduler_connected = Gauge(
            _PREFIX + "scheduler_connected",
            "1 while the scheduler stream is registered.",
            node,
            registry=r,
        )
        self.reconnects = Counter(
            _PREFIX + "reconnects_total",
            "Registrations on a new scheduler stream after a lost one.",
            node,
            registry=r,
        )
        self.ranks_running = Gauge(
            _PREFIX + "ranks_running", "Rank processes supervised now.", node, registry=r
        )
        self.rank_exits = Counter(
            _PREFIX + "rank_exits_total",
            "Rank processes that ended.",
            ("node", "job_id"),
            registry=r,
        )
        self.findings = Counter(
            _PREFIX + "integrity_findings_total",
            "Integrity findings the node's ranks reported, by kind: sdc (a corrupt replica "
            "named), sdc_unlocated, nonfinite and spike (each rolled back).",
            ("node", "kind"),
            registry=r,
        )
        self.steps_reported = Counter(
            _PREFIX + "steps_reported_total",
            "Step samples summarized and sent to the scheduler.",
            ("node", "job_id"),
            registry=r,
        )
        self.samples_dropped = Counter(
            _PREFIX + "step_samples_dropped_total",
            "Straggler-window summaries dropped because the buffer was full (scheduler "
            "unreachable).",
            node,
            registry=r,
        )
        self.commands = Counter(
            _PREFIX + "commands_total",
            "Scheduler commands handled, by kind and result (ok or error).",
            ("node", "command", "result"),
            registry=r,
        )
        self.drains = Counter(
            _PREFIX + "drain_requests_total", "Drain commands received.", node, registry=r
        )
        self.checkpointd_up = Gauge(
            _PREFIX + "checkpointd_up",
            "1 while this node's checkpoint daemon answers the agent's probes, 0 while it "
            "is down; absent until the first probes decide.",
            ("node", "address"),
            registry=r,
        )
        self.checkpointd_restarts = Counter(
            _PREFIX + "checkpointd_restarts_total",
            "Times the agent started this node's checkpoint daemon again (owned daemons only).",
            node,
            registry=r,
        )
        self.kubernetes_publish_failures = Counter(
            _PREFIX + "kubernetes_publish_failures_total",
            "Publications of the node's condition and taint to Kubernetes that failed "
            "(the next one, a second to a period later, tries again).",
            node,
            registry=r,
        )
        self.host = HostMetrics(r, node_id)
        self.scheduler_connected.labels(node_id).set(0)
        for counter in (
            self.heartbeats,
            self.reconnects,
            self.samples_dropped,
            self.drains,
            self.checkpointd_restarts,
            self.kubernetes_publish_failures,
        ):
            counter.labels(node_id)

    @property
    def connected(self) -> bool:
        """Whether the scheduler stream is registered now (what /healthz reports)."""
        return self._connected

    def set_connected(self, connected: bool) -> None:
        """Record whether the scheduler stream is registered."""
        self._connected = connected
        self.scheduler_connected.labels(self.node_id).set(1 if connected else 0)

    def observe_xid(self, event: common_pb2.XidEvent) -> None:
        """Count one Xid from the driver."""
        self.xids.labels(self.node_id, str(event.gpu_index), event.gpu_uuid, str(event.xid)).inc()

    def observe_health(self, gpus: Iterable[common_pb2.GpuHealth]) -> None:
        """Set the per-GPU gauges from assessed readings (verdict set)."""
        for gpu in gpus:
            labels = (self.node_id, str(gpu.index), gpu.uuid)
            self.lost.labels(*labels).set(1 if gpu.lost else 0)
            self.verdict.labels(*labels).set(VERDICT_VALUES.get(gpu.verdict, 0))
            unsupported = set(gpu.unsupported)
            if gpu.lost:
                # A lost GPU reads as zeros; keep the last real values out of the way.
                _remove(self.temperature, labels)
                _remove(self.power, labels)
                _remove(self.utilization, labels)
                _remove(self.memory_used, labels)
                continue
            _set(self.temperature, labels, gpu.temperature_c, "temperature_c" in unsupported)
            _set(self.power, labels, gpu.power_w, "power_w" in unsupported)
            busy = gpu.utilization_percent / 100.0
            _set(self.utilization, labels, busy, "utilization_percent" in unsupported)
            used = gpu.memory_used_bytes
            _set(self.memory_used, labels, used, "memory_used_bytes" in unsupported)
            for kind in ("corrected", "uncorrected"):
                for scope in ("volatile", "aggregate"):
                    field = f"ecc_{kind}_{scope}"
                    value = getattr(gpu, field)
                    _set(self.ecc_errors, (*labels, kind, scope), value, field in unsupported)
            for cause in ("correctable", "uncorrectable"):
                field = f"remapped_rows_{cause}"
                value = getattr(gpu, field)
                _set(self.remapped_rows, (*labels, cause), value, field in unsupported)
            pending, failed = gpu.remapped_rows_pending, gpu.remapped_rows_failure
            _set(self.remap_pending, labels, pending, "remapped_rows_pending" in unsupported)
            _set(self.remap_failure, labels, failed, "remapped_rows_failure" in unsupported)
            if "nvlinks" in unsupported:
                continue
            for link in gpu.nvlinks:
                link_labels = (*labels, str(link.link))
                self.nvlink_active.labels(*link_labels).set(1 if link.active else 0)
                for kind in ("crc", "replay", "recovery"):
                    value = getattr(link, f"{kind}_errors")
                    self.nvlink_errors.labels(*link_labels, kind).set(value)

    def observe_host(self, host: common_pb2.HostHealth) -> None:
        """Set the host gauges (pitstop_host_*) from an assessed host reading."""
        self.host.observe(host)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


def _set(gauge: Gauge, labels: tuple[str, ...], value: float, unsupported: bool) -> None:
    if unsupported:
        _remove(gauge, labels)
    else:
        gauge.labels(*labels).set(float(value))


def _remove(gauge: Gauge, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)


class MetricsServer:
    """Serves /metrics and /healthz for `metrics` on host:port (0 picks a free port).

    The serving thread is not a daemon: `shutdown` stops and joins it.
    """

    def __init__(self, metrics: AgentMetrics, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = _handler_for(metrics)
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=False
        )

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """http://host:port/metrics."""
        host, port = self.address
        return f"http://{host}:{port}/metrics"

    def start(self) -> None:
        """Start serving in the background."""
        self._thread.start()

    def shutdown(self) -> None:
        """Stop serving, close the socket and join the thread. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def _handler_for(metrics: AgentMetrics) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, metrics.render(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                if metrics.connected:
                    self._reply(200, b"ok\n", "text/plain; charset=utf-8")
                else:
                    body = b"not connected to the scheduler\n"
                    self._reply(503, body, "text/plain; charset=utf-8")
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics http: " + format, *args)

    return Handler
