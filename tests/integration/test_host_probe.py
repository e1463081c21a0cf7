"""How the scheduler tells a dead agent from a silent host when a stream ends: a TCP
connection to the node's checkpoint daemon that is accepted or refused comes from a live
host; one that gets no answer (a cut network, a host without power) is silence."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kit.ports import free_port, silent_address
from pitstop.scheduler.domain import LossCause
from pitstop.scheduler.hostprobe import loss_cause, split_address


async def test_a_listening_daemon_means_the_host_is_up() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        assert await loss_cause(f"127.0.0.1:{port}", 1.0) is LossCause.STREAM


async def test_a_refused_connection_means_the_host_is_up() -> None:
    port = free_port()  # nothing listens: the host answers with a reset
    assert await loss_cause(f"127.0.0.1:{port}", 1.0) is LossCause.STREAM


async def test_no_answer_is_silence_after_the_probe_time() -> None:
    with silent_address() as address:
        began = time.monotonic()
        assert await loss_cause(address, 0.3) is LossCause.SILENT
        assert 0.3 <= time.monotonic() - began < 2.0


async def test_a_node_without_an_address_is_counted_silent_after_the_probe_time() -> None:
    began = time.monotonic()
    assert await loss_cause("", 0.2) is LossCause.SILENT
    assert time.monotonic() - began >= 0.2


@pytest.mark.parametrize(
    ("address", "split"),
    [
        ("10.0.0.7:7000", ("10.0.0.7", 7000)),
        ("[fd00::7]:7000", ("fd00::7", 7000)),
        ("node-7.rack-2:7000", ("node-7.rack-2", 7000)),
        ("node-7", None),
        (":7000", None),
        ("node-7:http", None),
    ],
)
def test_addresses_split_as_registered(address: str, split: tuple[str, int] | None) -> None:
    assert split_address(address) == split


def test_the_silent_address_drops_connections_as_a_cut_network_does() -> None:
    with silent_address() as address, socket.socket() as client:
        host, port = address.split(":")
        client.settimeout(0.3)
        with pytest.raises(TimeoutError):
            client.connect((host, int(port)))
