"""Whether a node's host answers when its agent stream has ended.

A stream that ends says nothing of why: gRPC ends it the same way when the agent process
died (the host closed the connection) and when a keepalive ping went unanswered (the
host, or the network to it, is gone). The node's checkpoint daemon listens on a TCP port
of the same host: a connection to it that is accepted, or refused, comes from a live
host; one that gets no answer within the probe's time is silence. Only the TCP handshake
is made (no TLS, nothing sent): the daemon sees a connection opened and closed.
"""

from __future__ import annotations

import asyncio
import contextlib

from pitstop.scheduler.domain import LossCause


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of "host:port" or "[v6]:port"; None for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdecimal():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def loss_cause(address: str, timeout: float) -> LossCause:
    """How a node whose stream ended was lost: STREAM when its host answers at `address`
    (its checkpoint daemon's) within `timeout`, SILENT when it does not. A node without
    an address to ask is given the same time, then counted silent: a partition's other
    nodes must have their chance to go suspect before it is judged."""
    target = split_address(address)
    if target is None:
        await asyncio.sleep(timeout)
        return LossCause.SILENT
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(*target)
    except (ConnectionRefusedError, ConnectionResetError):
        return LossCause.STREAM  # a refusal or a reset comes from a live host
    except (TimeoutError, OSError):
        return LossCause.SILENT  # no answer, no route: silence
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(timeout):
            await writer.wait_closed()
    return LossCause.STREAM
