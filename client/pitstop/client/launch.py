"""Every pitstop daemon's command line and environment, built in one place.

The local cluster, the tests, the benches and the Slurm recipe start
``pitstop-scheduler``, ``pitstop-agent`` and ``pitstop-checkpointd`` through these
functions, so that a new daemon flag is one edit here. Each function returns an argv
list for `subprocess`; keyword arguments are the daemon's own flags (``node_id`` becomes
``--node-id``), ``None`` leaves a flag out, and ``extra`` appends anything else.

Secrets (database URLs, join tokens) go through the environment, never argv, so that
they stay out of ``ps``."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

FlagValue = str | int | float | Path | bool | None

PITSTOP_PREFIX = "PITSTOP_"


class LaunchError(RuntimeError):
    """A daemon cannot be launched from this environment (its console script is missing)."""


def binary(name: str) -> str:
    """A pitstop console script (``pitstop-agent``...): beside the running python first,
    then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise LaunchError(
            f"cannot find {name} next to {sys.executable} or on PATH; "
            "install pitstop (pip install pitstop) in this environment"
        )
    return found


def clean_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (the process environment by default) without any ``PITSTOP_*`` setting, so
    that a daemon or a tool started from a test or a bench reads only what it is given,
    then `extra` on top."""
    source = os.environ if base is None else base
    env = {key: value for key, value in source.items() if not key.startswith(PITSTOP_PREFIX)}
    env.update(extra)
    return env


def with_python_first(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with this python's bin directory first on PATH: a job's ``python`` is then
    the environment pitstop is installed in."""
    out = dict(env)
    here = str(Path(sys.executable).parent)
    path = out.get("PATH", os.defpath)
    if path.split(os.pathsep)[0] != here:
        out["PATH"] = here + os.pathsep + path
    return out


def flags(options: Mapping[str, FlagValue]) -> list[str]:
    """``{"node_id": "n1", "tls": True, "metrics_port": 0}`` as
    ``["--node-id", "n1", "--tls", "--metrics-port", "0"]``: None leaves a flag out,
    True writes it alone, False writes ``--no-<flag>``."""
    argv: list[str] = []
    for key, value in options.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def _program(script: str, module: str, as_module: bool) -> list[str]:
    return [sys.executable, "-m", module] if as_module else [binary(script)]


def scheduler_command(
    *,
    state_dir: Path | str | None = None,
    host: str | None = None,
    port: int | None = None,
    metrics_port: int | None = None,
    dashboard_port: int | None = None,
    config: Path | str | None = None,
    log_level: str | None = None,
    as_module: bool = False,
    extra: Iterable[str] = (),
) -> list[str]:
    """``pitstop-scheduler``. Its database and Redis URLs go in the environment
    (``PITSTOP_DATABASE_URL``, ``PITSTOP_REDIS_URL``), not here."""
    return [
        *_program("pitstop-scheduler", "pitstop.scheduler.main", as_module),
        *flags(
            {
                "config": config,
                "state_dir": state_dir,
                "host": host,
                "port": port,
                "metrics_port": metrics_port,
                "dashboard_port": dashboard_port,
                "log_level": log_level,
            }
        ),
        *extra,
    ]


def agent_command(
    *,
    node_id: str | None = None,
    scheduler: str | None = None,
    gpus: str | None = None,
    state_dir: Path | str | None = None,
    socket_path: Path | str | None = None,
    role: str | None = None,
    zone: str | None = None,
    block: str | None = None,
    rack: str | None = None,
    checkpointd_address: str | None = None,
    checkpointd_command: str | None = None,
    metrics_port: int | None = None,
    advertise_host: str | None = None,
    ca_file: Path | str | None = None,
    tls: bool | None = None,
    config: Path | str | None = None,
    log_level: str | None = None,
    fork_server: str | None = None,
    as_module: bool = False,
    extra: Iterable[str] = (),
) -> list[str]:
    """``pitstop-agent run``. ``tls=True`` writes ``--tls``, False ``--insecure``. A join
    token goes in the environment (``PITSTOP_AGENT_JOIN_TOKEN``)."""
    options: dict[str, FlagValue] = {
        "config": config,
        "node_id": node_id,
        "scheduler": scheduler,
        "gpus": gpus,
        "zone": zone,
        "block": block,
        "rack": rack,
        "role": role,
        "state_dir": state_dir,
        "socket_path": socket_path,
        "checkpointd_address": checkpointd_address,
        "metrics_port": metrics_port,
        "checkpointd_command": checkpointd_command,
        "advertise_host": advertise_host,
        "log_level": log_level,
        "fork_server": fork_server,
    }
    security = [] if tls is None else (["--tls"] if tls else ["--insecure"])
    return [
        *_program("pitstop-agent", "pitstop.agent.main", as_module),
        "run",
        *flags(options),
        *security,
        *flags({"ca_file": ca_file}),
        *extra,
    ]


def checkpointd_command(
    *,
    node_id: str | None = None,
    host: str | None = None,
    port: int | None = None,
    scheduler: str | None = None,
    state_dir: Path | str | None = None,
    durable_url: str | None = None,
    buddy: str | None = None,
    tls_dir: Path | str | None = None,
    config: Path | str | None = None,
    log_level: str | None = None,
    as_module: bool = False,
    extra: Iterable[str] = (),
) -> list[str]:
    """``pitstop-checkpointd run``. ``scheduler=""`` runs it without a scheduler. A join
    token goes in the environment (``PITSTOP_CHECKPOINTD_JOIN_TOKEN``)."""
    return [
        *_program("pitstop-checkpointd", "pitstop.checkpointd.main", as_module),
        "run",
        *flags(
            {
                "config": config,
                "node_id": node_id,
                "host": host,
                "port": port,
                "scheduler": scheduler,
                "state_dir": state_dir,
                "durable_url": durable_url,
                "buddy": buddy,
                "tls_dir": tls_dir,
                "log_level": log_level,
            }
        ),
        *extra,
    ]
