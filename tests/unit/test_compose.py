"""docker-compose.yml and deploy/Dockerfile, checked without Docker.

Every pitstop command the compose file runs is parsed by the real CLI (the typer apps
behind the console scripts) and its settings are loaded, so a renamed flag or a bad
value fails here rather than in a container; the nodes must point at the scheduler
service and at each other by names the compose network resolves.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kit.console_scripts import CLICK_ERROR, PYPROJECT, ROOT, SCRIPTS, SETTINGS, parse
from pitstop.client.jobspec import load_job_spec
from pitstop.scheduler.config import SchedulerSettings
from pitstop.scheduler.config import load_settings as scheduler_settings

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"

Invocation = tuple[str, list[str]]  # (console script, its arguments)


def _compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = _compose()["services"]
    return services


def _pitstop_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in _services().items() if s.get("image", "").startswith("pitstop")}


def _nodes() -> dict[str, dict[str, Any]]:
    return {
        name: s for name, s in _pitstop_services().items() if "pitstop-agent" in str(s["command"])
    }


def _script(service: dict[str, Any]) -> str:
    """The shell script of a `bash -c` command, as the container's bash sees it."""
    command = service["command"]
    assert command[:2] == ["bash", "-c"], command
    return str(command[2]).replace("$$", "$")  # compose's escape for a literal $


def _invocations(name: str, service: dict[str, Any]) -> list[Invocation]:
    """Every pitstop console script the service runs, with shell variables expanded."""
    command = service["command"]
    if command[0] != "bash":
        return [(command[0], [str(arg) for arg in command[1:]])]
    variables = {"node": service.get("hostname", name), **service.get("environment", {})}

    def expand(match: re.Match[str]) -> str:
        key = match.group(1) or match.group(2)
        assert key in variables, f"{name}: ${key} is set neither by the script nor by compose"
        return str(variables[key])

    found = []
    for line in _script(service).replace("\\\n", " ").splitlines():
        words = line.strip().removeprefix("exec ").removesuffix("&").strip()
        words = re.sub(r"\s+>\s*\S+$", "", words)  # its output redirected to a file
        if words.split(" ", 1)[0] in SCRIPTS:
            expanded = re.sub(r"\$\{(\w+)\}|\$(?!\()(\w+)", expand, words)
            binary, *args = shlex.split(expanded)
            found.append((binary, args))
    return found


