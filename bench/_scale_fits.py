"""bench/scale.py's headline over the sizes measured: each size's summary, the fits of
every cost in the fleet's size, their values at 12,500 nodes against the targets, and the
projection of how many scheduler processes 12,500 nodes need."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from bench._scale_sim import TARGETS
from bench._scale_stats import PUSHED, fit, key_p99, linear, size_summary

PROCESS_CORES = 0.75
"""The projection fills each scheduler process to this much of a core, no more."""


def at_12500(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Linear in the fleet (a fixed part plus a cost per node), fitted over the sizes
    measured: ingest CPU, the deciding process's CPU, decide and fan-out, taken to 12,500
    nodes; the streams spread over as many ingest processes as keep each under
    PROCESS_CORES, beside one deciding process."""
    whole = [s for s in summaries if s.get("leader_cpu_cores") is not None]
    ingest = linear(
        [(s["nodes"], s["ingest_cpu_cores_per_1000_nodes"] * s["nodes"] / 1000) for s in whole]
    )
    leader = linear([(s["nodes"], s["leader_cpu_cores"]) for s in whole])
    # The unlagged p99s where every size has one; else every sample's, lagged included
    # (an upper bound), and the output says which.
    unlagged = all(s.get("decide_p99_s") and s.get("fanout_p99_s") for s in whole)
    suffix = "_s" if unlagged else "_every_sample_s"
    decide = linear(
        [(s["nodes"], s[f"decide_p99{suffix}"]) for s in whole if s.get(f"decide_p99{suffix}")]
    )
    fanout = linear(
        [(s["nodes"], s[f"fanout_p99{suffix}"]) for s in whole if s.get(f"fanout_p99{suffix}")]
    )
    if ingest is None or leader is None:
        return None
    total = max(ingest["at_12500"], 0.0)
    processes = max(1, math.ceil(total / PROCESS_CORES))
    split = all(s["processes"]["deciding"] for s in whole)
    return {
        "processes": processes + 1,
        "cpu_cores_per_process": {
            "ingest": round(total / processes, 3),
            "deciding": round(max(leader["at_12500"], 0.0), 3),
        },
        "ingest_cpu_cores_total": round(total, 3),
        "decide_s": None if decide is None else decide["at_12500"],
        "fanout_s": None if fanout is None else fanout["at_12500"],
        "decide_fanout_from": (
            "unlagged samples" if unlagged else "every sample, simulator-lagged ones included"
        ),
        "how": (
            "least squares y = c + d*N over the sizes measured, at N=12,500: ingest CPU "
            f"over processes of at most {PROCESS_CORES} cores, plus one deciding process"
            + ("" if split else " (measured with one process doing both: its CPU counts as both)")
        ),
    }


