"""Agent settings: defaults, file < environment < flags, derived defaults, clear errors."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pitstop.agent.config import AgentSettings, check_gpus_spec, load_settings
from pitstop.agent.main import app

DEPLOY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "agent.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("PITSTOP_AGENT_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    settings = load_settings()
    assert settings.node_id == socket.gethostname()
    assert settings.scheduler == "127.0.0.1:50051"
    assert settings.gpus == "nvml"
    assert settings.role == "worker"
    assert settings.state_dir == Path("/var/lib/pitstop/agent")
    assert settings.socket_path == Path("/var/lib/pitstop/agent/agent.sock")
    assert (settings.metrics_host, settings.metrics_port) == ("127.0.0.1", 9400)
    assert settings.heartbeat_interval_seconds == 1.0
    assert settings.reconnect_max_seconds == 2.0
    assert not settings.allow_fault_injection  # real GPUs: no injected faults


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("zone: from-file\nblock: from-file\nrack: from-file\ngpus: sim:4\n")
    monkeypatch.setenv("PITSTOP_AGENT_BLOCK", "from-env")
    monkeypatch.setenv("PITSTOP_AGENT_RACK", "from-env")
    settings = load_settings(config, rack="from-flag", zone=None)
    assert (settings.zone, settings.block, settings.rack) == ("from-file", "from-env", "from-flag")
    assert settings.gpus == "sim:4"
    assert settings.config_file == config


def test_socket_path_and_fault_injection_follow_other_settings(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\ngpus: sim:2\n")
    settings = load_settings(config)
    assert settings.socket_path == tmp_path / "state" / "agent.sock"
    assert settings.allow_fault_injection  # simulated GPUs take injected faults by default
    explicit = load_settings(config, socket_path=tmp_path / "s.sock", allow_fault_injection=False)
    assert explicit.socket_path == tmp_path / "s.sock"
    assert not explicit.allow_fault_injection


@pytest.mark.parametrize("spec", ["sim:0", "sim:65", "sim", "sim:x", "nvml:1", "cuda", ""])
def test_bad_gpus_specs_are_refused_naming_the_value(spec: str) -> None:
    with pytest.raises(ValidationError) as err:
        AgentSettings(gpus=spec)
    assert "gpus" in str(err.value)
    assert f"{spec!r} is no GPU backend: use nvml or sim:N with N from 1 to 64" in str(err.value)


def test_good_gpus_specs_are_normalised() -> None:
    assert check_gpus_spec(" nvml ") == "nvml"
    assert check_gpus_spec("sim:08") == "sim:8"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("role", "boss", "worker"),
        ("scheduler", "no-port", "host:port"),
        ("log_level", "LOUD", "DEBUG"),
        ("metrics_port", 70000, "65535"),
        ("heartbeat_interval_seconds", 0, "greater than 0"),
        ("checkpointd_address", "no-port", "host:port"),
        ("checkpointd_address", "host:99999", "host:port"),
        ("checkpointd_command", "pitstop-checkpointd run --node-id 'n1", "quotes"),
        ("checkpointd_probe_misses", 0, "greater than or equal to 1"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        AgentSettings(**{field: value})
    assert field in str(err.value)
    assert words in str(err.value)


def test_unknown_keys_in_the_file_are_errors(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("schedular: 10.0.0.1:50051\n")
    with pytest.raises(ValidationError, match="schedular"):
        load_settings(config)


def test_a_missing_config_file_is_named() -> None:
    with pytest.raises(FileNotFoundError, match=r"no-such\.yaml"):
        load_settings(Path("/no-such.yaml"))


def test_the_example_config_gives_the_defaults_and_documents_every_setting() -> None:
    assert load_settings(DEPLOY_CONFIG).model_dump(exclude={"config_file"}) == (
        load_settings().model_dump(exclude={"config_file"})
    )
    text = DEPLOY_CONFIG.read_text()
    documented = dict(re.findall(r"^# (\w+): (.*)$", text, flags=re.MULTILINE))
    assert set(documented) == set(AgentSettings.model_fields) - {"config_file"}


def test_the_example_config_uncommented_is_valid(tmp_path: Path) -> None:
    uncommented = re.sub(r"^# (\w+: )", r"\1", DEPLOY_CONFIG.read_text(), flags=re.MULTILINE)
    config = tmp_path / "agent.yaml"
    config.write_text(uncommented)
    settings = load_settings(config)
    assert settings.node_id == "gpu-node-017"
    assert settings.model_dump(exclude={"config_file", "node_id"}) == load_settings().model_dump(
        exclude={"config_file", "node_id"}
    )


def test_run_with_a_bad_gpus_flag_exits_2_with_one_line() -> None:
    result = CliRunner().invoke(app, ["run", "--gpus", "sim:0"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr == (
        "pitstop-agent: invalid configuration: gpus: 'sim:0' is no GPU backend: "
        "use nvml or sim:N with N from 1 to 64\n"
    )


def test_run_with_a_missing_config_file_exits_2() -> None:
    result = CliRunner().invoke(app, ["run", "--config", "/no-such.yaml"])
    assert result.exit_code == 2
    assert "config file /no-such.yaml does not exist" in result.stderr


def test_an_owned_checkpointd_needs_its_address_and_is_split_like_a_shell() -> None:
    with pytest.raises(ValidationError, match="without checkpointd_address"):
        AgentSettings(checkpointd_command="pitstop-checkpointd run")
    settings = AgentSettings(
        checkpointd_address="127.0.0.1:7000",
        checkpointd_command="pitstop-checkpointd run --state-dir '/var/lib/my ckpt' --port 7000",
    )
    assert settings.checkpointd_argv == [
        "pitstop-checkpointd",
        "run",
        "--state-dir",
        "/var/lib/my ckpt",
        "--port",
        "7000",
    ]
    assert AgentSettings(checkpointd_address="127.0.0.1:7000").checkpointd_argv == []
