"""bench/scale.py's statistics: the samples a failure gives, percentiles that say how many
samples they stand on, one fleet size's headline, and the fits to 12,500 nodes.

Percentiles interpolate linearly between order statistics (Hyndman and Fan's type 7,
numpy's default): for q over n sorted samples x[0..n-1], h = (n - 1) q and the value is
x[floor h] + (h - floor h) (x[floor h + 1] - x[floor h]). A failure that timed out is a
sample of +inf: a percentile that reaches one is no number, reported as null beside
`"failed": k`. p99 is reported from 30 samples on (below, null and `"p99_needs": 30`).
A sample taken while a simulator or relay process lagged more than 100 ms (`sim_lagged`)
is left out of the headline percentiles and reported apart, with its values."""

from __future__ import annotations

import math
from typing import Any

from bench._scale_sim import FULL_FLEET

P99_NEEDS = 30
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
METRICS = {
    "detect": ("detect_seconds",),
    # decide: the failure seen -> its decision committed; fan-out counts from the commit.
    "decide": ("decide_to_commit_seconds", "decide_seconds"),
    "fanout": ("fanout_after_commit_seconds", "fanout_seconds"),
}
PUSHED = ("stream", "xid", "exit")
"""Failures the node tells of itself (a reset stream, an Xid, a rank's exit)."""
EVERY = (*PUSHED, "silent", "hung")
GROUPS = {
    "detect_silent": (("silent",), "detect"),
    "detect_pushed": (PUSHED, "detect"),
    "detect_hung": (("hung",), "detect"),
    "decide": (EVERY, "decide"),
    "fanout": (EVERY, "fanout"),
}
"""Headline name -> the failure kinds it draws on, and which of their times."""


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted, non-empty `ordered` (type 7; +inf where it reaches one)."""
    h = (len(ordered) - 1) * q
    low = math.floor(h)
    frac = h - low
    if frac == 0 or low + 1 >= len(ordered):
        return ordered[low]
    a, b = ordered[low], ordered[low + 1]
    return math.inf if math.isinf(b) else a + frac * (b - a)


def block(values: list[float]) -> dict[str, Any]:
    """p50, p90 and p99 of `values` (+inf for a failed sample) with their count n and
    how many of them failed."""
    ordered = sorted(values)
    n, failed = len(ordered), sum(math.isinf(v) for v in ordered)
    out: dict[str, Any] = {}
    for name, q in QUANTILES:
        if n == 0 or (name == "p99" and n < P99_NEEDS):
            out[name] = None
        else:
            value = percentile(ordered, q)
            out[name] = None if math.isinf(value) else round(value, 4)
    out.update(n=n, failed=failed)
    if n < P99_NEEDS:
        out["p99_needs"] = P99_NEEDS
    return out


def injected(row: dict[str, Any]) -> bool:
    """Whether a failure was injected (not "no node left to fail")."""
    return "node" in row


def failed_metrics(row: dict[str, Any]) -> set[str]:
    """Which of a failure's times timed out: every one after what never came."""
    if "failed" in row:
        return set(row["failed"])
    error = str(row.get("error", ""))  # a row of a run before failed samples were kept
    if error.startswith("no detection"):
        return {"detect", "decide", "fanout"}
    if error.startswith("no decision"):
        return {"decide", "fanout"}
    if error.startswith("fan-out incomplete"):
        return {"fanout"}
    return set()


def sample(row: dict[str, Any], metric: str) -> float | None:
    """A failure's `metric` in seconds, +inf when it timed out, None when it has none."""
    if metric in failed_metrics(row):
        return math.inf
    return next((row[k] for k in METRICS[metric] if row.get(k) is not None), None)


def samples(rows: list[dict[str, Any]], kinds: tuple[str, ...], metric: str) -> list[float]:
    out = []
    for row in rows:
        if injected(row) and row.get("kind") in kinds:
            value = sample(row, metric)
            if value is not None:
                out.append(value)
    return out


METRIC_OF = {
    "detect_seconds": "detect",
    "decide_seconds": "decide",
    "decide_to_commit_seconds": "decide",
    "decision_transaction_seconds": "decide",
    "fanout_seconds": "fanout",
    "fanout_after_commit_seconds": "fanout",
    "fanout_first_to_last_seconds": "fanout",
}


def key_p99(
    rows: list[dict[str, Any]],
    key: str,
    kinds: tuple[str, ...] = EVERY,
    lagged: bool = False,
) -> float | None:
    """p99 of one time (`key`) of the unlagged failures of `kinds` (with `lagged`, of
    every failure), +inf for those that timed out there (None: too few samples, or a
    failure within reach)."""
    values = []
    for row in rows:
        if not injected(row) or row.get("kind") not in kinds:
            continue
        if row.get("sim_lagged") and not lagged:
            continue
        if METRIC_OF[key] in failed_metrics(row):
            values.append(math.inf)
        elif row.get(key) is not None:
            values.append(float(row[key]))
    p99: float | None = block(values)["p99"]
    return p99


