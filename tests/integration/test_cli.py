"""The ``pitstop`` CLI against a real scheduler (the ``scheduler`` fixture of tests/conftest.py).

Every test makes its own job names and node ids, so it never depends on another test's
rows; assertions look for those rows rather than counting.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner, Result

from kit.schedulers import SchedulerThread
from kit.stores import unique
from pitstop.client.cli import app
from pitstop.client.enums import JOB_STATES, enum_words
from pitstop.v1 import agent_pb2

TINY_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "tiny.yaml"


def pitstop(scheduler: SchedulerThread | None, *args: str, server: str | None = None) -> Result:
    address = server or (scheduler.address if scheduler else "127.0.0.1:1")
    # catch_exceptions=False: a traceback inside the CLI fails the test loudly.
    return CliRunner().invoke(app, ["--server", address, *args], catch_exceptions=False)


def ok_json(result: Result) -> Any:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def assert_one_line_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def write_spec(tmp_path: Path, **overrides: Any) -> tuple[Path, str]:
    """The tiny example (or a stand-in while it does not exist) under a unique name."""
    if TINY_EXAMPLE.exists():
        spec = yaml.safe_load(TINY_EXAMPLE.read_text())
    else:
        spec = {
            "command": ["python", "-c", "pass"],
            "tp": 1,
            "pp": 1,
            "dp": 2,
            "gpus_per_node": 1,
        }
    name = unique("cli")
    spec.update(name=name, **overrides)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, name


def submit(scheduler: SchedulerThread, tmp_path: Path) -> dict[str, Any]:
    path, name = write_spec(tmp_path)
    job: dict[str, Any] = ok_json(pitstop(scheduler, "job", "submit", "-f", str(path), "--json"))
    assert job["spec"]["name"] == name
    return job


def test_submit_list_show(scheduler: SchedulerThread, tmp_path: Path) -> None:
    job = submit(scheduler, tmp_path)
    assert job["id"]
    assert job["state"].startswith("JOB_STATE_")

    listed = ok_json(pitstop(scheduler, "job", "list", "--json"))
    assert isinstance(listed, list)
    assert job["id"] in {row["id"] for row in listed}

    shown = ok_json(pitstop(scheduler, "job", "show", job["id"], "--json"))
    assert shown["id"] == job["id"]
    assert shown["spec"]["name"] == job["spec"]["name"]

    human = pitstop(scheduler, "job", "show", job["id"])
    assert human.exit_code == 0, human.stderr
    assert job["spec"]["name"] in human.stdout
    table = pitstop(scheduler, "job", "list")
    assert table.exit_code == 0, table.stderr
    assert job["id"] in table.stdout


def test_submit_prints_id_and_state(scheduler: SchedulerThread, tmp_path: Path) -> None:
    path, name = write_spec(tmp_path)
    result = pitstop(scheduler, "job", "submit", "-f", str(path))
    assert result.exit_code == 0, result.stderr
    match = re.fullmatch(rf"submitted {name} as job (\S+): (\w+)( \(.*\))?\n", result.stdout)
    assert match, result.stdout
    shown = ok_json(pitstop(scheduler, "job", "show", match[1], "--json"))
    assert shown["spec"]["name"] == name
    # The state may have moved on since; the word printed must still be a job state.
    assert match[2] in enum_words(JOB_STATES)


def test_list_filters_by_state(scheduler: SchedulerThread, tmp_path: Path) -> None:
    job = submit(scheduler, tmp_path)
    assert pitstop(scheduler, "job", "cancel", job["id"]).exit_code == 0
    cancelled = ok_json(pitstop(scheduler, "job", "list", "--state", "cancelled", "--json"))
    assert job["id"] in {row["id"] for row in cancelled}
    assert {row["state"] for row in cancelled} == {"JOB_STATE_CANCELLED"}
    running = ok_json(pitstop(scheduler, "job", "list", "--state", "running", "--json"))
    assert job["id"] not in {row["id"] for row in running}


def test_cancel_twice_is_a_failed_precondition(scheduler: SchedulerThread, tmp_path: Path) -> None:
    job = submit(scheduler, tmp_path)
    first = pitstop(scheduler, "job", "cancel", job["id"], "--reason", "test over")
    assert first.exit_code == 0, first.stderr
    assert "cancelled" in first.stdout

    second = pitstop(scheduler, "job", "cancel", job["id"])
    assert_one_line_error(second, "(FAILED_PRECONDITION)")


def test_watch_replays_until_the_job_ends(scheduler: SchedulerThread, tmp_path: Path) -> None:
    job = submit(scheduler, tmp_path)
    assert pitstop(scheduler, "job", "cancel", job["id"]).exit_code == 0
    # The job has ended, so the replay reaches its final event and the command returns.
    result = pitstop(scheduler, "job", "watch", job["id"], "--json")
    assert result.exit_code == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events
    assert all(event["job_id"] == job["id"] for event in events)
    assert "cancelled" in events[-1]["to_state"].lower()


def test_show_unknown_job_is_not_found(scheduler: SchedulerThread) -> None:
    missing = unique("j-missing")
    result = pitstop(scheduler, "job", "show", missing)
    assert_one_line_error(result, missing, "(NOT_FOUND)")


def test_server_rejects_a_bad_spec_naming_the_field(
    scheduler: SchedulerThread, tmp_path: Path
) -> None:
    path, _ = write_spec(tmp_path, dp=0, min_dp=3)
    result = pitstop(scheduler, "job", "submit", "-f", str(path))
    assert_one_line_error(result, "(INVALID_ARGUMENT)", "dp")


def test_malformed_spec_never_reaches_the_server(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ndp: two\n")
    # No scheduler: the file is rejected before any connection is made.
    result = pitstop(None, "job", "submit", "-f", str(path))
    assert_one_line_error(result, "bad.yaml: spec.dp:", '"two" is not a whole number')


def test_node_lifecycle(scheduler: SchedulerThread) -> None:
    node_id = unique("node")
    scheduler.register_node(node_id, gpus=4, zone="zq", block="bq", rack="rq")

    listed = ok_json(pitstop(scheduler, "node", "list", "--json"))
    row = next(n for n in listed if n["id"] == node_id)
    assert row["role"] == "NODE_ROLE_WORKER"
    assert row["labels"]["rack"] == "rq"

    shown = ok_json(pitstop(scheduler, "node", "show", node_id, "--json"))
    assert shown["id"] == node_id
    assert len(shown["inventory"]["gpus"]) == 4
    human = pitstop(scheduler, "node", "show", node_id)
    assert human.exit_code == 0, human.stderr
    assert "zq/bq/rq" in human.stdout

    def state_after(*command: str) -> str:
        result = pitstop(scheduler, "node", *command)
        assert result.exit_code == 0, result.stderr
        node = ok_json(pitstop(scheduler, "node", "show", node_id, "--json"))
        return str(node["state"])

    assert state_after("cordon", node_id, "--reason", "bad fan") == "NODE_STATE_CORDONED"
    cordoned = ok_json(pitstop(scheduler, "node", "list", "--state", "cordoned", "--json"))
    assert node_id in {n["id"] for n in cordoned}
    assert state_after("uncordon", node_id) == "NODE_STATE_READY"

    result = pitstop(scheduler, "node", "set-role", node_id, "spare", "--reason", "hot spare")
    assert result.exit_code == 0, result.stderr
    assert "spare" in result.stdout
    spares = ok_json(pitstop(scheduler, "node", "list", "--role", "spare", "--json"))
    assert node_id in {n["id"] for n in spares}

    assert state_after("drain", node_id) == "NODE_STATE_DRAINING"
    assert state_after("uncordon", node_id) == "NODE_STATE_READY"

    events = ok_json(pitstop(scheduler, "events", "--node", node_id, "--json"))
    assert events
    assert all(event["node_id"] == node_id for event in events)


def test_inject_fault_reaches_the_agent(scheduler: SchedulerThread) -> None:
    node_id = unique("node")
    with scheduler.agent_stream(node_id, gpus=2) as agent:
        response = ok_json(
            pitstop(
                scheduler, "node", "inject-fault", node_id, "--gpu", "1", "--slow", "2", "--json"
            )
        )
        command = agent.next_command()
    assert int(response["command_id"]) == command.command_id
    assert command.inject_fault.gpu_index == 1
    assert command.inject_fault.slow_multiplier == 2.0


def test_inject_fault_without_agent_stream(scheduler: SchedulerThread) -> None:
    node_id = unique("node")
    with scheduler.agent_stream(node_id, gpus=2):
        pass  # registered, then the stream closed: the node has no agent stream now
    result = pitstop(scheduler, "node", "inject-fault", node_id, "--gpu", "0", "--xid", "79")
    # The scheduler's own UNAVAILABLE, not "cannot reach the scheduler".
    assert_one_line_error(result, node_id, "(UNAVAILABLE)")
    assert "cannot reach" not in result.stderr


def test_a_host_fault_goes_down_the_stream_as_its_flag_says(scheduler: SchedulerThread) -> None:
    node_id = unique("node")
    with scheduler.agent_stream(node_id, gpus=1) as agent:
        said = pitstop(scheduler, "node", "inject-fault", node_id, "--link-flap", "mlx5_0/1:4")
        assert said.exit_code == 0, said.stderr
        assert said.stdout.strip().startswith(f"sent --link-flap to node {node_id} (command ")
        flap = agent.next_command().inject_fault.host.link_flap
        pitstop(scheduler, "node", "inject-fault", node_id, "--link-degraded", "mlx5_1/1:200")
        slower = agent.next_command().inject_fault.host.link_degraded
        pitstop(scheduler, "node", "inject-fault", node_id, "--disk-restored")
        restored = agent.next_command().inject_fault.host
        pitstop(scheduler, "node", "inject-fault", node_id, "--pcie-correctable", "120")
        correctable = agent.next_command().inject_fault.host.pcie
        pitstop(scheduler, "node", "inject-fault", node_id, "--nic-pcie-degraded")
        nic = agent.next_command().inject_fault.host.pcie
    assert (flap.port, flap.count) == ("mlx5_0/1", 4)
    assert (slower.port, slower.rate_gbps) == ("mlx5_1/1", 200.0)
    assert restored.WhichOneof("kind") == "disk_full"
    assert restored.disk_full is False
    assert (correctable.role, correctable.correctable, correctable.degraded) == ("", 120, False)
    assert (nic.role, nic.degraded) == ("nic", True)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--link-flap", "mlx5_0/1"], "'mlx5_0/1' is not PORT:COUNT, e.g. mlx5_0/1:4"),
        (["--link-errors", "mlx5_0/1:0"], "'mlx5_0/1:0': COUNT must be 1 or more"),
        (["--link-degraded", "mlx5_0/1:fast"], "'mlx5_0/1:fast': GBPS must be a rate above 0"),
    ],
)
def test_a_malformed_host_fault_is_refused_naming_its_flag(flags: list[str], said: str) -> None:
    result = pitstop(None, "node", "inject-fault", "n-1", *flags)
    assert result.exit_code == 2
    words = " ".join(result.stderr.translate(str.maketrans("│╭╮╰╯─", "      ")).split())
    assert said in words, result.stderr
    assert flags[0] in result.stderr


def test_inject_fault_needs_exactly_one_kind() -> None:
    result = pitstop(None, "node", "inject-fault", "n-1", "--gpu", "0", "--xid", "79", "--clear")
    assert result.exit_code == 2
    assert "exactly one" in result.stderr


def test_unknown_node_is_not_found(scheduler: SchedulerThread) -> None:
    missing = unique("node-missing")
    assert_one_line_error(pitstop(scheduler, "node", "cordon", missing), missing, "(NOT_FOUND)")


def test_events_for_a_job(scheduler: SchedulerThread, tmp_path: Path) -> None:
    job = submit(scheduler, tmp_path)
    events = ok_json(pitstop(scheduler, "events", "--job", job["id"], "--json"))
    assert isinstance(events, list)
    assert events
    assert all(event["job_id"] == job["id"] for event in events)
    ids = [int(event["id"]) for event in events]
    assert ids == sorted(ids)

    human = pitstop(scheduler, "events", "--job", job["id"], "--limit", "1")
    assert human.exit_code == 0, human.stderr
    assert len(human.stdout.splitlines()) == 1
    assert f"job={job['id']}" in human.stdout


def git_tree(path: Path) -> str:
    """A git tree with one commit at `path`; its HEAD."""
    path.mkdir()
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "first"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
            cwd=path,
            check=True,
        )
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
    return head.stdout.strip()


def record_of(scheduler: SchedulerThread, job_id: str, generations: int) -> dict[str, Any]:
    """`job record --json` once the record holds `generations` generations."""
    deadline = time.monotonic() + 10
    while True:
        found: dict[str, Any] = ok_json(pitstop(scheduler, "job", "record", job_id, "--json"))
        if len(found["generations"]) >= generations or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_job_record_and_diff(scheduler: SchedulerThread, tmp_path: Path) -> None:
    """Submit takes the code of the spec's working_dir; a generation's run record, sent on
    its node's agent stream, shows in `job record`; `job diff` names what differs."""
    head = git_tree(tmp_path / "src")
    ids = []
    for digest in ("d" * 64, "e" * 64):
        path, _ = write_spec(tmp_path, working_dir=str(tmp_path / "src"))
        job = ok_json(pitstop(scheduler, "job", "submit", "-f", str(path), "--json"))
        ids.append(job["id"])
        with scheduler.agent_stream(unique("record-node"), gpus=1) as stream:
            record = agent_pb2.RunRecord(
                job_id=job["id"],
                generation=1,
                code=agent_pb2.CodeVersion(git_commit=head, working_dir=str(tmp_path / "src")),
                environment=agent_pb2.EnvironmentVersion(python="3.11.7", torch="2.13.0"),
                data_digest=digest,
                start_step=0,
            )
            stream.send(run_record=record)
            found = record_of(scheduler, job["id"], 1)
    a, b = ids

    assert found["job_id"] == b
    assert found["submitted_code"]["git_commit"] == head
    assert found["submitted_code"]["working_dir"] == str(tmp_path / "src")
    assert found["submitted_code"]["dirty"] is False
    assert found["generations"][0]["data_digest"] == "e" * 64
    assert found["generations"][0]["environment"]["torch"] == "2.13.0"

    human = pitstop(scheduler, "job", "record", a)
    assert human.exit_code == 0, human.stderr
    for section in ("spec", "code", "environment", "data", "durable checkpoints", "goodput"):
        assert section in human.stdout
    assert head in human.stdout
    assert "d" * 64 in human.stdout

    diff = ok_json(pitstop(scheduler, "job", "diff", a, b, "--json"))
    assert set(diff) == {"only_in_a", "only_in_b", "differ", "identity"}
    assert diff["differ"]["generations.0.data_digest"] == ["d" * 64, "e" * 64]
    assert diff["identity"]["job_id"] == [a, b]
    assert "generations.0.node_id" in diff["identity"]
    assert "spec.name" in diff["differ"]  # write_spec names every job anew
    assert "submitted_code.git_commit" not in diff["differ"]  # the same code

    table = pitstop(scheduler, "job", "diff", a, b)
    assert table.exit_code == 0, table.stderr
    assert "KEY" in table.stdout
    assert "generations.0.data_digest" in table.stdout
    missing = pitstop(scheduler, "job", "diff", a, "j-000000000000")
    assert_one_line_error(missing, "j-000000000000", "(NOT_FOUND)")


@pytest.mark.parametrize("command", [["job", "list"], ["node", "list"], ["events"]])
def test_unreachable_server(command: list[str]) -> None:
    # Nothing listens on port 1; the client retries briefly, then explains.
    result = pitstop(None, *command, server="127.0.0.1:1")
    assert_one_line_error(
        result,
        "cannot reach the pitstop scheduler at 127.0.0.1:1 (UNAVAILABLE)",
        "pass --server",
    )
