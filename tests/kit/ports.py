"""A free TCP port."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on loopback now (bound once and let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
