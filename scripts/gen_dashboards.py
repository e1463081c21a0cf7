"""Write pitstop's Grafana dashboards (deploy/grafana/dashboards/*.json) from the panels
described here, so every query lives in one reviewable place.

    python scripts/gen_dashboards.py          # rewrite the JSON files
    python scripts/gen_dashboards.py --check  # exit 1 if the checked-in files are stale

Three dashboards over the scheduler's and agents' /metrics: the fleet (node states, GPU
health and Xids, the control plane's heartbeat and event-loop lag), a job (step rate,
tokens/s, loss, MFU, step time, stragglers, goodput) and recoveries (by cause, time by
phase, steps lost, goodput). Each picks its Prometheus data source from a variable, so
the files import as they are (Grafana's provisioning, or Dashboards > Import).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
JOB = 'job_id=~"$job_id"'

Json = dict[str, Any]


def target(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "") -> Json:
    out: Json = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        out["instant"], out["range"] = True, False
    if fmt:
        out["format"] = fmt
    return out


def panel(
    kind: str,
    title: str,
    description: str,
    targets: list[Json],
    *,
    unit: str = "",
    decimals: int | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    mappings: list[Json] | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    options: Json | None = None,
    custom: Json | None = None,
) -> Json:
    defaults: Json = {}
    if unit:
        defaults["unit"] = unit
    if decimals is not None:
        defaults["decimals"] = decimals
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if mappings:
        defaults["mappings"] = mappings
    if thresholds:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"value": v, "color": c} for v, c in thresholds],
        }
        defaults["color"] = {"mode": "thresholds"}
    if custom:
        defaults["custom"] = custom
    refs = "ABCDEFGHIJ"
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [{**t, "refId": refs[i]} for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options or {},
    }


def stat(title: str, description: str, expr: str, legend: str = "", **kw: Any) -> Json:
    options = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"}
    return panel("stat", title, description, [target(expr, legend)], options=options, **kw)


def series(title: str, description: str, *targets: Json, stack: bool = False, **kw: Any) -> Json:
    custom: Json = {"fillOpacity": 10, "showPoints": "never"}
    if stack:
        custom.update(stacking={"mode": "normal"}, fillOpacity=60)
    legend = {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]}
    options = {"legend": legend, "tooltip": {"mode": "multi", "sort": "desc"}}
    return panel(
        "timeseries", title, description, list(targets), options=options, custom=custom, **kw
    )


def row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


VERDICTS = [
    {
        "type": "value",
        "options": {
            "0": {"text": "healthy", "color": "green", "index": 0},
            "1": {"text": "application", "color": "blue", "index": 1},
            "2": {"text": "warning", "color": "orange", "index": 2},
            "3": {"text": "fatal", "color": "red", "index": 3},
        },
    }
]
"""The agent's GPU verdict gauge (pitstop_agent_gpu_verdict), as words and colours."""


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    variables: list[Json] = field(default_factory=list)
    panels: list[Json] = field(default_factory=list)
    _x: int = 0
    _y: int = 0
    _row_height: int = 0

    def row(self, title: str) -> None:
        self._newline()
        self._place(row(title), 24, 1)
        self._newline()

    def add(self, item: Json, width: int = 12, height: int = 8) -> None:
        if self._x + width > 24:
            self._newline()
        self._place(item, width, height)

    def _place(self, item: Json, width: int, height: int) -> None:
        item["id"] = len(self.panels) + 1
        item["gridPos"] = {"h": height, "w": width, "x": self._x, "y": self._y}
        self.panels.append(item)
        self._x += width
        self._row_height = max(self._row_height, height)

    def _newline(self) -> None:
        if self._x:
            self._y += self._row_height
        self._x, self._row_height = 0, 0

    def to_json(self) -> Json:
        datasource = {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        }
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["pitstop"],
            "editable": True,
            "graphTooltip": 1,
            "refresh": "10s",
            "schemaVersion": 39,
            "version": 1,
            "time": {"from": "now-1h", "to": "now"},
            "timezone": "browser",
            "annotations": {"list": []},
            "links": [
                {
                    "type": "dashboards",
                    "tags": ["pitstop"],
                    "title": "pitstop",
                    "asDropdown": True,
                    "includeVars": True,
                    "keepTime": True,
                }
            ],
            "templating": {"list": [datasource, *self.variables]},
            "panels": self.panels,
        }


