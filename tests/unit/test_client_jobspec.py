"""Job-spec YAML loading: good files become the right JobSpec, bad ones a message that
names the file, the field, the value and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.client.jobspec import JobSpecError, load_job_spec, parse_job_spec
from pitstop.v1 import jobs_pb2

FULL_SPEC = """\
name: tiny
command: [python, -m, pitstop.trainer.example, --steps, 100]
tp: 2
pp: 1
dp: 4
gpus_per_node: 8
min_dp: 2
spares: 1
priority: -5
max_restarts: 3
checkpoint:
  snapshot_every_steps: 1
  durable_every_steps: 50
  durable_url: file:///tmp/ckpt
  keep_in_memory: 2
  keep_durable: 3
  auto_interval: true
env:
  OMP_NUM_THREADS: 4
  MODE: fast
straggler:
  action: swap
  threshold: 4.5
  windows: 3
  window_steps: 20
  warmup_steps: 10
working_dir: /srv/train
project: vision
preemptible: true
min_run_seconds: 120
"""


def test_full_spec_loads_every_field(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(FULL_SPEC)
    spec = load_job_spec(path)
    assert spec.name == "tiny"
    assert list(spec.command) == ["python", "-m", "pitstop.trainer.example", "--steps", "100"]
    assert (spec.tp, spec.pp, spec.dp, spec.gpus_per_node) == (2, 1, 4, 8)
    assert (spec.min_dp, spec.spares, spec.priority, spec.max_restarts) == (2, 1, -5, 3)
    assert (spec.project, spec.preemptible, spec.min_run_seconds) == ("vision", True, 120)
    assert spec.checkpoint == jobs_pb2.CheckpointPolicy(
        snapshot_every_steps=1,
        durable_every_steps=50,
        durable_url="file:///tmp/ckpt",
        keep_in_memory=2,
        keep_durable=3,
        auto_interval=True,
    )
    assert dict(spec.env) == {"OMP_NUM_THREADS": "4", "MODE": "fast"}
    assert spec.straggler == jobs_pb2.StragglerPolicy(
        action=jobs_pb2.STRAGGLER_ACTION_SWAP,
        threshold=4.5,
        windows=3,
        window_steps=20,
        warmup_steps=10,
    )
    assert spec.working_dir == "/srv/train"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "command: python train.py --lr '1e-3 x'",
            jobs_pb2.JobSpec(command=["python", "train.py", "--lr", "1e-3 x"]),
            id="command-string-is-shell-split",
        ),
        pytest.param("straggler: {action: REPORT}", None, id="enum-any-case"),
        pytest.param("straggler: {action: STRAGGLER_ACTION_SWAP}", None, id="enum-full-name"),
        pytest.param(
            "dp: 2.0\nstraggler: {threshold: 5}",
            jobs_pb2.JobSpec(dp=2, straggler=jobs_pb2.StragglerPolicy(threshold=5.0)),
            id="integral-float-and-int-for-double",
        ),
        pytest.param(
            "checkpoint:\nname: a", jobs_pb2.JobSpec(name="a"), id="empty-section-is-unset"
        ),
        pytest.param("{}", jobs_pb2.JobSpec(), id="empty-mapping"),
    ],
)
def test_accepted_forms(text: str, expected: jobs_pb2.JobSpec | None) -> None:
    spec = parse_job_spec(text, "spec.yaml")
    if expected is not None:
        assert spec == expected


# (YAML text, fragments the message must contain). Every message starts with the file name.
BAD_SPECS = [
    pytest.param(
        "tpp: 2",
        ["spec.tpp: unknown field", "did you mean tp?", "valid fields: name, command"],
        id="unknown-field",
    ),
    pytest.param(
        "checkpoint: {snapshot_every: 2}",
        ["spec.checkpoint.snapshot_every: unknown field", "snapshot_every_steps"],
        id="unknown-nested-field",
    ),
    pytest.param('dp: "two"', ['spec.dp: "two" is not a whole number'], id="string-for-int"),
    pytest.param("dp: two", ['spec.dp: "two" is not a whole number'], id="bare-word-for-int"),
    pytest.param("dp: 2.5", ["spec.dp: 2.5 is not a whole number"], id="fraction-for-int"),
    pytest.param("dp: true", ["spec.dp: true is not a whole number"], id="bool-for-int"),
    pytest.param("dp: -1", ["spec.dp: -1 is out of range", "0 or more"], id="negative-unsigned"),
    pytest.param(
        "priority: 3000000000", ["spec.priority: 3000000000 is out of range"], id="int32-overflow"
    ),
    pytest.param("name: 123", ["spec.name: 123 is not a string", 'name: "123"'], id="int-for-str"),
    pytest.param(
        "straggler: {action: fast}",
        ['spec.straggler.action: "fast" is not a valid value', "report, swap"],
        id="unknown-enum-word",
    ),
    pytest.param(
        "straggler: {action: unspecified}",
        ['"unspecified" is not a valid value'],
        id="unspecified-enum",
    ),
    pytest.param(
        "straggler: {threshold: high}",
        ['spec.straggler.threshold: "high" is not a number'],
        id="string-for-double",
    ),
    pytest.param(
        "checkpoint: {auto_interval: maybe}",
        ['spec.checkpoint.auto_interval: "maybe" is not true or false'],
        id="string-for-bool",
    ),
    pytest.param("checkpoint: 5", ["spec.checkpoint: 5 is not a mapping"], id="scalar-for-message"),
    pytest.param("env: [A, B]", ['spec.env: ["A", "B"] is not a mapping'], id="list-for-map"),
    pytest.param("env: {A: [1]}", ["spec.env.A: [1] is not a string"], id="list-in-map"),
    pytest.param("env: {A: true}", ["spec.env.A: true is not a string"], id="bool-in-map"),
    pytest.param(
        "command: [python, null]", ["spec.command[1]: null is not a string"], id="null-in-list"
    ),
    pytest.param("command: 5", ["spec.command: 5 is not a list"], id="int-for-list"),
    pytest.param(
        "command: python 'unclosed",
        ["spec.command: cannot split", "No closing quotation"],
        id="unsplittable-command",
    ),
    pytest.param("- a\n- b", ["top level is a list, not a mapping"], id="top-level-list"),
    pytest.param("just words", ["top level is a string, not a mapping"], id="top-level-string"),
    pytest.param("", ["the file is empty"], id="empty-file"),
    pytest.param("name: a\ndp: 1\ndp: 2", ["line 3", 'key "dp" appears twice'], id="duplicate"),
    pytest.param("name: [a\ndp: 1", ["invalid YAML"], id="unclosed-bracket"),
    pytest.param("name: a\n  dp: 1: 2", ["line 2", "invalid YAML"], id="bad-indent"),
]


@pytest.mark.parametrize(("text", "fragments"), BAD_SPECS)
def test_bad_specs_name_the_file_field_and_value(text: str, fragments: list[str]) -> None:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(text, "tiny.yaml")
    message = str(caught.value)
    assert message.startswith("tiny.yaml: ")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(JobSpecError, match=r"nope\.yaml: cannot read the job spec"):
        load_job_spec(missing)


def test_job_spec_error_is_a_value_error() -> None:
    assert issubclass(JobSpecError, ValueError)


def test_semantics_are_left_to_the_server() -> None:
    # dp below min_dp and a zero tp are the scheduler's to reject, with INVALID_ARGUMENT.
    spec = parse_job_spec("tp: 0\ndp: 1\nmin_dp: 3", "spec.yaml")
    assert (spec.tp, spec.dp, spec.min_dp) == (0, 1, 3)


@given(
    name=st.text(min_size=1, max_size=20).filter(lambda s: s.strip() == s and s.isprintable()),
    dp=st.integers(min_value=0, max_value=2**32 - 1),
    priority=st.integers(min_value=-(2**31), max_value=2**31 - 1),
)
def test_round_trip_of_scalars(name: str, dp: int, priority: int) -> None:
    # JSON is YAML, and json.dumps quotes any text safely (ensure_ascii=False: PyYAML reads
    # a \u escape of an astral character as two lone surrogates).
    text = f"name: {json.dumps(name, ensure_ascii=False)}\ndp: {dp}\npriority: {priority}"
    spec = parse_job_spec(text, "spec.yaml")
    assert (spec.name, spec.dp, spec.priority) == (name, dp, priority)