def sample_blocks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each headline group's percentiles over the samples no simulator lag touched, and
    the lagged ones apart: their count and values (null for a failed one)."""
    clean = [r for r in rows if injected(r) and not r.get("sim_lagged")]
    lagged = [r for r in rows if injected(r) and r.get("sim_lagged")]
    out: dict[str, Any] = {name: block(samples(clean, *g)) for name, g in GROUPS.items()}
    apart: dict[str, Any] = {
        "count": len(lagged),
        "lag_max_s": max((r.get("sim_lag_max_seconds", 0.0) for r in lagged), default=None),
    }
    for name, group in GROUPS.items():
        values = sorted(samples(lagged, *group))
        if values:
            apart[name] = [None if math.isinf(v) else v for v in values]
    out["sim_lagged"] = apart
    # Every sample, lagged ones included, each block with its n: where the simulator
    # lagged in every fan-out (2,500 nodes on two cores), the only p99 there is, and an
    # upper bound (a simulator's lag can only add time to what it measures).
    every = [r for r in rows if injected(r)]
    out["every_sample"] = {name: block(samples(every, *g)) for name, g in GROUPS.items()}
    return out


def expected_recoveries(out: dict[str, Any]) -> int:
    """The new generations a size's injections call for: one per failure injected (the
    failover's Xid included), one per mass-loss drill, and for the replace drill one per
    replace batch its cut nodes fill."""
    count = sum(injected(f) for f in out.get("failures", []))
    failover = out.get("failover") or {}
    count += int(injected(failover.get("failure") or {}))
    if out.get("mass_loss") and "nodes_cut" in out["mass_loss"]:
        count += 1
    replace = out.get("mass_loss_replace") or {}
    if replace.get("nodes_cut"):
        count += math.ceil(replace["nodes_cut"] / max(replace.get("replace_batch", 16), 1))
    return count


def _cpu(out: dict[str, Any]) -> tuple[float | None, float | None]:
    """The deciding and the ingesting processes' CPU (cores) in the load window."""
    load, roles = out.get("load") or {}, out.get("roles") or []
    per_process = [pct / 100 for pct in load.get("scheduler_cpu_pct", [])]
    if not per_process or len(per_process) != len(roles):
        return None, None
    leader = sum(c for c, r in zip(per_process, roles, strict=True) if r != "ingest")
    ingest = sum(c for c, r in zip(per_process, roles, strict=True) if r != "decider")
    return round(leader, 3), ingest


def size_summary(out: dict[str, Any]) -> dict[str, Any]:
    """The headline of one fleet size, from what it has measured so far."""
    rows = out.get("failures", [])
    blocks = sample_blocks(rows)
    leader, ingest = _cpu(out)
    roles = out.get("roles") or []
    total_nodes = out["nodes"] + out.get("spares", 0)
    taken = [r for r in rows if injected(r)]

    def count(kinds: tuple[str, ...], metric: str) -> int:
        return len(samples(taken, kinds, metric))

    max_generation = out.get("max_generation")
    expected = expected_recoveries(out)
    summary = {
        "nodes": total_nodes,
        "duration_s": out.get("job_running_seconds"),
        "false_losses": len(out.get("false_losses", [])),
        "detect_silent_p99_s": blocks["detect_silent"]["p99"],
        "detect_pushed_p99_s": blocks["detect_pushed"]["p99"],
        "decide_p99_s": blocks["decide"]["p99"],
        "fanout_p99_s": blocks["fanout"]["p99"],
        "decide_p99_every_sample_s": blocks["every_sample"]["decide"]["p99"],
        "fanout_p99_every_sample_s": blocks["every_sample"]["fanout"]["p99"],
        "leader_cpu_cores": leader,
        "ingest_cpu_cores_per_1000_nodes": (
            None if ingest is None else round(ingest / (total_nodes / 1000), 3)
        ),
        "processes": {"deciding": roles.count("decider"), "ingest": roles.count("ingest")},
        "command_bytes_max": out.get("command_bytes_max"),
        # Samples taken, failed and lagged ones included (each block has its own n).
        "samples": {
            "silent": count(("silent",), "detect"),
            "pushed": count(PUSHED, "detect"),
            "decide": count(EVERY, "decide"),
            "fanout": count(EVERY, "fanout"),
        },
        "failures_failed": sum("error" in r for r in rows),
        "failed_samples": sum(bool(failed_metrics(r)) for r in taken),
        "cpu_cores_job_running": out.get("scheduler_cpu_cores_job_running"),
        **blocks,
        "simulator": out.get("simulator"),
        "max_generation": max_generation,
        "expected_recoveries": expected,
        "unexplained_generations": (
            None if max_generation is None else max_generation - 1 - expected
        ),
        "mass_loss": out.get("mass_loss"),
    }
    for key in ("mass_loss_replace", "job_end"):
        if key in out:
            summary[key] = out[key]
    if out.get("interrupted"):
        summary["interrupted"] = True
    return summary


def linear(points: list[tuple[int, float]]) -> dict[str, Any] | None:
    """y = c + d * N by least squares: d is the cost of one more node."""
    if len(points) < 2:
        return None
    xs, ys = [float(n) for n, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    d = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    c = my - d * mx
    return {
        "intercept": float(f"{c:.4g}"),
        "per_node": float(f"{d:.4g}"),
        "at_12500": float(f"{c + d * FULL_FLEET:.4g}"),
    }


def fit(points: list[tuple[int, float]]) -> dict[str, Any] | None:
    """y = a * N^b by least squares on logs; the value at 12,500 nodes."""
    usable = [(n, y) for n, y in points if y is not None and y > 0]
    if len(usable) < 2:
        return None
    xs = [math.log(n) for n, _ in usable]
    ys = [math.log(y) for _, y in usable]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    a = math.exp(my - b * mx)
    return {
        "a": float(f"{a:.4g}"),
        "b": round(b, 3),
        "at_12500": float(f"{a * FULL_FLEET**b:.4g}"),
        "points": [[n, float(f"{y:.4g}")] for n, y in usable],
    }
