"""A process that holds agent streams and falls behind sheds telemetry before anything
else: step summaries and unchanged heartbeats are dropped while its event loop lags,
never a command's acknowledgement, an Xid, a rank's exit or a changed health. gRPC's
core answers the keepalive pings; what the process must not do is spend the CPU those
answers need on telemetry, and turn its own lag into lost nodes.

Dropping is safe for what is dropped: a step summary carries the node's newest and
slowest step (the next one says as much), straggler windows are telemetry, and the
node's liveness deadline is kept by the process's own judge of its streams, not by the
heartbeats' Redis writes."""

from __future__ import annotations

from prometheus_client import Counter

SHED_KINDS = ("step_summary", "heartbeat", "stale_check")


class LoadShedder:
    """Sheds while the event loop lags: from a lag sample of `lag_seconds` or more, until
    `calm_seconds` have passed with every sample below half of it."""

    def __init__(self, lag_seconds: float, shed: Counter, calm_seconds: float = 1.0) -> None:
        self.lag_seconds = lag_seconds
        self.calm_seconds = calm_seconds
        self.shed = shed
        """pitstop_scheduler_telemetry_shed_total, by kind."""
        self.shedding = False
        self._calm_since = 0.0

    def observe(self, now: float, lag: float) -> None:
        """One sample of the loop's lag (SchedulerMetrics.watch_loop_lag, every 50 ms)."""
        if lag >= self.lag_seconds:
            self.shedding, self._calm_since = True, now
        elif lag >= self.lag_seconds / 2:
            self._calm_since = now
        elif self.shedding and now - self._calm_since >= self.calm_seconds:
            self.shedding = False

    def drop(self, kind: str) -> bool:
        """True (and counted) when telemetry of `kind` is to be dropped now."""
        if self.shedding:
            self.shed.labels(kind).inc()
        return self.shedding
