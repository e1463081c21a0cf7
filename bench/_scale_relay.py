"""The network between one worker's simulated nodes and the schedulers, in a process of its
own (a relay inside a busy simulator delayed every keepalive ping through it: all 11 false
losses of a 2,568-node run were relayed nodes), so that any set of nodes can lose it.

Each node gets a port of its own on 127.0.0.1, so every connection is tagged by the node
that made it; the relay dials that node's scheduler for it. A cut stops every byte of the
node's connections both ways and closes nothing, as a cut cable or a host without power
(no FIN, no reset): only the stream's keepalive pings can tell. A new connection made
while cut is accepted by the kernel and goes nowhere. A heal lets through what waited,
a close included: a stream the scheduler closed meanwhile ends at the node then, which
reconnects as an agent does.

Each node also gets a port that stands in for its host, where the scheduler asks whether
a node whose stream ended is up (its checkpoint daemon's port, as the node registers it):
it accepts and closes while the line is up, and while the line is cut its accept queue
is kept full, so a connection gets no answer at all, as a cut-off host gives none.

Driven as bench/_scale_worker.py is, one JSON object a line: the first line in is
{"targets": [...], "nodes": {node id: [index, target]}}, answered {"t": "ports",
"ports": {node id: port}, "probe_ports": {node id: port}}; then requests {"id": k,
"op": ...} answered {"t": "done", "id": k, "at": time}: cut {nodes}, heal {nodes},
alive {targets}, report, stop; and a report every 0.5 s: its event-loop lag (as the
workers'), CPU seconds, connections."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._scale_sim import LagMeter, cpu_seconds, retarget

REPORT_SECONDS = 0.5
CHUNK = 1 << 16


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class Line:
    """One node's network: open while `flowing` is set."""

    def __init__(self, index: int, target: int) -> None:
        self.index, self.target = index, target
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.connections = 0
        self.host: HostPort | None = None
        """Where the scheduler asks whether the node's host is up."""


class HostPort:
    """The node's host as a TCP port: a connection is accepted (and closed) while its
    line is up; cut, the port's accept queue is filled and left unread, so the kernel
    drops every further handshake and a connection gets no answer."""

    FILL = 3  # one may be taken before the cut shows; the queue holds backlog + 1

    def __init__(self, line: Line) -> None:
        self.line = line
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.listener.setblocking(False)
        self.port = int(self.listener.getsockname()[1])
        self.fillers: list[socket.socket] = []

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.line.flowing.wait()
            conn, _ = await loop.sock_accept(self.listener)
            conn.close()

    def cut(self) -> None:
        for _ in range(self.FILL):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError, OSError):
                filler.connect(("127.0.0.1", self.port))
            self.fillers.append(filler)

    def heal(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.fillers = []


async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, line: Line) -> None:
    """Bytes from `src` to `dst` while the line is up. Cut, the chunk in hand waits and
    nothing more is read (TCP's window closes behind it); the end of `src` (a close or a
    reset) waits too, so a cut carries no close either."""
    try:
        while data := await src.read(CHUNK):
            await line.flowing.wait()
            dst.write(data)
            await dst.drain()
    except OSError:
        pass
    finally:
        await line.flowing.wait()
        dst.close()


class Relay:
    def __init__(self, config: dict[str, Any]) -> None:
        self.targets: list[str] = config["targets"]
        self.alive = set(range(len(self.targets)))
        self.lines = {node: Line(i, t) for node, (i, t) in config["nodes"].items()}
        self.servers: list[asyncio.Server] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.lag = LagMeter()
        self.since = time.time()

    async def listen(self) -> tuple[dict[str, int], dict[str, int]]:
        """Each node's stream port and host port."""
        ports, hosts = {}, {}
        for node, line in self.lines.items():
            server = await asyncio.start_server(
                functools.partial(self.connect, line), "127.0.0.1", 0
            )
            self.servers.append(server)
            ports[node] = server.sockets[0].getsockname()[1]
            line.host = HostPort(line)
            self.tasks.add(asyncio.create_task(line.host.serve()))
            hosts[node] = line.host.port
        return ports, hosts

    async def connect(
        self, line: Line, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await line.flowing.wait()  # cut: the node's new connection reaches no scheduler
        line.target = retarget(line.index, line.target, self.alive)
        host, port = self.targets[line.target].rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        line.connections += 1
        ends = ((reader, up_writer), (up_reader, writer))
        pumps = [asyncio.create_task(pump(src, dst, line)) for src, dst in ends]
        self.tasks.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            line.connections -= 1
            self.tasks.difference_update(pumps)

    def report(self) -> dict[str, Any]:
        now = time.time()
        out = {
            "t": "report",
            "since": round(self.since, 3),
            "at": round(now, 3),
            **self.lag.take(),
            "cpu": round(cpu_seconds(), 3),
            "connections": sum(line.connections for line in self.lines.values()),
            "cut": sum(not line.flowing.is_set() for line in self.lines.values()),
        }
        self.since = now
        return out

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op in ("cut", "heal"):
            for node in request["nodes"]:
                line = self.lines[node]
                if op == "cut":
                    line.flowing.clear()
                    if line.host is not None:
                        line.host.cut()
                else:
                    if line.host is not None:
                        line.host.heal()
                    line.flowing.set()
        elif op == "alive":
            self.alive = set(request["targets"])
        elif op == "report":
            return self.report()
        else:
            return {"error": f"unknown request {op!r}"}
        return {}

    async def reports(self) -> None:
        while True:
            await asyncio.sleep(REPORT_SECONDS)
            emit(self.report())


async def main() -> None:
    loop = asyncio.get_running_loop()
    requests = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(requests), sys.stdin)
    relay = Relay(json.loads(await requests.readline()))
    relay.lag.start()
    ports, hosts = await relay.listen()
    emit({"t": "ports", "ports": ports, "probe_ports": hosts})
    reports = asyncio.create_task(relay.reports())
    while line := await requests.readline():
        request = json.loads(line)
        if request["op"] == "stop":
            emit({"t": "done", "id": request["id"], "at": time.time()})
            break
        at = math.floor(time.time() * 1e4) / 1e4  # before the act: see _scale_worker
        try:
            answer = relay.handle(request)
        except KeyError as exc:
            answer = {"error": repr(exc)}
        emit({**answer, "t": "done", "id": request["id"], "at": at})
    reports.cancel()
    for server in relay.servers:
        server.close()
    for task in list(relay.tasks):
        task.cancel()


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
