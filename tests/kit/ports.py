"""Free TCP ports: any (`free_port`), or one outside the ephemeral range for a daemon
that binds it later (`free_listen_port`); and an address where nothing answers, as a
host without power or behind a cut network (`silent_address`)."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator

from pitstop.client.localcluster import free_port

__all__ = ["LISTEN_PORTS", "free_listen_port", "free_port", "silent_address"]


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


@contextlib.contextmanager
def silent_address() -> Iterator[str]:
    """host:port on loopback where a connection gets no answer at all: a listener whose
    accept queue is full (backlog 0, filled and never accepted), so Linux drops every
    further SYN, as the network does to a host cut off (no refusal, no reset)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(2):  # the queue holds backlog + 1
                filler = socket.socket()
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", port))
                fillers.append(filler)
            yield f"127.0.0.1:{port}"
        finally:
            for filler in fillers:
                filler.close()
