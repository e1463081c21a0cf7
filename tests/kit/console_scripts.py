"""pitstop's console scripts, parsed by their real CLIs: for the tests of the files that
run them (docker-compose.yml, the Helm chart), so a renamed flag or a bad value fails
in a test rather than in a container."""

from __future__ import annotations

import importlib
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from pitstop.agent.config import load_settings as agent_settings
from pitstop.checkpointd.config import load_settings as checkpointd_settings
from pitstop.scheduler.config import load_settings as scheduler_settings

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
SETTINGS: dict[str, Callable[..., Any]] = {
    "pitstop-scheduler": scheduler_settings,
    "pitstop-agent": agent_settings,
    "pitstop-checkpointd": checkpointd_settings,
}
"""Each daemon's settings loader: (config file, **flags) -> settings, with PITSTOP_* env."""

# The CLI's usage errors (an unknown flag, a bad value), from whichever click typer uses.
CLICK_ERROR: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)


def cli(binary: str) -> Any:
    """The click command behind console script `binary`."""
    module = SCRIPTS[binary].partition(":")[0]
    app = getattr(importlib.import_module(module), "app", None)
    assert isinstance(app, typer.Typer), f"{SCRIPTS[binary]} is no typer app: update this test"
    return typer.main.get_command(app)


def parse(binary: str, args: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse `binary args` with the real CLI; return the leaf command's path and params."""
    command, path, rest = cli(binary), binary, list(args)
    while True:
        ctx = command.make_context(path, rest)
        if not hasattr(command, "resolve_command"):  # a command, not a group
            return path, ctx.params
        head = getattr(ctx, "_protected_args", None)
        remaining = [*(ctx.protected_args if head is None else head), *ctx.args]
        sub_name, sub, rest = command.resolve_command(ctx, remaining)
        assert sub is not None, f"{path}: no subcommand in {args}"
        command, path = sub, f"{path} {sub_name}"
