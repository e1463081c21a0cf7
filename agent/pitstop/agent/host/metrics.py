"""The agent's Prometheus gauges of its node's host: links, memory, disks, PCIe devices.

One gauge per signal, labelled by node (and link, device or path), set from each host
reading (`HostMetrics.observe`). The kernel's counters (a link's downs and errors, EDAC
and AER counts, the OOM kills the agent saw) are exported as gauges of the reading, not
as `_total` counters: they are counts the kernel (or the agent, for OOM kills) keeps and
that reset with a reboot, a driver reload or an agent restart, so a rule reads their
growth with `delta` and a reset shows as a drop, never as a counter's false increase.

A source the host lacks (named in the reading's `unsupported`: links, edac, psi, oom,
disks, aer) has no series, rather than a zero that reads as healthy; a link, device or
path that vanishes from the readings has its series removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge

from pitstop.v1 import common_pb2

_PREFIX = "pitstop_host_"
_LINK = ("node", "link", "kind")
_DEVICE = ("node", "device", "role")
_DISK = ("node", "path")
AER_TYPES = ("correctable", "nonfatal", "fatal")
"""The `type` label of pitstop_host_pcie_aer_errors: the AER severities. Not a label named
`severity`, which every alert sets (and would overwrite) for Alertmanager's routing."""

Labels = tuple[str, ...]


HOST_VERDICT_VALUES = {
    common_pb2.HEALTH_VERDICT_UNSPECIFIED: 0,
    common_pb2.HEALTH_VERDICT_HEALTHY: 0,
    common_pb2.HEALTH_VERDICT_DEGRADED: 1,
    common_pb2.HEALTH_VERDICT_APPLICATION: 1,
    common_pb2.HEALTH_VERDICT_WARNING: 2,
    common_pb2.HEALTH_VERDICT_FATAL: 3,
}
"""Value of `pitstop_host_verdict`, on the GPU verdict gauge's scale where it acts: 0
healthy, 1 reported only (a low disk, memory pressure, a slower link; an OOM kill, whose
rank restarts), 2 drain, 3 replace."""


