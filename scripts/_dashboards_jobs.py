"""The job and recovery dashboards (deploy/grafana/dashboards/job.json, recovery.json):
step rate, tokens/s, loss, MFU, step time, stragglers and goodput; recoveries by cause,
time by phase, steps lost."""

from __future__ import annotations

from scripts._dashboards_panels import (
    JOB,
    RATE,
    Dashboard,
    panel,
    query_variable,
    series,
    stat,
    target,
)


def job() -> Dashboard:
    d = Dashboard(
        "pitstop-job",
        "pitstop / Job",
        "One training job: state, step rate, tokens/s, loss, MFU, step time, stragglers "
        "and goodput (the scheduler leader's per-job series, label job_id).",
        variables=[
            query_variable("job_id", "Job", "label_values(pitstop_scheduler_job_info, job_id)")
        ],
    )
    d.row("Now")
    d.add(
        panel(
            "stat",
            "State",
            "The job's state.",
            [target(f"max by (state) (pitstop_scheduler_job_state{{{JOB}}})", "{{state}}")],
            options={"reduceOptions": {"calcs": ["lastNotNull"]}, "textMode": "name"},
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Generation",
            "The job's generation: one per start, restart and recovery.",
            f"max(pitstop_scheduler_job_generation{{{JOB}}})",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Step",
            "The newest step the job reported.",
            f"max(pitstop_scheduler_job_step{{{JOB}}})",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Last step",
            "Seconds since the job's newest step ended.",
            f"time() - max(pitstop_scheduler_job_last_step_timestamp_seconds{{{JOB}}})",
            unit="s",
            thresholds=[(None, "green"), (60, "orange"), (300, "red")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "Goodput",
            "Productive time over productive plus lost time (detect, recovery, recompute).",
            f"max(pitstop_scheduler_job_goodput_ratio{{{JOB}}})",
            unit="percentunit",
            thresholds=[(None, "red"), (0.8, "orange"), (0.9, "green")],
        ),
        width=4,
        height=4,
    )
    d.add(
        stat(
            "MFU",
            "Model FLOPs utilisation: the model FLOPs per second the job achieves over its "
            "accelerators' peak. Shown when the training script states both "
            "(Session.set_flops).",
            f"sum(rate(pitstop_scheduler_job_model_flops_total{{{JOB}}}[5m])) "
            f"/ max(pitstop_scheduler_job_peak_flops{{{JOB}}} > 0)",
            unit="percentunit",
            thresholds=[(None, "blue")],
        ),
        width=4,
        height=4,
    )
    d.row("Training")
    d.add(
        series(
            "Step rate",
            "Steps per second (steps redone after a restore count again).",
            target(
                f"sum by (job_id) (rate(pitstop_scheduler_job_steps_total{{{JOB}}}[{RATE}]))",
                "{{job_id}}",
            ),
            unit="none",
        )
    )
    d.add(
        series(
            "Tokens per second",
            "Tokens all ranks processed per second.",
            target(
                f"sum by (job_id) (rate(pitstop_scheduler_job_tokens_total{{{JOB}}}[{RATE}]))",
                "{{job_id}}",
            ),
            unit="short",
        )
    )
    d.add(
        series(
            "Loss",
            "Training loss at the newest step every rank reached (mean over ranks).",
            target(f"max by (job_id) (pitstop_scheduler_job_loss{{{JOB}}})", "{{job_id}}"),
        )
    )
    d.add(
        series(
            "MFU",
            "Model FLOPs utilisation (needs the script's model FLOPs per token and peak "
            "FLOP/s: Session.set_flops).",
            target(
                f"sum by (job_id) (rate(pitstop_scheduler_job_model_flops_total{{{JOB}}}[{RATE}])) "
                f"/ max by (job_id) (pitstop_scheduler_job_peak_flops{{{JOB}}} > 0)",
                "{{job_id}}",
            ),
            unit="percentunit",
            minimum=0,
        )
    )
    d.add(
        series(
            "Step time",
            "Typical step time: the median of the ranks' medians, waits in collectives left out.",
            target(f"max by (job_id) (pitstop_scheduler_job_step_seconds{{{JOB}}})", "{{job_id}}"),
            unit="s",
        )
    )
    d.add(
        series(
            "Stragglers",
            "Ranks flagged as persistently slower than the others.",
            target(f"max by (job_id) (pitstop_scheduler_job_stragglers{{{JOB}}})", "{{job_id}}"),
            decimals=0,
            minimum=0,
        )
    )
    d.row("Goodput and nodes")
    d.add(
        series(
            "Goodput",
            "Productive time over all the job's time.",
            target(f"max by (job_id) (pitstop_scheduler_job_goodput_ratio{{{JOB}}})", "{{job_id}}"),
            unit="percentunit",
            maximum=1,
        )
    )
    d.add(
        series(
            "Time lost, by part",
            "The goodput account's lost seconds: detecting failures, recovering, and "
            "recomputing the steps a restore gave up.",
            target(
                "max by (part) (pitstop_scheduler_job_goodput_seconds"
                f'{{{JOB}, part!="productive"}})',
                "{{part}}",
            ),
            unit="s",
            stack=True,
        )
    )
    d.add(
        series(
            "Step samples by node",
            "Step samples each node's agent reports for the job, per second: where its ranks run.",
            target(
                f"sum by (node) (rate(pitstop_agent_steps_reported_total{{{JOB}}}[{RATE}]))",
                "{{node}}",
            ),
            unit="reqps",
        )
    )
    d.add(
        series(
            "Rank exits by node",
            "Rank processes of the job that ended, by node.",
            target(
                f"sum by (node) (increase(pitstop_agent_rank_exits_total{{{JOB}}}[{RATE}]))",
                "{{node}}",
            ),
            decimals=0,
        )
    )
    return d


def recovery() -> Dashboard:
    phase = 'phase=~"$phase"'
    d = Dashboard(
        "pitstop-recovery",
        "pitstop / Recovery",
        "What failures cost: recoveries by cause, their time by phase (detect, decide, "
        "resume), steps lost and the jobs' goodput.",
        variables=[
            query_variable(
                "phase",
                "Phase",
                "label_values(pitstop_scheduler_recovery_phase_seconds_count, phase)",
            )
        ],
    )
    d.row("Recoveries")
    d.add(
        stat(
            "Recoveries decided (range)",
            "Recoveries the leader decided over the range, every cause.",
            "sum(increase(pitstop_scheduler_recoveries_total[$__range])) or vector(0)",
            decimals=0,
            thresholds=[(None, "blue")],
        ),
        width=6,
        height=4,
    )
    d.add(
        stat(
            "Recovered (range)",
            "Recoveries that got their job stepping again over the range.",
            "sum(increase(pitstop_scheduler_recovery_seconds_count[$__range])) or vector(0)",
            decimals=0,
            thresholds=[(None, "green")],
        ),
        width=6,
        height=4,
    )
    d.add(
        stat(
            "Median recovery (range)",
            "Median time from a failure to its job stepping again.",
            "histogram_quantile(0.5, sum by (le) "
            "(increase(pitstop_scheduler_recovery_seconds_bucket[$__range])))",
            unit="s",
            thresholds=[(None, "green"), (10, "orange"), (60, "red")],
        ),
        width=6,
        height=4,
    )
    d.add(
        stat(
            "Steps lost (range)",
            "Steps recoveries gave up, redone after their restore.",
            "sum(increase(pitstop_scheduler_recovery_lost_steps_total[$__range])) or vector(0)",
            decimals=0,
            thresholds=[(None, "green"), (1, "orange")],
        ),
        width=6,
        height=4,
    )
    d.add(
        series(
            "Recoveries by cause",
            "Recoveries decided, by cause: node (a node failed or was swapped out), "
            "rank_exit (a rank died), fallback (a recovery missed its deadline).",
            target(
                f"sum by (cause) (increase(pitstop_scheduler_recoveries_total[{RATE}]))",
                "{{cause}}",
            ),
            decimals=0,
            stack=True,
        )
    )
    d.add(
        panel(
            "bargauge",
            "Recovery time by phase (range)",
            "Median and 99th percentile of each phase over the range: detect (failure to "
            "noticed), decide (to the decision), resume (restore and re-form, to the first "
            "step of the new generation).",
            [
                target(
                    f"histogram_quantile({q}, sum by (le, phase) "
                    f"(increase(pitstop_scheduler_recovery_phase_seconds_bucket{{{phase}}}[$__range])))",
                    f"{{{{phase}}}} p{int(q * 100)}",
                    instant=True,
                )
                for q in (0.5, 0.99)
            ],
            unit="s",
            options={"orientation": "horizontal", "displayMode": "gradient"},
            thresholds=[(None, "green"), (1, "orange"), (10, "red")],
        )
    )
    d.row("Time by phase")
    d.add(
        panel(
            "bargauge",
            "Recovery time histogram by phase (range)",
            "How many recoveries' phases fell in each time bucket over the range.",
            [
                target(
                    "sum by (le) (increase("
                    f"pitstop_scheduler_recovery_phase_seconds_bucket{{{phase}}}[$__range]))",
                    "{{le}}",
                    instant=True,
                    fmt="heatmap",
                )
            ],
            decimals=0,
            options={"orientation": "vertical", "displayMode": "basic"},
            thresholds=[(None, "blue")],
        )
    )
    d.add(
        panel(
            "heatmap",
            "Recovery time heatmap",
            "Recoveries over time, by how long each took from failure to stepping again.",
            [
                target(
                    "sum by (le) "
                    "(increase(pitstop_scheduler_recovery_seconds_bucket[$__interval]))",
                    "{{le}}",
                    fmt="heatmap",
                )
            ],
            options={"calculate": False, "yAxis": {"unit": "s"}, "cellGap": 1},
        )
    )
    d.add(
        series(
            "Mean time by phase",
            "Mean seconds of each phase, over the last hour's recoveries.",
            target(
                "sum by (phase) (increase("
                f"pitstop_scheduler_recovery_phase_seconds_sum{{{phase}}}[1h])) "
                "/ sum by (phase) (increase("
                f"pitstop_scheduler_recovery_phase_seconds_count{{{phase}}}[1h]))",
                "{{phase}}",
            ),
            unit="s",
            stack=True,
        )
    )
    d.add(
        series(
            "Steps lost by cause",
            "Steps recoveries gave up, by cause.",
            target(
                f"sum by (cause) (increase(pitstop_scheduler_recovery_lost_steps_total[{RATE}]))",
                "{{cause}}",
            ),
            decimals=0,
        )
    )
    d.row("Goodput and what drives it")
    d.add(
        series(
            "Goodput by job",
            "Each live job's productive share of its time.",
            target("max by (job_id) (pitstop_scheduler_job_goodput_ratio)", "{{job_id}}"),
            unit="percentunit",
            maximum=1,
        )
    )
    d.add(
        series(
            "Nodes unhealthy or lost",
            "Nodes the scheduler holds unhealthy or lost.",
            target(
                "sum by (state) (max by (state, role) "
                '(pitstop_scheduler_nodes{state=~"unhealthy|lost"}))',
                "{{state}}",
            ),
            decimals=0,
        )
    )
    d.add(
        series(
            "Decision latency p99",
            "Time to decide and commit a recovery or a placement.",
            target(
                "histogram_quantile(0.99, sum by (le, decision) "
                f"(rate(pitstop_scheduler_decision_seconds_bucket[{RATE}])))",
                "{{decision}}",
            ),
            unit="s",
        )
    )
    d.add(
        series(
            "Heartbeat lag p99",
            "Detection is as slow as heartbeats are late.",
            target(
                "histogram_quantile(0.99, sum by (le) "
                f"(rate(pitstop_scheduler_heartbeat_lag_seconds_bucket[{RATE}])))",
                "p99",
            ),
            unit="s",
        )
    )
    return d
