"""Every daemon refuses a bad setting the same way (pitstop.common.settings): one line on
stderr naming the program, the field, the value and the fix, exit status 2, and no
traceback — the scheduler included, which used to start with any log level and crash."""

from __future__ import annotations

import os

import pytest
import typer
from typer.testing import CliRunner

from pitstop.agent.main import app as agent_app
from pitstop.checkpointd.main import app as checkpointd_app
from pitstop.scheduler.main import app as scheduler_app

DAEMONS = [
    ("pitstop-scheduler", scheduler_app, []),
    ("pitstop-agent", agent_app, ["run", "--gpus", "sim:2"]),
    ("pitstop-checkpointd", checkpointd_app, ["run"]),
]


@pytest.mark.parametrize(("program", "app", "args"), DAEMONS, ids=[d[0] for d in DAEMONS])
def test_a_bad_log_level_is_refused_naming_the_field_and_the_choices(
    program: str, app: typer.Typer, args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("PITSTOP_")]:
        monkeypatch.delenv(key)
    result = CliRunner().invoke(app, [*args, "--log-level", "LOUD"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"{program}: invalid configuration:" in result.output
    assert "'LOUD': use one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("program", "app", "args"), DAEMONS, ids=[d[0] for d in DAEMONS])
def test_a_missing_config_file_is_refused_naming_the_path(
    program: str, app: typer.Typer, args: list[str], tmp_path: os.PathLike[str]
) -> None:
    missing = f"{tmp_path}/nowhere.yaml"
    result = CliRunner().invoke(app, [*args, "--config", missing])
    assert result.exit_code == 2, result.output
    assert f"{program}: invalid configuration:" in result.output
    assert missing in result.output
