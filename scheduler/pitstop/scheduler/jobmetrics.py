"""Per-job metrics: what a training job's owner watches (step rate, tokens/s, loss, MFU,
goodput, stragglers) and what each recovery cost, phase by phase.

Labels are per job (`job_id`: `job` is the label Prometheus gives every target), never
per rank: a 100,000-rank job is a handful of series. The
leader sets them from what it reads anyway (the live jobs' rows every follow tick, the
step summaries in Redis); no other process exports any, and a leader that loses the lease
drops them (`forget_all`), so a former leader never shows a job frozen in time. Counters
count what this process saw while it led: dashboards take rate() and sum by job.

The recovery histograms are observed once per incident, when the job steps again: its
detect, decide and resume phases (pitstop.health.goodput: failure -> noticed -> decided
-> the new generation's first step; resume is restore and re-form together) and the
total, labelled by what the decision answered (node, rank_exit, fallback); restore and
reform once job.restored says when the last rank held the restore step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from pitstop.health.goodput import Goodput, Outcome
from pitstop.scheduler.domain import JobState
from pitstop.v1 import agent_pb2

PHASES = ("detect", "decide", "resume")
GOODPUT_PARTS = ("productive", "detect", "recovery", "recompute")
RECOVERY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class _Seen:
    """What the metrics remember of one live job between ticks."""

    name: str = ""
    state: str = ""
    generation: int = -1
    step: int = 0  # the newest step reported, as the job's row keeps it
    counted_step: int = 0  # the newest step counted in this generation
    peaks: dict[str, float] = field(default_factory=dict)  # node -> its ranks' stated peak
    resumed_until: float | None = None  # the newest ended_at of an incident observed
    restored_until: float = 0.0  # the newest restored_at of an incident observed


class JobMetrics:
    """The per-job series of the scheduler's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(
                f"pitstop_scheduler_job_{name}", doc, ["job_id", *extra], registry=registry
            )

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pitstop_scheduler_job_{name}", doc, ["job_id"], registry=registry)

        self.info = gauge("info", "1 for every live job, labelled with its name.", "name")
        self.state = gauge("state", "1 for the live job's current state.", "state")
        self.generation = gauge("generation", "The job's generation (one per (re)start).")
        self.step = gauge("step", "The newest step the job reported.")
        self.last_step_time = gauge(
            "last_step_timestamp_seconds",
            "When the job's newest reported step ended (epoch seconds, the rank's clock).",
        )
        self.steps = counter(
            "steps_total",
            "Steps the job completed, each step once per generation (steps redone after a "
            "restore count again: rate() is the step rate).",
        )
        self.tokens = counter(
            "tokens_total", "Tokens the job's ranks processed (the sum of their step reports)."
        )
        self.loss = gauge(
            "loss", "Training loss at the newest step all ranks reached: the mean over ranks."
        )
        self.grad_norm = gauge(
            "grad_norm",
            "Gradient norm at the newest step all ranks reached, the mean over the ranks that "
            "state one (pitstop.trainer's commit(grad_norm=...)); absent when none does.",
        )
        self.step_seconds = gauge(
            "step_seconds",
            "Typical step time: the median of the ranks' median step times (time spent "
            "waiting in collectives left out).",
        )
        self.stragglers = gauge("stragglers", "Ranks of the job flagged as stragglers now.")
        self.model_flops = counter(
            "model_flops_total",
            "Model FLOPs of the tokens processed, as the training script states them per "
            "token (absent when it does not); rate() over peak_flops is the MFU.",
        )
        self.peak_flops = gauge(
            "peak_flops",
            "Peak FLOP/s of the job's accelerators together, as its ranks state them "
            "(absent when they do not).",
        )
        self.goodput = gauge(
            "goodput_ratio",
            "Productive time over productive plus lost time (detect, recovery, recompute).",
        )
        self.goodput_seconds = gauge(
            "goodput_seconds",
            "The goodput account: seconds productive and lost, by part (productive, detect, "
            "recovery, recompute).",
            "part",
        )
        self.phase_seconds = Histogram(
            "pitstop_scheduler_recovery_phase_seconds",
            "Seconds each phase of a recovery took (detect: failure to noticed; decide: to "
            "the decision; resume: to the new generation's first step, restore and re-form "
            "together; restore: to every rank holding the restore step; reform: from there "
            "to the first step), by phase and cause (node, rank_exit, fallback); one "
            "observation per recovery that got the job stepping again (restore and reform "
            "once its ranks said when they restored).",
            ["phase", "cause"],
            buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.recovery_seconds = Histogram(
            "pitstop_scheduler_recovery_seconds",
            "Seconds from a failure to the job stepping again, by cause.",
            ["cause"],
            buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.lost_steps = Counter(
            "pitstop_scheduler_recovery_lost_steps_total",
            "Steps recoveries gave up (redone after the restore), by cause.",
            ["cause"],
            registry=registry,
        )
        self._per_job: tuple[MetricWrapperBase, ...] = (
            self.generation,
            self.step,
            self.last_step_time,
            self.steps,
            self.tokens,
            self.loss,
            self.grad_norm,
            self.step_seconds,
            self.stragglers,
            self.model_flops,
            self.peak_flops,
            self.goodput,
        )
        self._seen: dict[str, _Seen] = {}

    def observe_job(
        self,
        job_id: str,
        *,
        name: str,
        state: JobState,
        generation: int,
        step: int,
        goodput: Mapping[str, Any],
    ) -> None:
        """A live job as its row stands (every follow tick)."""
        seen = self._seen.get(job_id)
        if seen is None:
            seen = self._seen[job_id] = _Seen()
            # A new leader observes only incidents that end from now on.
            ended = [float(i.get("ended_at") or 0.0) for i in goodput.get("incidents", ())]
            seen.resumed_until = max(ended, default=0.0)
            self.steps.labels(job_id)  # 0 until it steps: a job that never does shows
        if seen.name != name:
            _remove(self.info, job_id, seen.name)
            self.info.labels(job_id, name).set(1)
            seen.name = name
        if seen.state != state.value:
            _remove(self.state, job_id, seen.state)
            self.state.labels(job_id, state.value).set(1)
            seen.state = state.value
        self.generation.labels(job_id).set(generation)
        seen.step = max(seen.step, step)
        self.step.labels(job_id).set(seen.step)
        parts = [float(goodput.get(f"{part}_seconds", 0.0)) for part in GOODPUT_PARTS]
        for part, seconds in zip(GOODPUT_PARTS, parts, strict=True):
            self.goodput_seconds.labels(job_id, part).set(seconds)
        if sum(parts) > 0:
            self.goodput.labels(job_id).set(float(goodput.get("ratio", 0.0)))

    def observe_summaries(
        self,
        job_id: str,
        generation: int,
        summaries: Sequence[agent_pb2.StepSummary],
        restore_step: int = 0,
    ) -> None:
        """Fresh step summaries of the job's current generation (`restore_step`: the
        step it started after)."""
        if not summaries:
            return
        seen = self._seen.setdefault(job_id, _Seen())
        if seen.generation != generation:
            seen.generation, seen.peaks = generation, {}
            seen.counted_step = restore_step
        newest = max(s.newest_step for s in summaries)
        seen.step = max(seen.step, newest)
        self.step.labels(job_id).set(seen.step)
        if newest > seen.counted_step:
            self.steps.labels(job_id).inc(newest - seen.counted_step)
            seen.counted_step = newest
        tokens = sum(s.tokens for s in summaries)
        if tokens:
            self.tokens.labels(job_id).inc(tokens)
        flops = sum(s.model_flops for s in summaries if s.model_flops > 0)
        if flops:
            self.model_flops.labels(job_id).inc(flops)
        for summary in summaries:
            if summary.peak_flops > 0:
                seen.peaks[summary.node_id] = summary.peak_flops
        if seen.peaks:
            self.peak_flops.labels(job_id).set(sum(seen.peaks.values()))
        ended = max((_epoch(s) for s in summaries), default=0.0)
        self.last_step_time.labels(job_id).set(ended or time.time())
        last = max(s.loss_step for s in summaries)
        if last:
            losses = [s.loss for s in summaries if s.loss_step == last]
            self.loss.labels(job_id).set(sum(losses) / len(losses))
            norms = [s.grad_norm for s in summaries if s.loss_step == last and s.grad_norm > 0]
            if norms:
                self.grad_norm.labels(job_id).set(sum(norms) / len(norms))

    def observe_ranks(self, job_id: str, *, step_seconds: float, stragglers: int) -> None:
        """The straggler detector's view of the job's ranks."""
        if step_seconds > 0:
            self.step_seconds.labels(job_id).set(step_seconds)
        self.stragglers.labels(job_id).set(stragglers)

    def observe_account(self, job_id: str, account: Goodput) -> None:
        """Observe each incident of `account` that got the job stepping again since the
        last look: its phases, its total and its lost steps."""
        seen = self._seen.setdefault(job_id, _Seen())
        until = seen.resumed_until or 0.0
        for incident in account.incidents:
            if incident.outcome is not Outcome.RESUMED or (incident.ended_at or 0.0) <= until:
                continue
            cause = incident.kind.value
            spans = (incident.detect_seconds, incident.decide_seconds, incident.resume_seconds)
            for phase, seconds in zip(PHASES, spans, strict=True):
                if seconds is not None:
                    self.phase_seconds.labels(phase, cause).observe(seconds)
            if incident.resumed_at is not None:
                self.recovery_seconds.labels(cause).observe(
                    max(0.0, incident.resumed_at - incident.began_at)
                )
            self.lost_steps.labels(cause).inc(incident.lost_steps)
            seen.resumed_until = max(seen.resumed_until or 0.0, incident.ended_at or 0.0)
        # Restore and re-form are known later (job.restored, once every rank reported).
        for incident in account.incidents:
            restored = incident.restored_at
            if restored is None or restored <= seen.restored_until:
                continue
            cause = incident.kind.value
            for phase, seconds in (
                ("restore", incident.restore_seconds),
                ("reform", incident.reform_seconds),
            ):
                if seconds is not None:
                    self.phase_seconds.labels(phase, cause).observe(seconds)
            seen.restored_until = restored

    def keep_only(self, job_ids: Collection[str]) -> None:
        """Drop the series of every job not in `job_ids` (it ended)."""
        for job_id in [j for j in self._seen if j not in job_ids]:
            self.forget(job_id)

    def forget(self, job_id: str) -> None:
        seen = self._seen.pop(job_id, None)
        for metric in self._per_job:
            _remove(metric, job_id)
        for part in GOODPUT_PARTS:
            _remove(self.goodput_seconds, job_id, part)
        if seen is not None:
            _remove(self.info, job_id, seen.name)
            _remove(self.state, job_id, seen.state)

    def forget_all(self) -> None:
        """This process no longer leads: its view of the jobs is no one's."""
        for job_id in list(self._seen):
            self.forget(job_id)


def _epoch(summary: agent_pb2.StepSummary) -> float:
    return summary.time.seconds + summary.time.nanos / 1e9 if summary.HasField("time") else 0.0


def _remove(metric: MetricWrapperBase, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)
