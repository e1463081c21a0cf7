"""bench/scale.py's percentiles say how many samples they stand on, count a failure that
timed out instead of dropping it, and keep the samples a lagging simulator touched apart."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench.* as scale.py imports it
from bench._scale_fits import at_12500
from bench._scale_stats import block, percentile, sample_blocks, size_summary


def test_percentile_interpolates_between_order_statistics() -> None:
    ordered = [1.0, 2.0, 3.0, 4.0]
    assert percentile(ordered, 0.5) == pytest.approx(2.5)  # numpy's "linear" (type 7)
    assert percentile(ordered, 0.9) == pytest.approx(3.7)
    assert percentile([5.0], 0.99) == 5.0


def test_a_failed_sample_is_infinite_and_reported_as_null() -> None:
    values = [0.1 * i for i in range(1, 30)] + [math.inf]
    out = block(values)
    assert out["n"] == 30
    assert out["failed"] == 1
    assert out["p50"] == pytest.approx(1.55)
    assert out["p99"] is None  # between the largest time and the failure: no number
    assert "p99_needs" not in out


def test_p99_needs_30_samples() -> None:
    out = block([0.5] * 29)
    assert (out["p50"], out["p90"], out["p99"], out["n"]) == (0.5, 0.5, None, 29)
    assert out["p99_needs"] == 30
    assert block([0.5] * 30)["p99"] == 0.5


def row(kind: str, detect: float, **more: Any) -> dict[str, Any]:
    times = {"detect_seconds": detect, "decide_seconds": 0.05, "fanout_seconds": 0.2}
    return {"kind": kind, "node": "n00001", **times, **more}


def test_failures_that_timed_out_count_in_every_percentile_they_belong_to() -> None:
    rows = [
        row("stream", 0.01),
        {
            "kind": "xid",
            "node": "n00002",
            "error": "no detection",
            "failed": ["detect", "decide", "fanout"],
        },
        row("exit", 0.02, error="fan-out incomplete after 60 s: 3 of 16 nodes", failed=["fanout"]),
        {"kind": "silent", "error": "no node left to fail"},  # nothing injected: no sample
    ]
    blocks = sample_blocks(rows)
    assert (blocks["detect_pushed"]["n"], blocks["detect_pushed"]["failed"]) == (3, 1)
    assert (blocks["decide"]["n"], blocks["decide"]["failed"]) == (3, 1)
    assert (blocks["fanout"]["n"], blocks["fanout"]["failed"]) == (3, 2)
    assert blocks["detect_silent"]["n"] == 0
    summary = size_summary({"nodes": 16, "spares": 8, "failures": rows})
    assert summary["failed_samples"] == 2
    assert summary["failures_failed"] == 3


def test_samples_a_lagging_simulator_touched_are_reported_apart() -> None:
    rows = [row("stream", 0.01), row("xid", 0.9, sim_lagged=True, sim_lag_max_seconds=0.4)]
    blocks = sample_blocks(rows)
    assert blocks["detect_pushed"]["n"] == 1
    assert blocks["detect_pushed"]["p50"] == 0.01
    apart = blocks["sim_lagged"]
    assert (apart["count"], apart["lag_max_s"], apart["detect_pushed"]) == (1, 0.4, [0.9])


def test_every_sample_has_its_own_block_and_the_fit_says_when_it_used_it() -> None:
    """Where the simulator lagged in every failure, the unlagged p99 has no samples; the
    fit to 12,500 nodes then stands on every sample, lagged ones included, and says so."""

    def size(nodes: int, fanout: float) -> dict[str, Any]:
        rows = [
            row("xid", 0.01, fanout_seconds=fanout + i / 100, sim_lagged=True) for i in range(30)
        ]
        load = {"scheduler_cpu_pct": [10.0, 20.0]}
        return size_summary(
            {"nodes": nodes, "failures": rows, "load": load, "roles": ["decider", "ingest"]}
        )

    small, large = size(500, 0.2), size(1000, 0.4)
    assert large["fanout_p99_s"] is None  # no unlagged sample
    assert large["every_sample"]["fanout"]["n"] == 30
    assert large["fanout_p99_every_sample_s"] == pytest.approx(0.4 + 0.29 * 0.99 + 0.0029, 0.01)
    projected = at_12500([small, large])
    assert projected is not None
    assert projected["decide_fanout_from"] == "every sample, simulator-lagged ones included"
    assert projected["fanout_s"] == pytest.approx(0.2 + 0.2 * 12500 / 500, rel=0.05)


def test_rows_of_an_older_run_fail_by_their_error() -> None:
    """--refit reads runs from before `failed` was written: the error says what failed."""
    rows = [{"kind": "stream", "node": "n00003", "error": "no decision", "detect_seconds": 0.01}]
    blocks = sample_blocks(rows)
    assert blocks["detect_pushed"]["failed"] == 0
    assert blocks["decide"]["failed"] == 1
    assert blocks["fanout"]["failed"] == 1
