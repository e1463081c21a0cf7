"""What the monitoring tests share: promtool, the metric names the code registers, the
metric names a PromQL expression reads, and the queries of the shipped dashboards and
rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = (
    "promtool is not installed: it comes with Debian's `prometheus` package, which "
    "scripts/system_packages.sh (run by `make test`) installs when run as root; "
    "install it (apt-get install prometheus) to run this test"
)
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)

SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
"""Series Prometheus itself adds for every target."""

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool; its output is in the result (and in the assertion message)."""
    assert PROMTOOL is not None, NO_PROMTOOL
    return subprocess.run(
        [PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry exposes, with the suffixes of its metric type
    (counter _total, histogram _bucket/_sum/_count), whether or not it has samples yet."""
    names = set()
    for family in registry.collect():
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def code_metric_names() -> set[str]:
    """The series names of a scheduler's and an agent's registries."""
    from pitstop.agent.metrics import AgentMetrics
    from pitstop.scheduler.metrics import SchedulerMetrics

    return exported_names(SchedulerMetrics().registry) | exported_names(
        AgentMetrics("node").registry
    )


_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d[\w.]*)")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
    "atan2",
}
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),)?\s*\w+\s*\)\s*$", re.DOTALL)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana `label_values(metric, label)`
    variable query) reads: identifiers that are not functions (followed by `(`), nor
    keywords, nor labels (inside `{...}`, after by/without/on/ignoring/group_*), nor
    strings, numbers, durations or Grafana variables."""
    grafana = _LABEL_VALUES.match(expr)
    if grafana is not None:
        expr = grafana.group(1) or ""
    text = _STRING.sub('""', expr)
    text = _VARIABLE.sub("1", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def dashboard_queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard file, where, query) for every panel target and query variable of every
    shipped dashboard."""
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for variable in board.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                query = variable.get("query")
                text = query.get("query", "") if isinstance(query, dict) else query
                yield path.name, f"variable {variable['name']}", str(text)
        yield from ((path.name, where, q) for where, q in _panel_queries(board.get("panels", [])))


def _panel_queries(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    for panel in panels:
        for target in panel.get("targets", []):
            if "expr" in target:
                yield f"panel {panel.get('title')!r} {target.get('refId', '')}", target["expr"]
        yield from _panel_queries(panel.get("panels", []))  # a collapsed row's


def rule_files() -> list[Path]:
    return sorted(PROMETHEUS.glob("*.yml"))


def rules() -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, rule) for every rule of the shipped rule files."""
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                yield path.name, rule