class HostMetrics:
    """The host gauges of one agent (node `node_id`), in the agent's registry."""

    def __init__(self, registry: CollectorRegistry, node_id: str) -> None:
        self.node_id = node_id
        self._verdicts = HOST_VERDICT_VALUES
        self._shown: dict[Gauge, set[Labels]] = {}

        def gauge(name: str, doc: str, labels: Labels = ("node",)) -> Gauge:
            made = Gauge(_PREFIX + name, doc, labels, registry=registry)
            self._shown[made] = set()
            return made

        self.verdict = gauge(
            "verdict",
            "The agent's verdict of the node's host: 0 healthy, 1 reported only (a low disk, "
            "memory pressure, a slower link, an OOM kill), 2 drain (warning), 3 replace (fatal).",
        )
        self.link_up = gauge("link_up", "1 while the network link is up, 0 while down.", _LINK)
        self.link_rate = gauge(
            "link_rate_gbps", "The link's current rate in Gb/s (0 where not reported).", _LINK
        )
        self.link_downs = gauge(
            "link_downs",
            "Times the link went down, as the kernel counts them (link_downed, "
            "carrier_down_count): a cumulative reading that resets with a reboot or a "
            "driver reload.",
            _LINK,
        )
        self.link_errors = gauge(
            "link_errors",
            "The link's error counters summed, as the kernel counts them (cumulative "
            "reading, resets with a reboot or a driver reload).",
            _LINK,
        )
        self.memory_pressure = gauge(
            "memory_pressure_full_avg10",
            "Memory pressure: percent (0 to 100) of the last 10 s every task stalled on "
            "memory (/proc/pressure/memory full avg10).",
        )
        self.edac_corrected = gauge(
            "memory_edac_corrected",
            "Corrected host memory errors (EDAC, summed over memory controllers; "
            "cumulative reading).",
        )
        self.edac_uncorrected = gauge(
            "memory_edac_uncorrected",
            "Uncorrected host memory errors (EDAC, summed over memory controllers; "
            "cumulative reading).",
        )
        self.oom_kills = gauge(
            "oom_kills",
            "Kernel OOM kills the agent has seen since it started (resets with the agent).",
        )
        self.disk_free = gauge(
            "disk_free_bytes", "Bytes free on a filesystem the daemons write to.", _DISK
        )
        self.disk_total = gauge("disk_total_bytes", "Size of the filesystem in bytes.", _DISK)
        self.disk_free_inodes = gauge("disk_free_inodes", "Inodes free on the filesystem.", _DISK)
        self.disk_total_inodes = gauge("disk_total_inodes", "Inodes of the filesystem.", _DISK)
        self.disk_read_only = gauge(
            "disk_read_only", "1 while the filesystem is mounted read-only.", _DISK
        )
        self.aer_errors = gauge(
            "pcie_aer_errors",
            "A PCIe device's AER error count by type, the AER severity (correctable, "
            "nonfatal, fatal; the kernel's cumulative reading).",
            (*_DEVICE, "type"),
        )
        self.pcie_width = gauge("pcie_link_width", "The PCIe link's current width.", _DEVICE)
        self.pcie_width_max = gauge(
            "pcie_link_width_max", "The widest the PCIe link can run.", _DEVICE
        )
        self.pcie_speed = gauge(
            "pcie_link_speed_gts", "The PCIe link's current speed in GT/s.", _DEVICE
        )
        self.pcie_speed_max = gauge(
            "pcie_link_speed_gts_max", "The fastest the PCIe link can run, in GT/s.", _DEVICE
        )

    def observe(self, host: common_pb2.HostHealth) -> None:
        """Set the gauges from one reading (assessed: its verdict set); remove the series
        of sources it names unsupported and of links, devices and paths it lacks."""
        skip = frozenset(host.unsupported)
        self._publish(self.verdict, {(): self._verdicts.get(host.verdict, 0)})
        links = [] if "links" in skip else list(host.links)
        self._publish(self.link_up, {_link(x): 1.0 if x.up else 0.0 for x in links})
        self._publish(self.link_rate, {_link(x): x.rate_gbps for x in links})
        self._publish(self.link_downs, {_link(x): x.down_count for x in links})
        self._publish(self.link_errors, {_link(x): x.error_count for x in links})
        memory = host.memory
        psi: dict[Labels, float] = {} if "psi" in skip else {(): memory.pressure_full_avg10}
        self._publish(self.memory_pressure, psi)
        edac = "edac" in skip
        self._publish(self.edac_corrected, {} if edac else {(): memory.edac_corrected})
        self._publish(self.edac_uncorrected, {} if edac else {(): memory.edac_uncorrected})
        self._publish(self.oom_kills, {} if "oom" in skip else {(): memory.oom_kills})
        disks = [] if "disks" in skip else list(host.disks)
        self._publish(self.disk_free, {(d.path,): d.free_bytes for d in disks})
        self._publish(self.disk_total, {(d.path,): d.total_bytes for d in disks})
        self._publish(self.disk_free_inodes, {(d.path,): d.free_inodes for d in disks})
        self._publish(self.disk_total_inodes, {(d.path,): d.total_inodes for d in disks})
        self._publish(self.disk_read_only, {(d.path,): d.read_only for d in disks})
        devices = list(host.pcie)
        aer = [] if "aer" in skip else devices
        self._publish(
            self.aer_errors,
            {(*_device(d), kind): getattr(d, f"aer_{kind}") for d in aer for kind in AER_TYPES},
        )
        self._publish(self.pcie_width, {_device(d): d.link_width for d in devices})
        self._publish(self.pcie_width_max, {_device(d): d.link_width_max for d in devices})
        self._publish(self.pcie_speed, {_device(d): d.link_speed_gts for d in devices})
        self._publish(self.pcie_speed_max, {_device(d): d.link_speed_gts_max for d in devices})

    def _publish(self, gauge: Gauge, values: Mapping[Labels, float]) -> None:
        """Set `gauge` to exactly `values` (labels after the node's): set each, remove the
        series of the last call that are not among them."""
        shown = self._shown[gauge]
        for labels in shown - values.keys():
            with contextlib.suppress(KeyError):
                gauge.remove(self.node_id, *labels)
        for labels, value in values.items():
            gauge.labels(self.node_id, *labels).set(float(value))
        self._shown[gauge] = set(values)


def _link(link: common_pb2.LinkReading) -> Labels:
    return (link.name, link.kind)


def _device(device: common_pb2.PcieDeviceReading) -> Labels:
    return (device.address, device.role)