def summarize(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    def series(get: Any) -> list[tuple[int, float]]:
        out = []
        for s in sizes:
            with contextlib.suppress(KeyError, TypeError, IndexError):
                value = get(s)
                if value is not None:
                    out.append((s["nodes"], float(value)))
        return out

    fits: dict[str, Any] = {
        "heartbeats_ingested_per_s": fit(series(lambda s: s["load"]["heartbeats_ingested_per_s"])),
        "scheduler_cpu_pct_load": fit(series(lambda s: s["load"]["scheduler_cpu_pct_total"])),
        "scheduler_cpu_pct_idle": fit(series(lambda s: s["idle"]["scheduler_cpu_pct_total"])),
        "cpu_ms_per_1k_heartbeats_idle": fit(
            series(lambda s: s["idle"]["scheduler_cpu_ms_per_1k_heartbeats"])
        ),
        "loop_lag_p99_seconds_load": fit(series(lambda s: s["load"]["loop_lag_p99_seconds"][0])),
        "start_fanout_seconds": fit(series(lambda s: s["job"]["start_fanout_seconds"])),
        "start_ranks_bytes": fit(series(lambda s: s["job"]["start_ranks_bytes"])),
        "redis_calls_per_heartbeat": fit(series(lambda s: s["idle"]["redis_calls_per_heartbeat"])),
        "pg_xacts_per_heartbeat_load": fit(series(lambda s: s["load"]["pg_xacts_per_heartbeat"])),
    }
    for name in ("scheduler_cpu_pct_total", "redis_cpu_pct", "postgres_cpu_pct"):
        for phase in ("idle", "load"):
            fits[f"linear_{name}_{phase}"] = linear(series(lambda s, p=phase, x=name: s[p][x]))
    fits["linear_pg_xacts_per_s_load"] = linear(
        series(lambda s: s["load"]["pg"]["xacts"] / s["load"]["seconds"])
    )
    fits["linear_redis_calls_per_s_load"] = linear(
        series(lambda s: s["load"]["_redis_total"] / s["load"]["seconds"])
    )
    # p99s as the headline takes them: unlagged samples, failed ones as +inf, from 30 on.
    for kind in ("stream", "xid", "exit", "silent", "hung"):
        for key in ("detect_seconds", "decide_seconds", "fanout_seconds"):
            fits[f"{kind}_{key}_p99"] = fit(
                series(lambda s, k=kind, x=key: key_p99(s["failures"], x, (k,)))
            )
    for key in (
        "decide_seconds",
        "decide_to_commit_seconds",
        "decision_transaction_seconds",
        "fanout_seconds",
        "fanout_after_commit_seconds",
        "fanout_first_to_last_seconds",
    ):
        fits[f"{key}_p99"] = fit(series(lambda s, k=key: key_p99(s["failures"], k)))
        fits[f"linear_{key}_p99"] = linear(series(lambda s, k=key: key_p99(s["failures"], k)))
        fits[f"linear_{key}_p99_every_sample"] = linear(
            series(lambda s, k=key: key_p99(s["failures"], k, lagged=True))
        )
    fits["detect_seconds_p99_stream_and_xid"] = fit(
        series(lambda s: key_p99(s["failures"], "detect_seconds", ("stream", "xid")))
    )
    fits["detect_seconds_p99_pushed"] = fit(
        series(lambda s: key_p99(s["failures"], "detect_seconds", PUSHED))
    )
    fits["linear_detect_seconds_p99_pushed_every_sample"] = linear(
        series(lambda s: key_p99(s["failures"], "detect_seconds", PUSHED, lagged=True))
    )
    return fits


def verdicts(fits: dict[str, Any]) -> dict[str, Any]:
    def at(name: str) -> float | None:
        f = fits.get(name)
        return None if f is None else f["at_12500"]

    # CPU: the linear fit (a fixed part plus a cost per node), not the power law, whose
    # exponent the fixed part drags below 1 at these sizes.
    linear_cpu = fits.get("linear_scheduler_cpu_pct_total_load")
    cores = None if linear_cpu is None else linear_cpu["at_12500"]

    def at_or_every(name: str, every: str) -> float | None:
        """The unlagged fit, else every sample's (lagged included: an upper bound)."""
        value = at(name)
        return at(every) if value is None else value

    checks = {
        "detect_p99_seconds": at_or_every(
            "detect_seconds_p99_pushed", "linear_detect_seconds_p99_pushed_every_sample"
        ),
        "decide_p99_seconds": at_or_every(
            "decide_to_commit_seconds_p99", "linear_decide_to_commit_seconds_p99_every_sample"
        ),
        "fanout_seconds": at_or_every(
            "fanout_after_commit_seconds_p99",
            "linear_fanout_after_commit_seconds_p99_every_sample",
        ),
        "loop_lag_p99_seconds": at("loop_lag_p99_seconds_load"),
        "ingest_cpu_cores": None if cores is None else cores / 100,
    }
    return {
        name: {
            "at_12500": value,
            "target": TARGETS[name],
            "met": None if value is None else value < TARGETS[name],
        }
        for name, value in checks.items()
    }


def headline(result: dict[str, Any]) -> None:
    """sizes, largest, fits and at_12500 from the sizes measured so far (a size stopped
    half-way gives a headline of what it has, marked interrupted, and no fit)."""
    details = [d for d in result.get("details", []) if "spares" in d]
    if not details:
        return
    result["sizes"] = [d.get("summary") or size_summary(d) for d in details]
    result["largest"] = max(result["sizes"], key=lambda x: x["nodes"])
    whole = [d for d in details if not d.get("interrupted") and "summary" in d]
    result["fits"] = summarize(whole)
    result["targets_at_12500"] = verdicts(result["fits"])
    result["at_12500"] = at_12500([d["summary"] for d in whole])


def refit(path: Path) -> dict[str, Any]:
    old: dict[str, Any] = json.loads(path.read_text().strip().splitlines()[-1])
    old.setdefault("details", old.get("sizes", []))  # before the headline per size
    for size in old["details"]:
        for row in size["failures"]:
            tx = row.get("decision_transaction_seconds")
            if tx is not None and "decide_seconds" in row:
                row["decide_to_commit_seconds"] = round(row["decide_seconds"] + tx, 4)
                if row.get("fanout_seconds") is not None:
                    row["fanout_after_commit_seconds"] = round(
                        max(row["fanout_seconds"] - tx, 0), 4
                    )
    old["fits"] = summarize(old["details"])
    old["targets_at_12500"] = verdicts(old["fits"])
    if all("spares" in d for d in old["details"]):  # a run with the headline per size
        for d in old["details"]:
            d["summary"] = size_summary(d)
        headline(old)
    return old
