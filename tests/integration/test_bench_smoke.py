"""The benchmarks stay runnable: a tiny run of each prints one JSON object last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_api_benchmark_prints_one_json_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    result = subprocess.run(
        [
            sys.executable,
            "bench/api.py",
            "--requests",
            "20",
            "--serial-requests",
            "20",
            "--concurrency",
            "2",
            "--json-only",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "api"
    assert report["stores"] == "embedded"
    for phase in ("submit", "get"):
        assert report[phase]["throughput_rps"] > 0
        assert 0 < report[phase]["p50_ms"] <= report[phase]["p99_ms"]


def test_placement_benchmark_prints_one_json_line() -> None:
    result = subprocess.run(
        [sys.executable, "bench/placement.py", "--runs", "1", "--skip-redis"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "placement"
    assert report["gang"]["ranks"] == 8 * 16 * 781
    assert report["place"]["ranks"] == report["gang"]["ranks"]
