"""`pitstop-agent install`: the unit and the example config, identical to deploy/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kit.agents import AGENT_BINARY
from pitstop.agent.config import load_settings
from pitstop.agent.install import DEFAULT_EXECUTABLE, example_config, install, render_unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_install_writes_the_checked_in_files_byte_for_byte(tmp_path: Path) -> None:
    result = install(tmp_path, DEFAULT_EXECUTABLE)
    unit = tmp_path / "etc/systemd/system/pitstop-agent.service"
    config = tmp_path / "etc/pitstop/agent.yaml"
    assert result.written == [unit, config]
    assert result.kept == []
    assert unit.read_bytes() == (DEPLOY / "systemd/pitstop-agent.service").read_bytes()
    assert config.read_bytes() == (DEPLOY / "agent.yaml").read_bytes()
    # One file, not two copies: deploy/agent.yaml is the package's.
    packaged = Path(__file__).resolve().parents[2] / "agent/pitstop/agent/agent.yaml"
    assert (DEPLOY / "agent.yaml").resolve() == packaged


def test_the_unit_restarts_and_stops_the_agent_the_way_it_needs() -> None:
    lines = render_unit("/opt/pitstop/bin/pitstop-agent").splitlines()
    for line in (
        "ExecStart=/opt/pitstop/bin/pitstop-agent run --config /etc/pitstop/agent.yaml",
        "Restart=always",
        "RestartSec=1",
        "KillMode=mixed",
        "TimeoutStopSec=30",
        "After=network-online.target",
        "WantedBy=multi-user.target",
    ):
        assert line in lines


def test_an_existing_config_is_never_overwritten(tmp_path: Path) -> None:
    config = tmp_path / "etc/pitstop/agent.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("scheduler: 10.0.0.5:50051\n")
    result = install(tmp_path)
    assert result.kept == [config]
    assert result.written == [tmp_path / "etc/systemd/system/pitstop-agent.service"]
    assert config.read_text() == "scheduler: 10.0.0.5:50051\n"
    assert example_config().startswith("# pitstop agent configuration.")


def test_the_command_names_the_running_executable_and_says_what_it_did(tmp_path: Path) -> None:
    command = [str(AGENT_BINARY), "install", "--prefix", str(tmp_path)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    unit = tmp_path / "etc/systemd/system/pitstop-agent.service"
    config = tmp_path / "etc/pitstop/agent.yaml"
    assert first.stdout.splitlines() == [
        f"wrote {unit}",
        f"wrote {config}",
        "next: systemctl daemon-reload && systemctl enable --now pitstop-agent",
    ]
    assert f"ExecStart={AGENT_BINARY} run --config /etc/pitstop/agent.yaml\n" in unit.read_text()
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert f"kept {config}: it exists and is never overwritten" in again.stdout.splitlines()


def test_a_join_token_is_installed_readable_by_root_only_and_turns_tls_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    command = [
        str(AGENT_BINARY),
        "install",
        "--prefix",
        str(tmp_path),
        "--join-token",
        "pst_join_abc",
        "--ca-file",
        str(ca),
        "--scheduler",
        "10.0.0.5:50051",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    env = tmp_path / "etc/pitstop/agent.env"
    assert f"wrote {env}" in done.stdout.splitlines()
    assert env.stat().st_mode & 0o777 == 0o600
    assert env.read_text().splitlines() == [
        "PITSTOP_AGENT_TLS=true",
        "PITSTOP_AGENT_JOIN_TOKEN=pst_join_abc",
        f"PITSTOP_AGENT_CA_FILE={ca}",
        "PITSTOP_AGENT_SCHEDULER=10.0.0.5:50051",
    ]
    unit = (tmp_path / "etc/systemd/system/pitstop-agent.service").read_text()
    assert "EnvironmentFile=-/etc/pitstop/agent.env\n" in unit
    # The variables are the agent's own settings: they load, TLS on, the token given.
    loaded = dict(line.split("=", 1) for line in env.read_text().splitlines())
    for key, value in loaded.items():
        monkeypatch.setenv(key, value)
    settings = load_settings(None)
    assert settings.tls
    assert settings.join_token == "pst_join_abc"
    assert settings.ca_file == ca
    assert settings.scheduler == "10.0.0.5:50051"


def test_a_join_token_without_its_ca_is_refused_naming_both(tmp_path: Path) -> None:
    command = [str(AGENT_BINARY), "install", "--prefix", str(tmp_path), "--join-token", "t"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "give both --join-token and --ca-file" in done.stderr
    assert not (tmp_path / "etc/pitstop/agent.env").exists()
