"""The fleet dashboard's "Host" row: each node's host around its GPUs as the agent reads it
(pitstop_host_*): network links, memory, the daemons' disks, PCIe devices.

The kernel's counters (link downs and errors, EDAC, AER) are gauges of its cumulative
count: growth is read with delta() (a reset reads as a drop, clamped to 0), as the alerts
of deploy/prometheus/alerts.yml read it."""

from __future__ import annotations

from scripts._dashboards_panels import VERDICTS, Dashboard, Json, panel, series, stat, target

LINK_WAS_UP = "max_over_time(pitstop_host_link_up[1d]) == 1"
"""A link up within the day: a port never cabled reads down forever and is no fault."""

DISK_FREE_SHARE = "pitstop_host_disk_free_bytes / (pitstop_host_disk_total_bytes > 0)"
PCIE_WIDTH_SHARE = "pitstop_host_pcie_link_width / (pitstop_host_pcie_link_width_max > 0)"
PCIE_SPEED_SHARE = "pitstop_host_pcie_link_speed_gts / (pitstop_host_pcie_link_speed_gts_max > 0)"


def _timeline(title: str, description: str, expr: str, legend: str, words: Json) -> Json:
    return panel(
        "state-timeline",
        title,
        description,
        [target(expr, legend)],
        mappings=[{"type": "value", "options": words}],
        options={"showValue": "never", "mergeValues": True, "rowHeight": 0.9},
    )


