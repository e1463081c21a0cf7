"""A stand-in for the one piece of a Kubernetes API server the agent talks to: GET and
PATCH of one Node (and its status), over real HTTP on 127.0.0.1, so the official client
runs unchanged (its URLs, content types and JSON). There is no API server on this
machine; this plays its part for the Node, and nothing more.

Patches are recorded, not interpreted beyond what the tests need: a strategic merge of
`status.conditions` by type, and the taint list replaced whole, fenced by
`metadata.resourceVersion` (409 when it is not the current one), as the API server does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any


@dataclass
class NodeStore:
    """One Node, as JSON, and every request made for it."""

    node: dict[str, Any]
    requests: list[Request] = field(default_factory=list)
    fail_with: int = 0
    """While non-zero, every request is answered with this status."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return str(self.node["metadata"]["name"])

    def condition(self, kind: str) -> dict[str, Any] | None:
        with self.lock:
            found = [c for c in self.node["status"].get("conditions", []) if c["type"] == kind]
            return found[0] if found else None

    def taints(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.node["spec"].get("taints", []))

    def patches(self, path_suffix: str = "") -> list[Request]:
        with self.lock:
            return [
                r for r in self.requests if r.method == "PATCH" and r.path.endswith(path_suffix)
            ]

    def answer(self, method: str, path: str, content_type: str, body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append(Request(method, path, content_type, body))
            if self.fail_with:
                return self.fail_with, {"kind": "Status", "code": self.fail_with}
            base = f"/api/v1/nodes/{self.name}"
            if method == "GET" and path == base:
                return 200, self.node
            if method != "PATCH" or path not in (base, base + "/status"):
                return 404, {"kind": "Status", "code": 404}
            version = body.get("metadata", {}).get("resourceVersion")
            if version is not None and version != self.node["metadata"]["resourceVersion"]:
                return 409, {"kind": "Status", "code": 409, "reason": "Conflict"}
            if path.endswith("/status"):
                conditions = self.node["status"].setdefault("conditions", [])
                for new in body["status"]["conditions"]:
                    conditions[:] = [c for c in conditions if c["type"] != new["type"]] + [new]
            if "taints" in body.get("spec", {}):
                self.node["spec"]["taints"] = body["spec"]["taints"]
            self.node["metadata"]["resourceVersion"] = str(
                int(self.node["metadata"]["resourceVersion"]) + 1
            )
            return 200, self.node


def _handler(store: NodeStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            path = self.path.split("?", 1)[0]
            status, reply = store.answer(
                self.command, path, self.headers.get("Content-Type", ""), body
            )
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = _serve  # noqa: N815 (http.server's names)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def kube_api(node: dict[str, Any]) -> Iterator[tuple[str, NodeStore]]:
    """Serve `node` on 127.0.0.1 (a free port); yields the server's URL and the store."""
    store = NodeStore(node)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(store))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", store
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig that points the client at `url` with a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "stub", "cluster": {"server": url}}],
        "users": [{"name": "agent", "user": {"token": "stub-token"}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "agent"}}],
        "current-context": "stub",
    }
    path.write_text(json.dumps(config))
    return path


def gpu_node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node as the API server returns it: a GPU node with the device plugin's taint."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "resourceVersion": "100", "labels": labels or {}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
    }
