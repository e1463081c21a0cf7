"""Network namespaces for a local cluster, so that one node can be cut off alive.

Each node gets a namespace of its own, joined by a veth pair to one bridge in this
(the root) namespace: the bridge holds the subnet's first address, where the scheduler
listens, and node k the (k+1)th, where its checkpoint daemon listens and its ranks meet
their peers (the end inside every namespace is called `IFACE`, so one
GLOO_SOCKET_IFNAME fits every rank). Taking a node's end down cuts it off: its
processes live on, but nothing reaches them nor leaves.

Linux only; needs root and iproute2 (``ip``). Used by ``pitstop cluster up --netns``
(`pitstop.client.localcluster`) and by the fault tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SUBNETS = ipaddress.IPv4Network("10.232.0.0/16")
"""The /24s a cluster's network is taken from: the first one no address here is in."""
LOCK = "/run/lock/pitstop-netns.lock"
"""Held while a network picks its subnet and claims it, so two made at once (two
clusters, two tests side by side) never pick the same one."""
IFACE = "pst0"
"""The name of each node's end of its link, inside its namespace."""


class NetnsError(Exception):
    """Setting up, changing or removing the namespaces failed; the message says why."""


def check_supported() -> None:
    """NetnsError unless this process may create network namespaces (root, iproute2)."""
    if shutil.which("ip") is None:
        raise NetnsError("network namespaces need iproute2's `ip`; install iproute2")
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root; run as root or leave --netns off")


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


@dataclass(frozen=True)
class NodeLink:
    """One node's namespace and its link to the bridge."""

    node_id: str
    namespace: str
    outside: str
    """The link's end on the bridge, in the root namespace."""
    address: str
    """The node's address, on `IFACE` inside its namespace."""


@dataclass(frozen=True)
class Network:
    """A bridge with an address (`gateway`) and a namespace per node behind it."""

    bridge: str
    gateway: str
    prefix_len: int
    links: tuple[NodeLink, ...]

    def link(self, node_id: str) -> NodeLink:
        for link in self.links:
            if link.node_id == node_id:
                return link
        raise NetnsError(f"node {node_id!r} has no network namespace")

    def exec_prefix(self, node_id: str) -> list[str]:
        """The argv prefix that runs a command in the node's namespace."""
        return ["ip", "netns", "exec", self.link(node_id).namespace]

    def cut(self, node_id: str) -> None:
        """Take the node's end of its link down: it is cut off, alive."""
        _ip("-n", self.link(node_id).namespace, "link", "set", IFACE, "down")

    def heal(self, node_id: str) -> None:
        """Bring the node's link back up."""
        _ip("-n", self.link(node_id).namespace, "link", "set", IFACE, "up")

    def is_cut(self, node_id: str) -> bool:
        """Whether the node's link is down (or its namespace is gone)."""
        try:
            shown = _ip("-n", self.link(node_id).namespace, "-o", "link", "show", IFACE)
        except NetnsError:
            return True
        flags = shown.split("<", 1)[-1].split(">", 1)[0].split(",")
        return "UP" not in flags

    def to_json(self) -> dict[str, Any]:
        return {
            "bridge": self.bridge,
            "gateway": self.gateway,
            "prefix_len": self.prefix_len,
            "links": [
                {
                    "node_id": link.node_id,
                    "namespace": link.namespace,
                    "outside": link.outside,
                    "address": link.address,
                }
                for link in self.links
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Network:
        return cls(
            bridge=str(data["bridge"]),
            gateway=str(data["gateway"]),
            prefix_len=int(data["prefix_len"]),
            links=tuple(
                NodeLink(
                    str(link["node_id"]),
                    str(link["namespace"]),
                    str(link["outside"]),
                    str(link["address"]),
                )
                for link in data["links"]
            ),
        )


def _addresses_in_use() -> list[ipaddress.IPv4Interface]:
    shown = _ip("-4", "-o", "addr", "show")
    found = []
    for line in shown.splitlines():
        words = line.split()
        if "inet" in words:
            found.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]))
    return found


def free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of `SUBNETS` that no address of this host's interfaces is in."""
    used = _addresses_in_use()
    for subnet in SUBNETS.subnets(new_prefix=24):
        if not any(iface.network.overlaps(subnet) for iface in used):
            return subnet
    raise NetnsError(f"every /24 of {SUBNETS} is in use here; run pitstop cluster down on one")


def create(node_ids: Sequence[str], tag: str | None = None) -> Network:
    """A bridge and a namespace per node, linked and addressed; on failure, whatever
    was made is removed again before NetnsError is raised."""
    check_supported()
    if len(node_ids) > 253:
        raise NetnsError(f"{len(node_ids)} nodes do not fit one /24 network; use at most 253")
    tag = tag or uuid.uuid4().hex[:6]
    with _subnet_lock():
        subnet = free_subnet()
        hosts = subnet.hosts()
        gateway = str(next(hosts))
        links = tuple(
            NodeLink(node_id, f"pitstop-{tag}-{node_id}", f"pst{tag}n{index}", str(next(hosts)))
            for index, node_id in enumerate(node_ids)
        )
        network = Network(f"pst{tag}br", gateway, subnet.prefixlen, links)
        try:  # the bridge's address claims the subnet
            _ip("link", "add", network.bridge, "type", "bridge")
            _ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", network.bridge)
        except BaseException:
            destroy(network)
            raise
    try:
        _ip("link", "set", network.bridge, "up")
        for link in links:
            _ip("netns", "add", link.namespace)
            _ip(
                "link", "add", link.outside, "type", "veth",
                "peer", "name", IFACE, "netns", link.namespace,
            )  # fmt: skip
            _ip("link", "set", link.outside, "master", network.bridge, "up")
            inside = ("-n", link.namespace)
            _ip(*inside, "addr", "add", f"{link.address}/{subnet.prefixlen}", "dev", IFACE)
            _ip(*inside, "link", "set", IFACE, "up")
            _ip(*inside, "link", "set", "lo", "up")
    except BaseException:
        destroy(network)
        raise
    return network


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """An exclusive lock on `LOCK`, across processes, released on exit."""
    os.makedirs(os.path.dirname(LOCK), exist_ok=True)
    with open(LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def destroy(network: Network) -> list[str]:
    """Remove the namespaces, their links and the bridge; what could not be removed
    (empty when everything is gone). Missing pieces are fine: this is idempotent."""
    problems = []
    existing = set(_listed(["netns", "list"]))
    for link in network.links:
        if link.namespace in existing:
            problems += _try("netns", "del", link.namespace)  # takes its veth pair along
    links = set(_listed(["-o", "link", "show"], field=1))
    for name in [link.outside for link in network.links] + [network.bridge]:
        if name in links:
            # A veth pair goes with its namespace, a moment later: listed above, it
            # may be gone by now, which is what was asked.
            problems += [p for p in _try("link", "del", name) if "Cannot find device" not in p]
    return problems


def _listed(args: Iterable[str], field: int = 0) -> list[str]:
    try:
        shown = _ip(*args)
    except NetnsError:
        return []
    names = []
    for line in shown.splitlines():
        words = line.split()
        if len(words) > field:
            names.append(words[field].rstrip(":").split("@")[0])
    return names


def _try(*args: str) -> list[str]:
    try:
        _ip(*args)
    except NetnsError as exc:
        return [str(exc)]
    return []