def _all_invocations() -> Iterator[tuple[str, Invocation]]:
    for name, service in _pitstop_services().items():
        for invocation in _invocations(name, service):
            yield name, invocation


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings under test come from the compose file only, run from the repo root."""
    for key in list(os.environ):
        if key.startswith("PITSTOP_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(ROOT)


def test_compose_file_parses_and_has_the_cluster() -> None:
    services = _services()
    assert {"postgres", "redis", "scheduler", "example-job"} <= set(services)
    nodes = _nodes()
    roles = sorted(str(s["environment"]["NODE_ROLE"]) for s in nodes.values())
    assert roles.count("worker") >= 2
    assert "spare" in roles
    for name in ("postgres", "redis"):
        assert services[name]["healthcheck"]["test"], name
    assert services["scheduler"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
    }


def test_every_console_script_in_the_compose_file_exists() -> None:
    used = {binary for _, (binary, _) in _all_invocations()}
    assert used == {"pitstop-scheduler", "pitstop-agent", "pitstop-checkpointd", "pitstop"}
    assert used <= set(SCRIPTS)


@pytest.mark.parametrize(
    ("service", "invocation"),
    [pytest.param(name, inv, id=f"{name}:{inv[0]}") for name, inv in _all_invocations()],
)
def test_command_parses_with_the_real_cli(service: str, invocation: Invocation) -> None:
    binary, args = invocation
    try:
        path, params = parse(binary, args)
    except CLICK_ERROR as exc:  # a flag the CLI does not know, a bad value
        pytest.fail(f"{service}: `{binary} {shlex.join(args)}`: {exc}")
    if binary in SETTINGS:
        config = params.pop("config", None)
        SETTINGS[binary](config, **params)  # raises on a value the daemon refuses
    else:
        assert path in ("pitstop job submit", "pitstop token create"), path


def test_scheduler_listens_for_the_other_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    service = _services()["scheduler"]
    ((binary, args),) = _invocations("scheduler", service)
    _, params = parse(binary, args)
    environment = {str(k): str(v) for k, v in service["environment"].items()}
    for key, value in environment.items():
        assert key.removeprefix("PITSTOP_").lower() in SchedulerSettings.model_fields, key
        monkeypatch.setenv(key, value)
    settings = scheduler_settings(params.pop("config", None), **params)
    assert settings.tls, "secure by default: the scheduler serves TLS"
    assert settings.tls_directory.is_relative_to(
        next(v.split(":")[1] for v in service["volumes"] if v.startswith("scheduler:"))
    ), "the CA lives in the scheduler's state volume"
    assert settings.host == "0.0.0.0"
    assert settings.metrics_host == "0.0.0.0"
    for url in (settings.database_url, settings.redis_url):
        assert urlsplit(url).hostname in _services(), url
    published = [str(p).split(":") for p in service["ports"]]
    assert [str(settings.port)] * 2 in published
    assert [str(settings.metrics_port)] * 2 in published


def test_nodes_point_at_the_scheduler_and_at_themselves() -> None:
    scheduler = dict(parse(*_invocations("scheduler", _services()["scheduler"])[0])[1])
    expected = f"scheduler:{scheduler['port']}"
    for name, service in _nodes().items():
        assert service.get("hostname") == name, f"{name}: MASTER_ADDR is the host name"
        assert service["depends_on"]["scheduler"] == {"condition": "service_healthy"}
        assert service.get("shm_size"), f"{name}: snapshots need more than 64 MB of /dev/shm"
        params = {binary: parse(binary, args)[1] for binary, args in _invocations(name, service)}
        agent, checkpointd = params["pitstop-agent"], params["pitstop-checkpointd"]
        assert agent["scheduler"] == checkpointd["scheduler"] == expected, name
        assert agent["node_id"] == checkpointd["node_id"] == name
        assert str(agent["gpus"]).startswith("sim:")
        # Reported to the scheduler: the buddy node's checkpointd dials it.
        assert agent["checkpointd_address"] == f"{name}:{checkpointd['port']}"
        # Secure: the checkpoint daemon enrolls the node with its join token into the
        # agent's identity, and both speak mutual TLS with it.
        assert agent["tls"] is True, name
        assert checkpointd["tls_dir"] == agent["state_dir"] / "tls", name
        assert checkpointd["ca_file"] == agent["ca_file"], name
        assert "/var/lib/pitstop/join/$node.token" in _script(service), name
        assert service["depends_on"]["enroll"] == {"condition": "service_completed_successfully"}
        assert checkpointd["host"] == "0.0.0.0"
        assert agent["metrics_host"] == "0.0.0.0"
        assert f":{agent['metrics_port']}/healthz" in " ".join(service["healthcheck"]["test"])


def test_enroll_gives_every_node_a_join_token_of_its_own() -> None:
    service = _services()["enroll"]
    assert service.get("restart") == "no"
    assert service["depends_on"] == {"scheduler": {"condition": "service_healthy"}}
    (loop,) = re.findall(r"^for node in (.+); do$", _script(service), re.MULTILINE)
    assert sorted(loop.split()) == sorted(_nodes())
    ((binary, args),) = _invocations("enroll", service)
    path, params = parse(binary, args)
    assert path == "pitstop token create"
    assert params["node_id"] == "enroll"  # $node, as the loop sets it per node
    # The nodes read what enroll writes, and never the scheduler's private state.
    for name, node in _nodes().items():
        assert "join:/var/lib/pitstop/join:ro" in node["volumes"], name
        assert not any(v.startswith("scheduler:") for v in node["volumes"]), name


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_node_script_is_valid_bash() -> None:
    for name, service in [
        *_nodes().items(),
        *((n, _services()[n]) for n in ("scheduler", "enroll", "example-job")),
    ]:
        result = subprocess.run(
            ["bash", "-n"], input=_script(service), capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, f"{name}: {result.stderr}"


def test_healthcheck_snippets_compile() -> None:
    for name, service in _services().items():
        test = service.get("healthcheck", {}).get("test", [])
        if test[1:3] == ["python", "-c"]:
            compile(test[3], f"{name} healthcheck", "exec")


def test_example_job_fits_the_cluster() -> None:
    service = _services()["example-job"]
    assert service.get("restart") == "no"
    assert service.get("profiles"), "a plain `docker-compose up` must not submit a job"
    ((binary, args),) = _invocations("example-job", service)
    assert binary == "pitstop"
    spec = load_job_spec(ROOT / args[args.index("-f") + 1])
    nodes = _nodes()
    workers = [n for n, s in nodes.items() if s["environment"]["NODE_ROLE"] == "worker"]
    spares = [n for n, s in nodes.items() if s["environment"]["NODE_ROLE"] == "spare"]
    assert spec.tp * spec.pp * spec.dp <= spec.gpus_per_node * len(workers)
    assert spec.spares <= len(spares)
    assert set(service["depends_on"]) == set(nodes)


def test_dockerfile_installs_the_project_for_every_service() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    assert re.search(r"^COPY \. ", text, re.MULTILINE)
    install = re.search(r"pip install [^&]*'\.\[([\w,]+)\]'", text)
    assert install, "the Dockerfile must pip install the project with its extras"
    extras = set(install.group(1).split(","))
    assert extras == {"all", "trainer", "kubernetes"}
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install.group(0)
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users, "the image must not run as root"
    assert users[-1] not in ("root", "0")
    for name, service in _pitstop_services().items():
        build = service["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE, name
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".state"} <= ignored
