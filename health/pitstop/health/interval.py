"""The optimal checkpoint interval (Young 1974, Daly 2006), as pure functions.

A job that checkpoints every T seconds of work, at a cost of C seconds per checkpoint,
on a system whose mean time between failures is M, loses on average C per interval
and half an interval of redone work per failure. Young's first-order optimum is
T = sqrt(2·C·M). Daly's higher-order estimate corrects it for checkpoints that are
not cheap next to M:

    T = sqrt(2·C·M) · (1 + (1/3)·sqrt(C/(2M)) + (1/9)·(C/(2M))) - C      for C < 2M
    T = M                                                               for C ≥ 2M

(J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22, 2006, eq. 37.) Nothing here reads a clock: callers measure C and the
failure rate and pass them in.
"""

from __future__ import annotations

import math

SECONDS_PER_HOUR = 3600.0


def young_daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Seconds of work between checkpoints that minimise the expected lost time, for a
    checkpoint costing `checkpoint_cost_s` on a system with mean time between failures
    `mtbf_s`. Daly's higher-order estimate while C < 2M, else M (Young's formula is its
    first term)."""
    if not checkpoint_cost_s >= 0 or math.isinf(checkpoint_cost_s):
        raise ValueError(f"checkpoint_cost_s {checkpoint_cost_s!r}: must be a finite number >= 0")
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s {mtbf_s!r}: must be > 0 (use math.inf for no failures)")
    if math.isinf(mtbf_s):
        return math.inf
    if checkpoint_cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_cost_s / (2 * mtbf_s)
    young = math.sqrt(2 * checkpoint_cost_s * mtbf_s)
    return max(0.0, young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_cost_s)


def durable_every_steps(
    step_seconds: float,
    flush_cost_s: float,
    failures_per_hour: float,
    min_steps: int = 1,
    max_steps: int = 10_000,
) -> int:
    """Training steps between durable flushes: the Young/Daly interval for a flush that
    costs `flush_cost_s` and a job that fails `failures_per_hour` times an hour, in steps
    of `step_seconds`, clamped to [min_steps, max_steps]. No failures: max_steps."""
    if not step_seconds > 0 or math.isinf(step_seconds):
        raise ValueError(f"step_seconds {step_seconds!r}: must be a finite number > 0")
    if not failures_per_hour >= 0 or math.isinf(failures_per_hour):
        raise ValueError(f"failures_per_hour {failures_per_hour!r}: must be a finite number >= 0")
    if min_steps < 1 or max_steps < min_steps:
        raise ValueError(
            f"min_steps {min_steps}, max_steps {max_steps}: need 1 <= min_steps <= max_steps"
        )
    if failures_per_hour == 0:
        return max_steps
    interval_s = young_daly_interval(flush_cost_s, SECONDS_PER_HOUR / failures_per_hour)
    steps = round(interval_s / step_seconds)
    return min(max_steps, max(min_steps, steps))
