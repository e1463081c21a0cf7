"""The shipped Prometheus rules and Grafana dashboards: promtool accepts the rules and the
example configuration and passes the alerts' unit tests; the dashboards are what
scripts/gen_dashboards.py writes; every query of a dashboard and every rule expression
reads only metrics the scheduler and the agent export (or a recording rule makes), and
every dashboard query is valid PromQL."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kit.monitoring import (
    PROMETHEUS,
    ROOT,
    SYNTHETIC,
    code_metric_names,
    dashboard_queries,
    metric_names,
    needs_promtool,
    promtool,
    rule_files,
    rules,
)


@pytest.fixture(scope="module")
def known() -> set[str]:
    """What a query may read: the code's series, the recording rules', Prometheus's own."""
    recorded = {rule["record"] for _, rule in rules() if "record" in rule}
    return code_metric_names() | recorded | SYNTHETIC


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("pitstop_scheduler_leader", {"pitstop_scheduler_leader"}),
        (
            'sum by (job_id) (rate(a_total{job_id=~"$job_id", x="by (y)"}[$__rate_interval]))',
            {"a_total"},
        ),
        (
            "histogram_quantile(0.99, sum(rate(h_bucket[5m] offset 1h)) by (le, phase))",
            {"h_bucket"},
        ),
        ("(x == 1) and on (job_id) (y > 2e3) or vector(0) unless ignoring(a) z", {"x", "y", "z"}),
        ("a / on (n) group_left (m, k) b", {"a", "b"}),
        ('label_replace(up, "dst", "$1", "src", "(.*)") > bool 0', {"up"}),
        ("time() - max(pitstop:job_goodput:ratio)", {"pitstop:job_goodput:ratio"}),
        ("label_values(pitstop_scheduler_job_info, job_id)", {"pitstop_scheduler_job_info"}),
        ("label_values(job_id)", set()),
    ],
)
def test_metric_names_reads_the_metrics_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_the_registries_name_every_series_of_their_metrics(known: set[str]) -> None:
    # A counter's _total, a histogram's _bucket/_sum/_count; labelled ones without samples.
    assert {
        "pitstop_scheduler_job_steps_total",
        "pitstop_scheduler_recovery_phase_seconds_bucket",
        "pitstop_scheduler_recovery_phase_seconds_count",
        "pitstop_agent_xid_total",
        "pitstop_agent_gpu_verdict",
    } <= known
    assert "pitstop_scheduler_job_steps" not in known


def test_every_dashboard_query_reads_metrics_the_code_exports(known: set[str]) -> None:
    queries = list(dashboard_queries())
    assert len(queries) > 40  # three dashboards, their panels and variables
    unknown = [
        f"{board} {where}: {sorted(metric_names(q) - known)} in {q}"
        for board, where, q in queries
        if metric_names(q) - known or not metric_names(q)
    ]
    assert unknown == [], "\n".join(unknown)


def test_every_rule_reads_metrics_the_code_exports(known: set[str]) -> None:
    unknown = [
        f"{path} {rule.get('alert') or rule.get('record')}: "
        f"{sorted(metric_names(rule['expr']) - known)}"
        for path, rule in rules()
        if metric_names(rule["expr"]) - known or not metric_names(rule["expr"])
    ]
    assert unknown == [], "\n".join(unknown)


def test_the_dashboards_are_what_the_generator_writes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_grafana_provisions_the_dashboards_from_files() -> None:
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/pitstop.yml").read_text()
    )
    assert provider["apiVersion"] == 1
    assert [p["type"] for p in provider["providers"]] == ["file"]
    assert provider["providers"][0]["options"]["path"]


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    files = [str(p) for p in rule_files()]
    assert {Path(f).name for f in files} == {"alerts.yml", "recording.yml"}
    result = promtool("check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_runs_the_alerts_unit_tests() -> None:
    result = promtool("test", "rules", *map(str, sorted((PROMETHEUS / "tests").glob("*.yml"))))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_checks_the_example_configuration() -> None:
    result = promtool("check", "config", str(PROMETHEUS / "example" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr


_GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """Each panel query, Grafana's variables given values, as a recording rule for
    promtool to parse."""

    def concrete(query: str) -> str:
        return re.sub(
            r"\$\{?(\w+)(?::\w+)?\}?", lambda m: _GRAFANA_VARIABLES.get(m.group(1), ".+"), query
        )

    queries = [q for _, where, q in dashboard_queries() if where.startswith("panel")]
    rule_file = tmp_path / "dashboards.yml"
    rule_file.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "dashboards",
                        "rules": [
                            {"record": f"dashboard:query_{i}", "expr": concrete(q)}
                            for i, q in enumerate(queries)
                        ],
                    }
                ]
            }
        )
    )
    result = promtool("check", "rules", str(rule_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(queries)} rules found" in result.stdout
