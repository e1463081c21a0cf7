"""pitstop.client.launch builds command lines the daemons accept: every flag it writes is
a parameter of the daemon's own command, with the value it was given."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import typer.main
from typer.core import TyperGroup

from pitstop.agent.main import app as agent_app
from pitstop.checkpointd.main import app as checkpointd_app
from pitstop.client.launch import (
    LaunchError,
    agent_command,
    binary,
    checkpointd_command,
    clean_env,
    flags,
    scheduler_command,
)
from pitstop.scheduler.main import app as scheduler_app


def parsed(app: typer.Typer, argv: list[str]) -> dict[str, object]:
    """The parameters the daemon's command line parses to (no command runs)."""
    command = typer.main.get_command(app)
    args = argv[1:]
    if isinstance(command, TyperGroup):
        group = command.make_context("x", list(args), resilient_parsing=True)
        sub = command.get_command(group, args[0])
        assert sub is not None, args[0]
        return sub.make_context(args[0], args[1:]).params
    return command.make_context("x", args).params


def test_agent_command_parses_as_the_agent_reads_it(tmp_path: Path) -> None:
    argv = agent_command(
        node_id="n1",
        scheduler="127.0.0.1:7000",
        gpus="sim:4",
        state_dir=tmp_path,
        socket_path=tmp_path / "a.sock",
        role="spare",
        zone="z1",
        block="b1",
        rack="r2",
        checkpointd_address="127.0.0.1:7001",
        checkpointd_command="pitstop-checkpointd run --node-id n1",
        metrics_port=0,
        advertise_host="10.0.0.2",
        ca_file=tmp_path / "ca.crt",
        tls=True,
        log_level="DEBUG",
    )
    assert argv[0] == binary("pitstop-agent")
    params = parsed(agent_app, argv)
    assert params["node_id"] == "n1"
    assert params["gpus"] == "sim:4"
    assert params["role"] == "spare"
    assert params["socket_path"] == tmp_path / "a.sock"
    assert params["metrics_port"] == 0
    assert params["tls"] is True
    assert params["checkpointd_command"] == "pitstop-checkpointd run --node-id n1"
    assert parsed(agent_app, agent_command(node_id="n2", tls=False))["tls"] is False


def test_checkpointd_command_parses_as_the_daemon_reads_it(tmp_path: Path) -> None:
    argv = checkpointd_command(
        node_id="n1",
        host="127.0.0.1",
        port=0,
        scheduler="",
        state_dir=tmp_path,
        durable_url=tmp_path.as_uri(),
        buddy="127.0.0.1:7002",
        tls_dir=tmp_path / "tls",
        as_module=True,
    )
    assert argv[:3] == [sys.executable, "-m", "pitstop.checkpointd.main"]
    params = parsed(checkpointd_app, argv[2:])
    assert params["scheduler"] == ""
    assert params["port"] == 0
    assert params["durable_url"] == tmp_path.as_uri()
    assert params["tls_dir"] == tmp_path / "tls"


def test_scheduler_command_parses_as_the_scheduler_reads_it(tmp_path: Path) -> None:
    argv = scheduler_command(
        state_dir=tmp_path, host="127.0.0.1", port=0, metrics_port=0, dashboard_port=0
    )
    params = parsed(scheduler_app, argv)
    assert params["state_dir"] == tmp_path
    assert (params["port"], params["metrics_port"], params["dashboard_port"]) == (0, 0, 0)
    assert "--database-url" not in argv  # secrets travel in the environment


def test_flags_leave_out_none_and_write_booleans_alone() -> None:
    assert flags({"node_id": "n1", "tls": True, "quiet": False, "port": None}) == [
        "--node-id",
        "n1",
        "--tls",
        "--no-quiet",
    ]


def test_clean_env_drops_every_pitstop_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PITSTOP_AGENT_NODE_ID", "leaked")
    env = clean_env(PITSTOP_REDIS_URL="redis://x")
    assert "PITSTOP_AGENT_NODE_ID" not in env
    assert env["PITSTOP_REDIS_URL"] == "redis://x"
    assert env["PATH"] == os.environ["PATH"]
    assert clean_env({"PITSTOP_A": "1", "B": "2"}) == {"B": "2"}


def test_binary_names_what_is_missing() -> None:
    with pytest.raises(LaunchError, match="cannot find pitstop-nonesuch next to"):
        binary("pitstop-nonesuch")
