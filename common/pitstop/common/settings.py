"""The one settings loader of pitstop's daemons: defaults < YAML config file < environment
(each daemon's prefix) < command-line flags, with pydantic-settings.

A daemon's settings class derives from `LayeredSettings` (which reads the flags given
and the environment, and never a .env file or secrets directory) and loads with
`load_layered`, which adds the config file under both. `check_log_level` and
`one_line` are the validation and the error wording the daemons share; `settings_or_exit`
and `configure_logging` are how each daemon's command starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

S = TypeVar("S", bound="LayeredSettings")
T = TypeVar("T")


class LayeredSettings(BaseSettings):
    """Settings read from the flags given (init arguments), then the environment, then
    the YAML file its model_config names (`load_layered` sets it)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if settings_cls.model_config.get("yaml_file") is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))


def load_layered(settings_cls: type[S], config_file: Path | None, flags: dict[str, Any]) -> S:
    """`settings_cls` from its defaults, the YAML `config_file` (when given), its
    environment variables and `flags` (flags win; a flag given as None is not given).
    Raises FileNotFoundError for a config file that does not exist, and pydantic's
    ValidationError for a value it refuses."""
    given = {k: v for k, v in flags.items() if v is not None}
    if config_file is None:
        return settings_cls(**given)
    if not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist; fix the --config path")

    class FileSettings(settings_cls):  # type: ignore[valid-type, misc]
        model_config = SettingsConfigDict(yaml_file=config_file)

    settings: S = FileSettings(**given, config_file=config_file)
    return settings


def check_log_level(value: str) -> str:
    """`value` upper-cased when it names a log level; ValueError otherwise."""
    level = value.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"log_level {value!r}: use one of {', '.join(LOG_LEVELS)}")
    return level


def log_level_number(level: str) -> int:
    """A checked log level as a `logging` number."""
    return logging.getLevelNamesMapping()[level]


def one_line(exc: ValidationError) -> str:
    """A settings ValidationError in one line: `field: message; field: message`."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "config"
        parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


EXIT_BAD_CONFIG = 2
"""A daemon's exit status when its settings are refused."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Every daemon's log line: time, level, logger, message."""


def settings_or_exit(program: str, build: Callable[[], T], *, full_errors: bool = False) -> T:
    """`build()`, the daemon's settings; or, when they are refused (a bad value, a missing
    or unreadable config file), ``<program>: invalid configuration: <why>`` on stderr and
    exit status 2. The why is `one_line` unless `full_errors` (pydantic's own text)."""
    try:
        return build()
    except ValidationError as exc:
        why = str(exc) if full_errors else one_line(exc)
    except (FileNotFoundError, ValueError) as exc:
        why = str(exc)
    typer.echo(f"{program}: invalid configuration: {why}", err=True)
    raise typer.Exit(EXIT_BAD_CONFIG)


def configure_logging(level: int | str) -> None:
    """The daemon's logging: `level`, in `LOG_FORMAT`, on stderr."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