def query_variable(name: str, label: str, query: str, *, multi: bool = True) -> Json:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": multi,
        "current": {},
        "hide": 0,
    }


def fleet() -> Dashboard:
    d = Dashboard(
        "pitstop-fleet",
        "pitstop / Fleet",
        "Which nodes are sick: node states, GPU health and Xid errors, and the control "
        "plane's own health (leader, heartbeat lag, event-loop lag).",
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


def job() -> Dashboard:
    d = Dashboard(
        "pitstop-job",
        "pitstop / Job",
        "One training job: state, step rate, tokens/s, loss, MFU, step time, stragglers "
        "and goodput (the scheduler leader's per-job series, label job_id).",
        variables=[
            query_variable("job_id", "Job", "label_values(pitstop_scheduler_job_info, job_id)")
        ],
    )
    d.row("Now")
    d.add(
        panel(
            "stat",
            "State",
            "The job's state.",
            [target(f"max by (state) (pitstop_scheduler_job_state{{{JOB}}})", "{{state}}")],
            options={"reduceOptions": {"calcs": ["lastNotNull"]}, "textMode": "name"},
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Generation",
            "The job's generation: one per start, restart and recovery.",
            f"max(pitstop_scheduler_job_generation{{{JOB}}})",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Step",
            "The newest step the job reported.",
            f"max(pitstop_scheduler_job_step{{{JOB}}})",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Last step",
            "Seconds since the job's newest step ended.",
            f"time() - max(pitstop_scheduler_job_last_step_timestamp_seconds{{{JOB}}})",
            unit="s",
            thresholds=[(None, "green"), (60, "orange"), (300, "red")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Goodput",
            "Productive time over productive plus lost time (detect, recovery, recompute).",
            f"max(pitstop_scheduler_job_goodput_ratio{{{JOB}}})",
            unit="percentunit",
            thresholds=[(None, "red"), (0.8, "orange"), (0.9, "green")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "MFU",
            "Model FLOPs utilisation: the model FLOPs per second the job achieves over its "
            "accelerators' peak. Shown when the training script states both "
            "(Session.set_flops).",
            f"sum(rate(pitstop_scheduler_job_model_flops_total{{{JOB}}}[5m])) "
            f"/ max(pitstop_scheduler_job_peak_flops{{{JOB}}} > 0)",
            unit="percentunit",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.row("Training")
    d.add(
        series(
            "Step rate",
            "Steps per second (steps redone after a restore count again).",
            target(
                f"sum by (job_id) (rate(pitstop_scheduler_job_steps_total{{{JOB}}}[{RATE}]))",
                "{{job_id}}",
            ),
            unit="none",
        )
    )
    d.add(
        series(
            "Tokens per second",
            "Tokens all ranks processed per second.",
            target(
                f"sum by (job_id) (rate(pitstop_scheduler_job_tokens_total{{{JOB}}}[{RATE}]))",
                "{{job_id}}",
            ),
            unit="short",
        )
    )
    d.add(
        series(
            "Loss",
            "Training loss at the newest step every rank reached (mean over ranks).",
            target(f"max by (job_id) (pitstop_scheduler_job_loss{{{JOB}}})", "{{job_id}}"),
        )
    )
    d.add(
        series(
            "MFU",
            "Model FLOPs utilisation (needs the script's model FLOPs per token and peak "
            "FLOP/s: Session.set_flops).",
            target(
                f"sum by (job_id) (rate(pitstop_scheduler_job_model_flops_total{{{JOB}}}[{RATE}])) "
                f"/ max by (job_id) (pitstop_scheduler_job_peak_flops{{{JOB}}} > 0)",
                "{{job_id}}",
            ),
            unit="percentunit",
            minimum=0,
        )
    )
    d.add(
        series(
            "Step time",
            "Typical step time: the median of the ranks' medians, waits in collectives left out.",
            target(f"max by (job_id) (pitstop_scheduler_job_step_seconds{{{JOB}}})", "{{job_id}}"),
            unit="s",
        )
    )
    d.add(
        series(
            "Stragglers",
            "Ranks flagged as persistently slower than the others.",
            target(f"max by (job_id) (pitstop_scheduler_job_stragglers{{{JOB}}})", "{{job_id}}"),
            decimals=0,
            minimum=0,
        )
    )
    d.row("Goodput and nodes")
    d.add(
        series(
            "Goodput",
            "Productive time over all the job's time.",
            target(f"max by (job_id) (pitstop_scheduler_job_goodput_ratio{{{JOB}}})", "{{job_id}}"),
            unit="percentunit",
            maximum=1,
        )
    )
    d.add(
        series(
            "Time lost, by part",
            "The goodput account's lost seconds: detecting failures, recovering, and "
            "recomputing the steps a restore gave up.",
            target(
                "max by (part) (pitstop_scheduler_job_goodput_seconds"
                f'{{{JOB}, part!="productive"}})',
                "{{part}}",
            ),
            unit="s",
            stack=True,
        )
    )
    d.add(
        series(
            "Step samples by node",
            "Step samples each node's agent reports for the job, per second: where its ranks run.",
            target(
                f"sum by (node) (rate(pitstop_agent_steps_reported_total{{{JOB}}}[{RATE}]))",
                "{{node}}",
            ),
            unit="reqps",
        )
    )
    d.add(
        series(
            "Rank exits by node",
            "Rank processes of the job that ended, by node.",
            target(
                f"sum by (node) (increase(pitstop_agent_rank_exits_total{{{JOB}}}[{RATE}]))",
                "{{node}}",
            ),
            decimals=0,
        )
    )
    return d


def recovery() -> Dashboard:
    phase = 'phase=~"$phase"'
    d = Dashboard(
        "pitstop-recovery",
        "pitstop / Recovery",
        "What failures cost: recoveries by cause, their time by phase (detect, decide, "
        "resume), steps lost and the jobs' goodput.",
        variables=[
            query_variable(
                "phase",
                "Phase",
                "label_values(pitstop_scheduler_recovery_phase_seconds_count, phase)",
            )
        ],
    )
    d.row("Recoveries")
    d.add(
        stat(
            "Recoveries decided (range)",
            "Recoveries the leader decided over the range, every cause.",
            "sum(increase(pitstop_scheduler_recoveries_total[$__range])) or vector(0)",
            decimals=0,
            thresholds=[(None, "blue")],
        ),
        width=6,
        height=4,
    )
    d.add(
        stat(
            "Recovered (range)",
            "Recoveries that got their job stepping again over the range.",
            "sum(increase(pitstop_scheduler_recovery_seconds_count[$__range])) or vector(0)",
            decimals=0,
            thresholds=[(None, "green")],
        ),
        width=6,
        height=4,
    )
    d.add(
        stat(
            "Median recovery (range)",
            "Median time from a failure to its job stepping again.",
            "histogram_quantile(0.5, sum by (le) "
            "(increase(pitstop_scheduler_recovery_seconds_bucket[$__range])))",
            unit="s",
            thresholds=[(None, "green"), (10, "orange"), (60, "red")],
        ),
        width=6,
        height=4,
    )
    d.add(
        stat(
            "Steps lost (range)",
            "Steps recoveries gave up, redone after their restore.",
            "sum(increase(pitstop_scheduler_recovery_lost_steps_total[$__range])) or vector(0)",
            decimals=0,
            thresholds=[(None, "green"), (1, "orange")],
        ),
        width=6,
        height=4,
    )
    d.add(
        series(
            "Recoveries by cause",
            "Recoveries decided, by cause: node (a node failed or was swapped out), "
            "rank_exit (a rank died), fallback (a recovery missed its deadline).",
            target(
                f"sum by (cause) (increase(pitstop_scheduler_recoveries_total[{RATE}]))",
                "{{cause}}",
            ),
            decimals=0,
            stack=True,
        )
    )
    d.add(
        panel(
            "bargauge",
            "Recovery time by phase (range)",
            "Median and 99th percentile of each phase over the range: detect (failure to "
            "noticed), decide (to the decision), resume (restore and re-form, to the first "
            "step of the new generation).",
            [
                target(
                    f"histogram_quantile({q}, sum by (le, phase) "
                    f"(increase(pitstop_scheduler_recovery_phase_seconds_bucket{{{phase}}}[$__range])))",
                    f"{{{{phase}}}} p{int(q * 100)}",
                    instant=True,
                )
                for q in (0.5, 0.99)
            ],
            unit="s",
            options={"orientation": "horizontal", "displayMode": "gradient"},
            thresholds=[(None, "green"), (1, "orange"), (10, "red")],
        )
    )
    d.row("Time by phase")
    d.add(
        panel(
            "bargauge",
            "Recovery time histogram by phase (range)",
            "How many recoveries' phases fell in each time bucket over the range.",
            [
                target(
                    "sum by (le) (increase("
                    f"pitstop_scheduler_recovery_phase_seconds_bucket{{{phase}}}[$__range]))",
                    "{{le}}",
                    instant=True,
                    fmt="heatmap",
                )
            ],
            decimals=0,
            options={"orientation": "vertical", "displayMode": "basic"},
            thresholds=[(None, "blue")],
        )
    )
    d.add(
        panel(
            "heatmap",
            "Recovery time heatmap",
            "Recoveries over time, by how long each took from failure to stepping again.",
            [
                target(
                    "sum by (le) "
                    "(increase(pitstop_scheduler_recovery_seconds_bucket[$__interval]))",
                    "{{le}}",
                    fmt="heatmap",
                )
            ],
            options={"calculate": False, "yAxis": {"unit": "s"}, "cellGap": 1},
        )
    )
    d.add(
        series(
            "Mean time by phase",
            "Mean seconds of each phase, over the last hour's recoveries.",
            target(
                "sum by (phase) (increase("
                f"pitstop_scheduler_recovery_phase_seconds_sum{{{phase}}}[1h])) "
                "/ sum by (phase) (increase("
                f"pitstop_scheduler_recovery_phase_seconds_count{{{phase}}}[1h]))",
                "{{phase}}",
            ),
            unit="s",
            stack=True,
        )
    )
    d.add(
        series(
            "Steps lost by cause",
            "Steps recoveries gave up, by cause.",
            target(
                f"sum by (cause) (increase(pitstop_scheduler_recovery_lost_steps_total[{RATE}]))",
                "{{cause}}",
            ),
            decimals=0,
        )
    )
    d.row("Goodput and what drives it")
    d.add(
        series(
            "Goodput by job",
            "Each live job's productive share of its time.",
            target("max by (job_id) (pitstop_scheduler_job_goodput_ratio)", "{{job_id}}"),
            unit="percentunit",
            maximum=1,
        )
    )
    d.add(
        series(
            "Nodes unhealthy or lost",
            "Nodes the scheduler holds unhealthy or lost.",
            target(
                "sum by (state) (max by (state, role) "
                '(pitstop_scheduler_nodes{state=~"unhealthy|lost"}))',
                "{{state}}",
            ),
            decimals=0,
        )
    )
    d.add(
        series(
            "Decision latency p99",
            "Time to decide and commit a recovery or a placement.",
            target(
                "histogram_quantile(0.99, sum by (le, decision) "
                f"(rate(pitstop_scheduler_decision_seconds_bucket[{RATE}])))",
                "{{decision}}",
            ),
            unit="s",
        )
    )
    d.add(
        series(
            "Heartbeat lag p99",
            "Detection is as slow as heartbeats are late.",
            target(
                "histogram_quantile(0.99, sum by (le) "
                f"(rate(pitstop_scheduler_heartbeat_lag_seconds_bucket[{RATE}])))",
                "p99",
            ),
            unit="s",
        )
    )
    return d


DASHBOARDS = {"fleet.json": fleet, "job.json": job, "recovery.json": recovery}


def render() -> dict[str, str]:
    """Each dashboard file's name and text."""
    return {
        name: json.dumps(build().to_json(), indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON files are stale")
    args = parser.parse_args()
    fresh = render()
    if args.check:
        stale = sorted(
            name
            for name, text in fresh.items()
            if not (OUT / name).is_file() or (OUT / name).read_text() != text
        )
        if stale:
            print(
                "Grafana dashboards are stale: " + ", ".join(stale) + "\n"
                "fix: run `python scripts/gen_dashboards.py` and commit the result",
                file=sys.stderr,
            )
            return 1
        print(f"Grafana dashboards are fresh ({len(fresh)} files)")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in fresh.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(fresh)} dashboards to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
