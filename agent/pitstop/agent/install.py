"""`pitstop-agent install`: the systemd unit and the example configuration.

The unit checked in under deploy/ is exactly what this writes for prefix "/" with the
agent at DEFAULT_EXECUTABLE (a test keeps them identical); the configuration it writes
is the package's agent.yaml, which deploy/agent.yaml links to.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

UNIT_PATH = Path("etc/systemd/system/pitstop-agent.service")
CONFIG_PATH = Path("etc/pitstop/agent.yaml")
CONFIG_FILE = "/" + CONFIG_PATH.as_posix()
ENV_PATH = Path("etc/pitstop/agent.env")
ENV_FILE = "/" + ENV_PATH.as_posix()
DEFAULT_EXECUTABLE = "/usr/local/bin/pitstop-agent"

_UNIT = """\
[Unit]
Description=pitstop agent: GPU health, heartbeats and rank supervision
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
# The node's enrollment (pitstop-agent install --join-token ...): the join token and
# the cluster CA, kept out of the unit and the config, readable by root only.
EnvironmentFile=-{env_file}
ExecStart={executable} run --config {config}
# Stop: SIGTERM to the agent only; it stops its ranks itself (SIGTERM, then SIGKILL
# after their grace) and exits. Whatever is left after TimeoutStopSec gets SIGKILL.
KillMode=mixed
TimeoutStopSec=30
Restart=always
RestartSec=1
# Exit code 2 is a bad configuration: restarting cannot fix it.
RestartPreventExitStatus=2
StateDirectory=pitstop/agent
Environment=PYTHONUNBUFFERED=1
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""


def example_config() -> str:
    """The example configuration: every setting at its default, said what it does. It
    ships in the package (pitstop/agent/agent.yaml); deploy/agent.yaml is a link to the
    same file, so a new setting is written once."""
    return resources.files("pitstop.agent").joinpath("agent.yaml").read_text(encoding="utf-8")


def render_unit(executable: str = DEFAULT_EXECUTABLE) -> str:
    """The systemd unit that runs `executable` with the installed configuration."""
    return _UNIT.format(executable=executable, config=CONFIG_FILE, env_file=ENV_FILE)


def current_executable() -> str:
    """Path of the running `pitstop-agent`, else the one on PATH, else the bare name."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "pitstop-agent" and os.access(argv0, os.X_OK):
        return str(argv0.absolute())
    return shutil.which("pitstop-agent") or "pitstop-agent"


@dataclass
class InstallResult:
    """What `install` wrote, and what it left alone because it already existed."""

    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Enrollment:
    """How the node enrolls at its first start: mutual TLS with a certificate got for a
    one-time join token, checking the scheduler against the cluster CA."""

    join_token: str
    ca_file: Path
    scheduler: str = ""
    """host:port of the scheduler's API; "": the config's."""

    def environment(self) -> str:
        lines = [
            "PITSTOP_AGENT_TLS=true",
            f"PITSTOP_AGENT_JOIN_TOKEN={self.join_token}",
            f"PITSTOP_AGENT_CA_FILE={self.ca_file}",
        ]
        if self.scheduler:
            lines.append(f"PITSTOP_AGENT_SCHEDULER={self.scheduler}")
        return "\n".join(lines) + "\n"


def install(
    prefix: Path, executable: str = DEFAULT_EXECUTABLE, enrollment: Enrollment | None = None
) -> InstallResult:
    """Write the unit (always: it belongs to the package) and the example configuration
    (only when none exists: it belongs to the operator) under `prefix`; with
    `enrollment`, the environment file that enrolls the node (mode 0600, replaced: a
    join token works once)."""
    result = InstallResult()
    unit = prefix / UNIT_PATH
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(render_unit(executable))
    result.written.append(unit)
    config = prefix / CONFIG_PATH
    config.parent.mkdir(parents=True, exist_ok=True)
    try:
        with config.open("x") as out:  # "x": never replace an operator's file
            out.write(example_config())
    except FileExistsError:
        result.kept.append(config)
    else:
        result.written.append(config)
    if enrollment is not None:
        env = prefix / ENV_PATH
        partial = env.with_suffix(".env.partial")
        partial.unlink(missing_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(enrollment.environment())
        os.replace(partial, env)
        result.written.append(env)
    return result
