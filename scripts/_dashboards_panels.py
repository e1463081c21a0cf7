"""The pieces scripts/gen_dashboards.py builds Grafana dashboards from: a query, a panel
(time series or stat), a row, a dashboard with its variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
