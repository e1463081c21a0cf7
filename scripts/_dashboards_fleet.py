"""The fleet dashboard (deploy/grafana/dashboards/fleet.json): node states, GPU health
and Xids, the hosts' links, memory, disks and PCIe devices, the control plane's heartbeat
and event-loop lag."""

from __future__ import annotations

from scripts._dashboards_host import host_row
from scripts._dashboards_panels import RATE, VERDICTS, Dashboard, panel, series, stat, target


def fleet() -> Dashboard:
    d = Dashboard(
        "pitstop-fleet",
        "pitstop / Fleet",
        "Which nodes are sick: node states, GPU health and Xid errors, the hosts' links, "
        "memory, disks and PCIe devices, and the control plane's own health (leader, "
        "heartbeat lag, event-loop lag).",
    )
    d.row("Nodes")
    for state, colour in (
        ("ready", "green"),
        ("spare", "blue"),
        ("cordoned", "purple"),
        ("draining", "orange"),
        ("unhealthy", "red"),
        ("lost", "dark-red"),
    ):
        d.add(
            stat(
                state.capitalize(),
                f"Nodes the scheduler holds {state} (workers and spares).",
                f'sum(max by (state, role) (pitstop_scheduler_nodes{{state="{state}"}}))',
                thresholds=[(None, colour)],
            ),
            width=4,
            height=4,
        )
    d.add(
        series(
            "Nodes by state",
            "Nodes by state over time (the max over scheduler processes; each counts alike).",
            target("sum by (state) (max by (state, role) (pitstop_scheduler_nodes))", "{{state}}"),
            stack=True,
        ),
        width=12,
    )
    d.add(
        panel(
            "state-timeline",
            "Worst GPU verdict per node",
            "Each node's worst GPU verdict as its agent judges it: healthy, application "
            "(the job's fault), warning, fatal.",
            [target("max by (node) (pitstop_agent_gpu_verdict)", "{{node}}")],
            mappings=VERDICTS,
            thresholds=[(None, "green"), (1, "blue"), (2, "orange"), (3, "red")],
            options={"showValue": "never", "mergeValues": True, "rowHeight": 0.9},
        ),
        width=12,
    )
    d.row("GPU health")
    d.add(
        stat(
            "GPUs fatal",
            "GPUs whose verdict is fatal now.",
            "count(pitstop_agent_gpu_verdict == 3) or vector(0)",
            thresholds=[(None, "green"), (1, "red")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "GPUs warning",
            "GPUs whose verdict is warning now.",
            "count(pitstop_agent_gpu_verdict == 2) or vector(0)",
            thresholds=[(None, "green"), (1, "orange")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "GPUs lost",
            "GPUs off the bus or lost to NVML.",
            "sum(pitstop_agent_gpu_lost) or vector(0)",
            thresholds=[(None, "green"), (1, "red")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Xids (1 h)",
            "Xid errors the drivers reported over the last hour.",
            "sum(increase(pitstop_agent_xid_total[1h])) or vector(0)",
            decimals=0,
            thresholds=[(None, "green"), (1, "orange")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Checkpoint daemons down",
            "Nodes whose agent gets no answer from its checkpoint daemon.",
            "count(pitstop_agent_checkpointd_up == 0) or vector(0)",
            thresholds=[(None, "green"), (1, "orange")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Agents connected",
            "Agents registered on a scheduler stream, of those Prometheus scrapes.",
            "sum(pitstop_agent_scheduler_connected)",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.add(
        series(
            "Xid rate by node and code",
            "Xid errors per second, by node and Xid code.",
            target(
                f"sum by (node, xid) (rate(pitstop_agent_xid_total[{RATE}]))",
                "{{node}} Xid {{xid}}",
            ),
            unit="reqps",
        )
    )
    d.add(
        panel(
            "table",
            "Xid history (range)",
            "Xid errors over the dashboard's range, by node, GPU and code.",
            [
                target(
                    "sum by (node, gpu, xid) (increase(pitstop_agent_xid_total[$__range])) > 0",
                    instant=True,
                    fmt="table",
                )
            ],
            decimals=0,
        )
    )
    d.add(
        series(
            "GPU temperature (hottest per node)",
            "The hottest GPU of each node.",
            target("max by (node) (pitstop_agent_gpu_temperature_celsius)", "{{node}}"),
            unit="celsius",
        ),
        width=8,
    )
    d.add(
        series(
            "Uncorrected ECC errors (volatile)",
            "Uncorrected ECC errors since the driver loaded, per node.",
            target(
                "sum by (node) (pitstop_agent_gpu_ecc_errors"
                '{type="uncorrected", scope="volatile"})',
                "{{node}}",
            ),
        ),
        width=8,
    )
    d.add(
        series(
            "NVLink errors",
            "NVLink CRC, replay and recovery errors per node (driver's cumulative counts).",
            target("sum by (node, kind) (pitstop_agent_gpu_nvlink_errors)", "{{node}} {{kind}}"),
        ),
        width=8,
    )
    host_row(d)
    d.row("Control plane")
    d.add(
        stat(
            "Leaders",
            "Scheduler processes holding the leader lease: 1 when all is well.",
            "sum(pitstop_scheduler_leader)",
            thresholds=[(None, "red"), (1, "green"), (2, "red")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Scheduler processes",
            "Scheduler processes serving /metrics.",
            "count(pitstop_scheduler_leader)",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Heartbeat lag p99 (5 m)",
            "99th percentile of agent -> scheduler heartbeat delay.",
            "histogram_quantile(0.99, sum by (le) "
            "(rate(pitstop_scheduler_heartbeat_lag_seconds_bucket[5m])))",
            unit="s",
            thresholds=[(None, "green"), (0.1, "orange"), (0.5, "red")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Event-loop lag p99 (1 m)",
            "The worst scheduler's event-loop lag, 99th percentile over the last minute.",
            'max(pitstop_scheduler_event_loop_lag_quantile_seconds{q="0.99"})',
            unit="s",
            thresholds=[(None, "green"), (0.05, "orange"), (0.1, "red")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Agent reconnects (1 h)",
            "Agents that registered again after losing their stream, over the last hour.",
            "sum(increase(pitstop_agent_reconnects_total[1h])) or vector(0)",
            decimals=0,
            thresholds=[(None, "green"), (1, "orange")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Step samples dropped (1 h)",
            "Step samples agents dropped because the scheduler was unreachable.",
            "sum(increase(pitstop_agent_step_samples_dropped_total[1h])) or vector(0)",
            decimals=0,
            thresholds=[(None, "green"), (1, "orange")],
        ),
        width=4,
        height=4,
    )
    d.add(
        series(
            "Heartbeat lag",
            "Delay from an agent sending a heartbeat to the scheduler recording it.",
            *(
                target(
                    f"histogram_quantile({q}, sum by (le) "
                    f"(rate(pitstop_scheduler_heartbeat_lag_seconds_bucket[{RATE}])))",
                    f"p{int(q * 100)}",
                )
                for q in (0.5, 0.99)
            ),
            unit="s",
        ),
        width=8,
    )
    d.add(
        series(
            "Event-loop lag",
            "How late each scheduler's event loop runs a callback due now (the last minute).",
            target(
                "pitstop_scheduler_event_loop_lag_quantile_seconds",
                "{{instance}} q{{q}}",
            ),
            unit="s",
        ),
        width=8,
    )
    d.add(
        series(
            "Decision latency p99",
            "Time the leader takes to decide and commit a placement or a recovery.",
            target(
                "histogram_quantile(0.99, sum by (le, decision) "
                f"(rate(pitstop_scheduler_decision_seconds_bucket[{RATE}])))",
                "{{decision}}",
            ),
            unit="s",
        ),
        width=8,
    )
    d.add(
        series(
            "Reconcile pass p99",
            "Time one pass of each leader loop takes (decide, follow).",
            target(
                "histogram_quantile(0.99, sum by (le, loop) "
                f"(rate(pitstop_scheduler_reconcile_tick_seconds_bucket[{RATE}])))",
                "{{loop}}",
            ),
            unit="s",
        )
    )
    d.add(
        series(
            "Commands resent",
            "Node commands sent again for want of an acknowledgement, by action.",
            target(
                f"sum by (action) (rate(pitstop_scheduler_command_resends_total[{RATE}]))",
                "{{action}}",
            ),
            unit="reqps",
        )
    )
    return d
