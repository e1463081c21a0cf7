"""Free TCP ports: any (`free_port`), or one outside the ephemeral range for a daemon
that binds it later (`free_listen_port`)."""

from __future__ import annotations

import random
import socket

from pitstop.client.localcluster import free_port

__all__ = ["LISTEN_PORTS", "free_listen_port", "free_port"]


LISTEN_PORTS = range(20_000, 32_000)
"""Where the Slurm daemons listen: below Linux's ephemeral range (32768-60999). A port the
kernel hands out for binding to 0 is an ephemeral one, and an outgoing connection took
one such port between the probe and slurmd's bind (`Unable to bind listen port:
Address already in use`, once in `.ci/run`)."""


def free_listen_port() -> int:
    """A port of LISTEN_PORTS that nothing listens on now."""
    for port in random.sample(LISTEN_PORTS, 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LISTEN_PORTS.start}-{LISTEN_PORTS.stop - 1}")
