"""`pitstop-agent install`: the unit and the example config, identical to deploy/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pitstop.agent.install import DEFAULT_EXECUTABLE, EXAMPLE_CONFIG, install, render_unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
AGENT_BINARY = Path(sys.executable).with_name("pitstop-agent")


def test_install_writes_the_checked_in_files_byte_for_byte(tmp_path: Path) -> None:
    result = install(tmp_path, DEFAULT_EXECUTABLE)
    unit = tmp_path / "etc/systemd/system/pitstop-agent.service"
    config = tmp_path / "etc/pitstop/agent.yaml"
    assert result.written == [unit, config]
    assert result.kept == []
    assert unit.read_bytes() == (DEPLOY / "systemd/pitstop-agent.service").read_bytes()
    assert config.read_bytes() == (DEPLOY / "agent.yaml").read_bytes()


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
    assert EXAMPLE_CONFIG.startswith("# pitstop agent configuration.")


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
