"""`pitstop job diff`'s comparison (pitstop.client.render_record): two job records
flattened to dotted keys, every difference reported, the run's identity kept apart;
and `pitstop job record`'s rendering of every section."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from pitstop.client.render_record import diff_records, diff_view, flatten, record_view
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2


def record(job_id: str, **changes: Any) -> jobs_pb2.JobRecord:
    """A record of two generations, a durable checkpoint and a result."""
    code = agent_pb2.CodeVersion(git_commit="a" * 40, working_dir="/src")
    environment = agent_pb2.EnvironmentVersion(python="3.11.7", torch="2.13.0", env={"SEED": "1"})
    found = jobs_pb2.JobRecord(
        job_id=job_id,
        spec=jobs_pb2.JobSpec(name="gpt", command=["python", "train.py"], tp=1, pp=1, dp=2),
        state=common_pb2.JOB_STATE_SUCCEEDED,
        submitted_by="user:ada",
        submitted_code=code,
        generations=[
            jobs_pb2.GenerationRecord(
                generation=g,
                code=code,
                environment=environment,
                data_digest="d" * 64,
                start_step=10 * g,
                node_id=f"{job_id}-node-{g}",
            )
            for g in (1, 2)
        ],
        durable_checkpoints=[jobs_pb2.DurableCheckpoint(step=50, digest="c" * 64, shards=2)],
        skipped_steps=[17],
        result={"final_weights_sha256": "f" * 64},
        final_weights_hash="f" * 64,
        current_step=100,
    )
    found.created_at.FromSeconds(1_700_000_000 + len(job_id))
    for generation in found.generations:
        generation.recorded_at.FromSeconds(1_700_000_100 + len(job_id))
    for path, value in changes.items():
        *parents, name = path.split(".")
        target: Any = found
        for part in parents:
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        setattr(target, name, value)
    return found


def test_flatten_gives_dotted_keys_list_items_by_index() -> None:
    flat = dict(flatten({"a": {"b": 1, "c": [{"d": "x"}, {"d": "y"}]}, "e": [], "f": {}}))
    assert flat == {"a.b": 1, "a.c.0.d": "x", "a.c.1.d": "y"}


def test_two_runs_of_the_same_code_differ_only_in_identity() -> None:
    found = diff_records(record("j-aaaaaaaaaaaa"), record("j-bbbbbbbbbbbbbb"))
    assert found.same
    assert (found.only_in_a, found.only_in_b, found.differ) == ({}, {}, {})
    assert set(found.identity) == {
        "job_id",
        "created_at",
        "generations.0.recorded_at",
        "generations.0.node_id",
        "generations.1.recorded_at",
        "generations.1.node_id",
    }
    assert found.identity["job_id"] == ["j-aaaaaaaaaaaa", "j-bbbbbbbbbbbbbb"]


def test_every_difference_is_reported_by_key() -> None:
    a = record("j-a", **{"generations.1.code.dirty": True, "final_weights_hash": "1" * 64})
    b = record("j-b", **{"generations.1.environment.torch": "2.14.0", "current_step": 90})
    b.generations.add(generation=3, start_step=70)
    b.spec.env["LR"] = "0.1"
    a.skipped_steps.append(40)
    found = diff_records(a, b)
    assert found.differ == {
        "generations.1.code.dirty": [True, False],
        "generations.1.environment.torch": ["2.13.0", "2.14.0"],
        "final_weights_hash": ["1" * 64, "f" * 64],
        "current_step": [100, 90],
    }
    assert found.only_in_a == {"skipped_steps.1": 40}
    assert found.only_in_b["spec.env.LR"] == "0.1"
    assert found.only_in_b["generations.2.start_step"] == 70
    assert "generations.2.node_id" in found.only_in_b  # only one side has it: not identity
    assert not found.same
    assert set(found.to_json()) == {"only_in_a", "only_in_b", "differ", "identity"}


def rendered(renderable: Any) -> str:
    console = Console(width=240, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_diff_table_shows_key_a_and_b() -> None:
    a = record("j-a")
    b = record("j-b", **{"generations.0.data_digest": "e" * 64})
    text = rendered(diff_view(diff_records(a, b), "j-a", "j-b"))
    assert "generations.0.data_digest" in text
    assert "d" * 64 in text
    assert "e" * 64 in text
    assert "identity" in text
    same = rendered(diff_view(diff_records(a, record("j-c")), "j-a", "j-c"))
    assert "same record but for their identity" in same


def test_the_record_view_has_every_section() -> None:
    text = rendered(record_view(record("j-a", **{"generations.1.code.dirty": True})))
    for section in ("spec", "code", "environment", "data", "durable checkpoints", "goodput"):
        assert section in text
    assert "user:ada" in text
    assert "a" * 40 in text
    assert "dirty: changes sha256 unknown" in text  # digest not read
    assert "2.13.0" in text
    assert "SEED=1" in text
    assert "c" * 64 in text
    assert "skipped steps" in text
    assert "17" in text
    assert "final_weights_sha256" in text
    empty = rendered(record_view(jobs_pb2.JobRecord(job_id="j-new")))
    assert "no generation has reported yet" in empty
    assert "durable checkpoints: none complete" in empty
    assert "result: none reported" in empty
