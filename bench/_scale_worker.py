"""A process of bench/scale.py's simulated fleet: a share of the nodes (bench/_scale_sim.py),
driven by the benchmark over this process's stdin and stdout, one JSON object a line.

The first line in is the configuration: {"targets": [...], "interval": s,
"step_seconds": s, "tls_dir": path or null, "nodes": [[index, spare, target], ...],
"relay_ports": {node id: port}, "host_ports": {node id: port}}: the relay's ports of the
nodes behind it, for their streams and for their hosts (where the scheduler asks whether
a node whose stream ended is up); the other nodes' host is a listener of this process.
Then requests, each {"id": k, "op": ...}, answered
{"t": "done", "id": k, "at": wall-clock time it was done, ...}:

  start {wave}          start every node, at most `wave` registering at once
  break {node}          the node's stream reset (the call cancelled); it never reconnects
  gone {node}           the node never reconnects (its network is cut at the relay)
  xid {node}            a fatal Xid on GPU 0 (the Xid, its rank's exit, a FATAL heartbeat)
  exit {node}           a rank exits with code 1 (RankExited, a heartbeat without it)
  hang {node}           heartbeats stop; the stream stays open and answers pings
  alive {targets}       the schedulers still up: nodes of the others reconnect elsewhere
  finish {job, generation}  every rank of that generation exits 0 (the job's end)
  report                a report now (below)
  stop                  close every stream and exit

Out, unasked: {"t": "notes", "notes": [...]} within about 50 ms of what happened (["cmd",
generation, node, time, bytes, ranks, restore_step]: a StartRanks or Reconfigure
arrived; ["reg", node, target]; ["down", node]; ["left", node]), and every 0.5 s
{"t": "report", "since", "at", "lag_max", "spikes", "cpu", "sent", "registrations",
"steps"}: the event-loop lag (sampled every 50 ms, the largest since the last report,
and each one over 100 ms with when it ended), this process's CPU seconds, the messages
sent and registrations so far, the newest step reported per job.

It dies with the benchmark (started through dying_with_parent), and exits when its stdin
closes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._scale_sim import (
    LagMeter,
    NodeCertificates,
    SimFleet,
    SimNode,
    cpu_seconds,
    exit_rank,
    finish,
    inject_xid,
)

REPORT_SECONDS = 0.5
NOTES_SECONDS = 0.05


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class Worker:
    """The nodes of this process, the requests that act on them and the reports."""

    def __init__(self, config: dict[str, Any]) -> None:
        tls_dir = config.get("tls_dir")
        self.fleet = SimFleet(
            config["targets"],
            config["interval"],
            config["step_seconds"],
            None if tls_dir is None else NodeCertificates(Path(tls_dir)),
        )
        self.fleet.relay_ports = {k: int(v) for k, v in config.get("relay_ports", {}).items()}
        self.fleet.host_ports = {k: int(v) for k, v in config.get("host_ports", {}).items()}
        for index, spare, target in config["nodes"]:
            node = SimNode(self.fleet, index, spare, target)
            self.fleet.nodes[node.node_id] = node
        self.lag = LagMeter()
        self.since = time.time()
        self.starting: asyncio.Task[None] | None = None

    def report(self) -> dict[str, Any]:
        now = time.time()
        out = {
            "t": "report",
            "since": round(self.since, 3),
            "at": round(now, 3),
            **self.lag.take(),
            "cpu": round(cpu_seconds(), 3),
            "sent": self.fleet.sent,
            "registrations": self.fleet.registrations,
            "steps": self.fleet.steps,
        }
        self.since = now
        return out

    async def reports(self) -> None:
        while True:
            await asyncio.sleep(REPORT_SECONDS)
            emit(self.report())

    async def notes(self) -> None:
        """What the nodes did, batched over NOTES_SECONDS: a fan-out's commands arrive
        together and go out as one line."""
        fleet = self.fleet
        while True:
            await fleet.noted.wait()
            await asyncio.sleep(NOTES_SECONDS)
            fleet.noted.clear()
            notes, fleet.notes = fleet.notes, []
            emit({"t": "notes", "notes": notes})

    async def start_nodes(self, wave: int) -> None:
        nodes = list(self.fleet.nodes.values())
        for first in range(0, len(nodes), wave):
            batch = nodes[first : first + wave]
            for node in batch:
                node.start()
            # The benchmark counts the registrations; a node that never registers does
            # not hold back the next wave for more than its share of the timeout.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(60):
                    await asyncio.gather(*(n.registered.wait() for n in batch))

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Do what `request` asks; what to answer besides the time it was done."""
        op = request["op"]
        node = self.fleet.nodes.get(request.get("node", ""))
        if op == "start":
            self.starting = asyncio.create_task(self.start_nodes(int(request["wave"])))
        elif op == "report":
            return self.report()
        elif op == "alive":
            self.fleet.alive_targets = set(request["targets"])
        elif op == "finish":
            ranks = sum(
                finish(n, request["job"], int(request["generation"]))
                for n in self.fleet.nodes.values()
            )
            return {"ranks": ranks}
        elif node is None:
            return {"error": f"no node {request.get('node')!r} here"}
        elif op in ("break", "gone"):
            node.dead = True
            if op == "break":
                node.cancel()
        elif op == "xid":
            inject_xid(node)
        elif op == "exit":
            exit_rank(node)
        elif op == "hang":
            node.hung = True
        else:
            return {"error": f"unknown request {op!r}"}
        return {}

    async def serve(self, requests: asyncio.StreamReader) -> None:
        while line := await requests.readline():
            request = json.loads(line)
            if request["op"] == "stop":
                emit({"t": "done", "id": request["id"], "at": time.time()})
                return
            # When it was done: read before the act, rounded down (a stream cancelled
            # here can be seen closed by the scheduler before this process reads its
            # clock again: a failure's detection must not precede the failure).
            at = math.floor(time.time() * 1e4) / 1e4
            try:
                answer = self.handle(request)
            except (KeyError, StopIteration, ValueError) as exc:
                answer = {"error": repr(exc)}
            emit({**answer, "t": "done", "id": request["id"], "at": at})


async def main() -> None:
    loop = asyncio.get_running_loop()
    requests = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(requests), sys.stdin)
    worker = Worker(json.loads(await requests.readline()))
    # The host of every node not behind the relay: its daemon's port answers.
    host = await asyncio.start_server(lambda _reader, writer: writer.close(), "127.0.0.1", 0)
    worker.fleet.host_port = int(host.sockets[0].getsockname()[1])
    worker.lag.start()
    background = [asyncio.create_task(worker.reports()), asyncio.create_task(worker.notes())]
    emit({"t": "ready", "nodes": len(worker.fleet.nodes)})
    try:
        await worker.serve(requests)
    finally:
        for task in background:
            task.cancel()
        if worker.starting is not None:
            worker.starting.cancel()
        host.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                await worker.fleet.close()


if __name__ == "__main__":
    # A channel and its sockets per node, and the relay's ports: past the default 1,024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(main())
