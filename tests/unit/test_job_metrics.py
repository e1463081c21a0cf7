"""The scheduler's per-job series: steps counted once per generation (redone ones again),
tokens and model FLOPs summed over ranks, the combined peak FLOP/s, the loss of the newest
step every rank reached, goodput, each resumed recovery observed once by phase, and a
job's series gone when it ends or the leader steps down."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pitstop.health.goodput import JobEvent, account, incident_attributes
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.jobmetrics import JobMetrics
from pitstop.v1 import agent_pb2


def value(registry: CollectorRegistry, metric: str, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


def job_samples(registry: CollectorRegistry, job_id: str) -> list[str]:
    return [
        s.name
        for family in registry.collect()
        for s in family.samples
        if s.labels.get("job_id") == job_id
    ]


def summary(node: str, newest: int, **fields: float) -> agent_pb2.StepSummary:
    return agent_pb2.StepSummary(job_id="j1", node_id=node, newest_step=newest, **fields)  # type: ignore[arg-type]


def live(metrics: JobMetrics, state: JobState = JobState.RUNNING, **goodput: object) -> None:
    metrics.observe_job("j1", name="gpt", state=state, generation=1, step=0, goodput=goodput or {})


def test_steps_tokens_flops_and_loss_of_a_job() -> None:
    registry = CollectorRegistry()
    metrics = JobMetrics(registry)
    live(metrics)
    assert value(registry, "pitstop_scheduler_job_steps_total", job_id="j1") == 0
    # Two nodes, each summarizing two steps of its ranks.
    both = [
        summary(node, 2, tokens=200, model_flops=1200.0, peak_flops=1e3, loss_step=2, loss=loss)
        for node, loss in (("n0", 2.0), ("n1", 3.0))
    ]
    metrics.observe_summaries("j1", 1, both)
    assert value(registry, "pitstop_scheduler_job_steps_total", job_id="j1") == 2
    assert value(registry, "pitstop_scheduler_job_tokens_total", job_id="j1") == 400
    assert value(registry, "pitstop_scheduler_job_model_flops_total", job_id="j1") == 2400
    assert value(registry, "pitstop_scheduler_job_peak_flops", job_id="j1") == 2e3  # two nodes
    assert value(registry, "pitstop_scheduler_job_loss", job_id="j1") == 2.5  # step 2: 2, 3
    # A late summary of an older step counts its tokens, not its step again; a node's
    # peak is replaced, not added.
    metrics.observe_summaries("j1", 1, [summary("n0", 2, tokens=100, peak_flops=1e3)])
    assert value(registry, "pitstop_scheduler_job_steps_total", job_id="j1") == 2
    assert value(registry, "pitstop_scheduler_job_tokens_total", job_id="j1") == 500
    assert value(registry, "pitstop_scheduler_job_peak_flops", job_id="j1") == 2e3
    # A new generation restored at step 1: step 2 is done again and counts again.
    metrics.observe_summaries("j1", 2, [summary("n0", 3)], restore_step=1)
    assert value(registry, "pitstop_scheduler_job_steps_total", job_id="j1") == 4


def test_a_script_that_states_no_flops_exports_no_mfu_inputs() -> None:
    registry = CollectorRegistry()
    metrics = JobMetrics(registry)
    live(metrics)
    metrics.observe_summaries("j1", 1, [summary("n0", 1, tokens=10)])
    assert value(registry, "pitstop_scheduler_job_model_flops_total", job_id="j1") is None
    assert value(registry, "pitstop_scheduler_job_peak_flops", job_id="j1") is None


def test_state_goodput_and_forgetting_a_job() -> None:
    registry = CollectorRegistry()
    metrics = JobMetrics(registry)
    live(metrics, JobState.STARTING)
    assert value(registry, "pitstop_scheduler_job_goodput_ratio", job_id="j1") is None  # no time
    live(metrics, ratio=0.75, productive_seconds=3.0, detect_seconds=1.0)
    assert value(registry, "pitstop_scheduler_job_state", job_id="j1", state="running") == 1
    assert value(registry, "pitstop_scheduler_job_state", job_id="j1", state="starting") is None
    assert value(registry, "pitstop_scheduler_job_goodput_ratio", job_id="j1") == 0.75
    assert value(registry, "pitstop_scheduler_job_goodput_seconds", job_id="j1", part="detect") == 1
    assert value(registry, "pitstop_scheduler_job_info", job_id="j1", name="gpt") == 1
    assert job_samples(registry, "j1")
    metrics.keep_only(set())  # it ended
    assert job_samples(registry, "j1") == []
    live(metrics)
    metrics.forget_all()  # the lease lost
    assert job_samples(registry, "j1") == []


def recovered(failed: float, detected: float, decided: float, resumed: float) -> list[JobEvent]:
    attrs = incident_attributes(
        cause="n1 unhealthy", failed_at=failed, detected_at=detected, lost_steps=3
    )
    return [
        JobEvent(0.0, "job.running", "starting", "running"),
        JobEvent(decided, "job.recovering", "running", "recovering", attrs),
        JobEvent(resumed, "job.recovered", "recovering", "running"),
    ]


def test_each_resumed_recovery_is_observed_once_by_phase() -> None:
    registry = CollectorRegistry()
    metrics = JobMetrics(registry)
    live(metrics)
    events = recovered(10.0, 10.5, 10.6, 12.6)
    in_progress = account(events[:2], now=11.0, step_seconds=0.1)
    metrics.observe_account("j1", in_progress)
    hist = "pitstop_scheduler_recovery_phase_seconds_count"
    assert value(registry, hist, phase="detect", cause="node") is None  # not resumed yet
    done = account(events, now=13.0, step_seconds=0.1)
    metrics.observe_account("j1", done)
    metrics.observe_account("j1", done)  # the next refresh: nothing new
    for phase, seconds in (("detect", 0.5), ("decide", 0.1), ("resume", 2.0)):
        assert value(registry, hist, phase=phase, cause="node") == 1
        total = value(
            registry, "pitstop_scheduler_recovery_phase_seconds_sum", phase=phase, cause="node"
        )
        assert total == pytest.approx(seconds)
    total = value(registry, "pitstop_scheduler_recovery_seconds_sum", cause="node")
    assert total == pytest.approx(2.6)
    assert value(registry, "pitstop_scheduler_recovery_lost_steps_total", cause="node") == 3


def test_a_new_leader_does_not_observe_recoveries_resumed_before_it() -> None:
    registry = CollectorRegistry()
    metrics = JobMetrics(registry)
    done = account(recovered(10.0, 10.5, 10.6, 12.6), now=13.0, step_seconds=0.1)
    live(metrics, **done.to_json())
    metrics.observe_account("j1", done)
    hist = "pitstop_scheduler_recovery_phase_seconds_count"
    assert value(registry, hist, phase="detect", cause="node") is None