def host_row(d: Dashboard) -> None:
    d.row("Host")
    for title, description, expr, colour in (
        (
            "Hosts fatal",
            "Nodes whose host verdict is fatal now (a link down, uncorrected memory errors, "
            "a fatal PCIe error).",
            "count(pitstop_host_verdict == 3) or vector(0)",
            "red",
        ),
        (
            "Links down",
            "Network links down now that were up within the day.",
            f"count(pitstop_host_link_up == 0 and {LINK_WAS_UP}) or vector(0)",
            "red",
        ),
        (
            "OOM kills (1 h)",
            "Processes the kernels killed for host memory over the last hour.",
            "sum(clamp_min(delta(pitstop_host_oom_kills[1h]), 0)) or vector(0)",
            "orange",
        ),
        (
            "Disks under 5% free",
            "Filesystems the daemons write to with under 5% free: the checkpoint daemon "
            "refuses durable flushes there.",
            f"count({DISK_FREE_SHARE} < 0.05) or vector(0)",
            "orange",
        ),
        (
            "Disks read-only",
            "Filesystems the daemons write to that are mounted read-only.",
            "sum(pitstop_host_disk_read_only) or vector(0)",
            "orange",
        ),
        (
            "PCIe links degraded",
            "GPUs and NICs whose PCIe link runs narrower than its maximum.",
            "count((pitstop_host_pcie_link_width > 0) < pitstop_host_pcie_link_width_max) "
            "or vector(0)",
            "orange",
        ),
    ):
        d.add(
            stat(title, description, expr, decimals=0, thresholds=[(None, "green"), (1, colour)]),
            width=4,
            height=4,
        )
    d.add(
        panel(
            "state-timeline",
            "Host verdict per node",
            "Each node's host verdict as its agent judges it: healthy (a low disk or memory "
            "pressure too, which their panels show), application (an OOM kill), warning "
            "(a flap, link or PCIe errors, a degraded link), fatal.",
            [target("max by (node) (pitstop_host_verdict)", "{{node}}")],
            mappings=VERDICTS,
            thresholds=[(None, "green"), (1, "blue"), (2, "orange"), (3, "red")],
            options={"showValue": "never", "mergeValues": True, "rowHeight": 0.9},
        ),
        width=12,
    )
    d.add(
        _timeline(
            "Links up",
            "Each network link (InfiniBand/RoCE port, Ethernet interface): up or down.",
            "pitstop_host_link_up",
            "{{node}} {{link}}",
            {
                "0": {"text": "down", "color": "red", "index": 0},
                "1": {"text": "up", "color": "green", "index": 1},
            },
        ),
        width=12,
    )
    d.add(
        series(
            "Link rate",
            "Each link's current rate: a link that retrained slower (a lane lost) drops.",
            target("pitstop_host_link_rate_gbps", "{{node}} {{link}}"),
            unit="Gbits",
            minimum=0,
        ),
        width=8,
    )
    d.add(
        series(
            "Link downs (5 m)",
            "Times each link went down over the last 5 minutes (links that did only); "
            "three or more is a flap.",
            target(
                "clamp_min(delta(pitstop_host_link_downs[5m]), 0) > 0",
                "{{node}} {{link}}",
            ),
            decimals=0,
        ),
        width=8,
    )
    d.add(
        series(
            "Link errors (5 m)",
            "Growth of each link's error counters over the last 5 minutes (links with "
            "errors only): a failing cable or transceiver.",
            target(
                "clamp_min(delta(pitstop_host_link_errors[5m]), 0) > 0",
                "{{node}} {{link}}",
            ),
            decimals=0,
        ),
        width=8,
    )
    d.add(
        series(
            "Memory pressure (full avg10)",
            "Percent of the last 10 s every task of the node stalled on memory; 20% or "
            "more is reported.",
            target("pitstop_host_memory_pressure_full_avg10", "{{node}}"),
            unit="percent",
            minimum=0,
        ),
        width=8,
    )
    d.add(
        series(
            "Host memory errors (EDAC)",
            "Corrected and uncorrected host memory errors per node (cumulative counts); an "
            "uncorrected one is fatal.",
            target("pitstop_host_memory_edac_corrected > 0", "{{node}} corrected"),
            target("pitstop_host_memory_edac_uncorrected > 0", "{{node}} uncorrected"),
            decimals=0,
        ),
        width=8,
    )
    d.add(
        series(
            "OOM kills",
            "Kernel OOM kills each agent saw since it started (nodes with kills only).",
            target("pitstop_host_oom_kills > 0", "{{node}}"),
            decimals=0,
        ),
        width=8,
    )
    d.add(
        series(
            "Disk free (share)",
            "Share free of each filesystem the daemons write to; under 5% the checkpoint "
            "daemon stops flushing to it.",
            target(DISK_FREE_SHARE, "{{node}} {{path}}"),
            unit="percentunit",
            minimum=0,
            maximum=1,
        ),
        width=8,
    )
    d.add(
        series(
            "Disk free (bytes)",
            "Bytes free on each filesystem the daemons write to.",
            target("pitstop_host_disk_free_bytes", "{{node}} {{path}}"),
            unit="bytes",
            minimum=0,
        ),
        width=8,
    )
    d.add(
        _timeline(
            "Disks read-only",
            "Each filesystem the daemons write to: read-write, or read-only (remounted "
            "after I/O errors).",
            "pitstop_host_disk_read_only",
            "{{node}} {{path}}",
            {
                "0": {"text": "read-write", "color": "green", "index": 0},
                "1": {"text": "read-only", "color": "red", "index": 1},
            },
        ),
        width=8,
    )
    d.add(
        series(
            "PCIe AER errors",
            "AER error counts of the GPUs and NICs by type (correctable, nonfatal, fatal; "
            "cumulative counts, devices with errors only); a fatal one is fatal.",
            target(
                "pitstop_host_pcie_aer_errors > 0",
                "{{node}} {{role}} {{device}} {{type}}",
            ),
            decimals=0,
        ),
        width=12,
    )
    d.add(
        series(
            "PCIe link width and speed (of their maximum)",
            "Each GPU's and NIC's PCIe link width and speed as a share of the most it can "
            "run: below 100% the link trained down (a marginal slot, riser or card).",
            target(PCIE_WIDTH_SHARE, "{{node}} {{role}} {{device}} width"),
            target(PCIE_SPEED_SHARE, "{{node}} {{role}} {{device}} speed"),
            unit="percentunit",
            minimum=0,
        ),
        width=12,
    )
