"""Job spec validation: every bad field is named, with the value and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.jobspec import validate_job_spec
from pitstop.scheduler.reconcile.commands import rank_policy_env
from pitstop.scheduler.reconcile.hangs import threshold
from pitstop.trainer.config import RankConfig
from pitstop.v1 import jobs_pb2


def make(**fields: Any) -> jobs_pb2.JobSpec:
    values: dict[str, Any] = {"name": "tiny", "command": ["python", "train.py"]}
    values.update(fields)
    return jobs_pb2.JobSpec(**values)


def test_defaults_fill_unset_fields() -> None:
    spec = validate_job_spec(make(dp=4))
    assert (spec.tp, spec.pp, spec.dp, spec.gpus_per_node) == (1, 1, 4, 8)
    assert spec.min_dp == 4
    assert spec.max_restarts == 3
    assert spec.checkpoint.snapshot_every_steps == 1
    assert spec.checkpoint.keep_in_memory == 2
    assert spec.checkpoint.keep_durable == 3
    assert spec.straggler.action == jobs_pb2.STRAGGLER_ACTION_REPORT
    assert spec.straggler.warmup_steps == 10
    integrity = spec.integrity
    assert not integrity.sdc_check_disabled
    assert not integrity.spike_watch_disabled
    assert (integrity.loss_window, integrity.spike_sigma, integrity.max_rollbacks) == (100, 5, 3)
    assert (integrity.hang_floor_seconds, integrity.hang_step_multiple) == (10, 10)


def test_explicit_zero_restarts_and_warmup_are_kept() -> None:
    spec = validate_job_spec(
        make(max_restarts=0, straggler=jobs_pb2.StragglerPolicy(warmup_steps=0))
    )
    assert spec.max_restarts == 0
    assert spec.straggler.warmup_steps == 0


def test_a_job_may_tune_the_trainers_timeouts() -> None:
    spec = validate_job_spec(make(dp=4, env={"PITSTOP_COLLECTIVE_TIMEOUT": "5"}))
    assert spec.env["PITSTOP_COLLECTIVE_TIMEOUT"] == "5"


def test_a_job_may_name_modules_to_preload() -> None:
    names = ["transformers", "my_models.llama"]
    assert list(validate_job_spec(make(preload_modules=names)).preload_modules) == names


def test_the_input_is_not_modified() -> None:
    original = make()
    validate_job_spec(original)
    assert original.gpus_per_node == 0


@pytest.mark.parametrize(
    ("fields", "field", "fix_part"),
    [
        ({"name": ""}, "spec.name", "give the job a name"),
        ({"name": "Big_Job"}, "spec.name", "lowercase"),
        ({"name": "a" * 64}, "spec.name", "at most 63"),
        ({"name": "ok\x00"}, "spec.name", "NUL"),
        ({"name": "tiny\n"}, "spec.name", "lowercase"),
        ({"command": []}, "spec.command", "command each rank runs"),
        ({"command": ["  "]}, "spec.command[0]", "program"),
        ({"command": ["python", "a\x00b"]}, "spec.command[1]", "NUL"),
        ({"tp": 16}, "spec.tp", "inside one node"),
        ({"tp": 3}, "spec.tp", "divide gpus_per_node"),
        ({"gpus_per_node": 65}, "spec.gpus_per_node", "at most 64"),
        ({"dp": 2, "min_dp": 3}, "spec.min_dp", "at most dp"),
        ({"tp": 8, "pp": 1000, "dp": 1000}, "spec.dp", "at most 1000000"),
        ({"priority": 5000}, "spec.priority", "-1000 to 1000"),
        ({"env": {"RANK": "3"}}, "spec.env.RANK", "set by pitstop"),
        ({"env": {"PITSTOP_X": "1"}}, "spec.env.PITSTOP_X", "set by pitstop"),
        ({"env": {"1BAD": "1"}}, "spec.env.1BAD", "letters, digits"),
        ({"env": {"BAD\n": "1"}}, "spec.env.BAD\n", "letters, digits"),
        ({"preload_modules": ["ok", "my models"]}, "spec.preload_modules[1]", "as `import`"),
        ({"preload_modules": ["a..b"]}, "spec.preload_modules[0]", "e.g. transformers"),
        ({"preload_modules": ["torch\n"]}, "spec.preload_modules[0]", "as `import`"),
        ({"preload_modules": ["m"] * 33}, "spec.preload_modules", "at most 32"),
        (
            {"checkpoint": jobs_pb2.CheckpointPolicy(durable_url="not a url")},
            "spec.checkpoint.durable_url",
            "fsspec URL",
        ),
        (
            {"checkpoint": jobs_pb2.CheckpointPolicy(keep_in_memory=17)},
            "spec.checkpoint.keep_in_memory",
            "at most 16",
        ),
        (
            {"straggler": jobs_pb2.StragglerPolicy(threshold=float("nan"))},
            "spec.straggler.threshold",
            "positive",
        ),
        (
            {"straggler": jobs_pb2.StragglerPolicy(threshold=-1)},
            "spec.straggler.threshold",
            "positive",
        ),
        (
            {"straggler": jobs_pb2.StragglerPolicy(action=7)},
            "spec.straggler.action",
            "report or swap",
        ),
        (
            {"integrity": jobs_pb2.IntegrityPolicy(loss_window=1)},
            "spec.integrity.loss_window",
            "2 to 100000",
        ),
        (
            {"integrity": jobs_pb2.IntegrityPolicy(spike_sigma=float("nan"))},
            "spec.integrity.spike_sigma",
            "positive",
        ),
        (
            {"integrity": jobs_pb2.IntegrityPolicy(hang_floor_seconds=0.5)},
            "spec.integrity.hang_floor_seconds",
            "1 to 86400 seconds",
        ),
        (
            {"integrity": jobs_pb2.IntegrityPolicy(hang_step_multiple=1)},
            "spec.integrity.hang_step_multiple",
            "2 to 10000",
        ),
        (
            {"integrity": jobs_pb2.IntegrityPolicy(loss_window=10, max_rollbacks=11)},
            "spec.integrity.max_rollbacks",
            "at most loss_window (10)",
        ),
    ],
)
def test_bad_fields_are_named(fields: dict[str, Any], field: str, fix_part: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_job_spec(make(**fields))
    assert err.value.field == field
    message = str(err.value)
    assert message.startswith(f"{field}: ")
    assert fix_part in message


def test_valid_durable_urls_are_accepted() -> None:
    for url in ("file:///var/lib/pitstop", "s3://bucket/prefix", "gs://b/p"):
        spec = validate_job_spec(make(checkpoint=jobs_pb2.CheckpointPolicy(durable_url=url)))
        assert spec.checkpoint.durable_url == url


def test_the_ranks_are_told_the_snapshot_interval_the_integrity_policy_and_the_skips() -> None:
    spec = validate_job_spec(
        make(
            dp=4,
            checkpoint=jobs_pb2.CheckpointPolicy(snapshot_every_steps=5),
            integrity=jobs_pb2.IntegrityPolicy(sdc_check_disabled=True, spike_sigma=4),
        )
    )
    env = rank_policy_env(spec, [40, 17])
    assert env == {
        "PITSTOP_SNAPSHOT_EVERY": "5",
        "PITSTOP_SDC_CHECK": "0",
        "PITSTOP_SPIKE_WATCH": "1",
        "PITSTOP_LOSS_WINDOW": "100",
        "PITSTOP_SPIKE_SIGMA": "4.0",
        "PITSTOP_MAX_ROLLBACKS": "3",
        "PITSTOP_SKIP_STEPS": "17,40",
    }
    # What the rank makes of it is what the spec said.
    config = RankConfig.from_env(env)
    assert (config.snapshot_every, config.integrity.sdc_check) == (5, False)
    assert config.integrity.spike_sigma == 4.0
    assert config.skip_steps == {17, 40}


def test_the_hang_threshold_is_a_multiple_of_the_step_time_above_its_floor() -> None:
    policy = validate_job_spec(make()).integrity
    assert threshold(policy, 0.1) == 10.0  # the floor
    assert threshold(policy, 3.0) == 30.0  # 10 steps
    assert threshold(jobs_pb2.IntegrityPolicy(), 0.0) == 10.0  # a spec from before the fields


def test_a_job_goes_to_the_default_project_and_may_be_preempted_after_a_minute() -> None:
    accepted = validate_job_spec(jobs_pb2.JobSpec(name="a", command=["x"]))
    assert accepted.project == "default"
    assert not accepted.preemptible
    assert accepted.min_run_seconds == 60
    explicit = jobs_pb2.JobSpec(name="a", command=["x"], project="vision", min_run_seconds=0)
    accepted = validate_job_spec(explicit)
    assert (accepted.project, accepted.min_run_seconds) == ("vision", 0)


@pytest.mark.parametrize("project", ["Vision", "9lives", "a" * 64, "team_a"])
def test_a_bad_project_name_is_refused_naming_the_field(project: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validate_job_spec(jobs_pb2.JobSpec(name="a", command=["x"], project=project))
    assert refused.value.field == "spec.project"
    assert "lowercase letters" in str(refused.value) or "at most 63" in str(refused.value)
