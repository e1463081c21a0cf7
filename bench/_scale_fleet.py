"""bench/scale.py's side of the simulated fleet: the worker processes that run the nodes
(bench/_scale_worker.py) and the relay processes their cuttable networks go through
(bench/_scale_relay.py), what it asks of them, and what it knows of every node from what
they report: registrations, the job's generation each holds, when each command came,
their event-loop lag and CPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._scale_sim import LAG_LIMIT, node_id_of
from pitstop.client.signals import dying_with_parent

ROOT = Path(__file__).resolve().parents[1]
NODES_PER_PROCESS = 400
"""The default share of a simulator process: few enough that its event loop keeps up."""
REQUEST_SECONDS = 15.0


class Child:
    """A worker or relay process: JSON lines on its stdin and stdout, requests answered by
    id, everything else handed to `on_message`."""

    def __init__(
        self, name: str, module: str, log: Path, on_message: Callable[[Child, dict[str, Any]], None]
    ) -> None:
        self.name, self.module, self.log = name, module, log
        self.on_message = on_message
        self.proc: asyncio.subprocess.Process | None = None
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._first: asyncio.Future[dict[str, Any]] | None = None
        self._ids = 0
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self, config: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        """Start it with `config`; its first line (ready, or the relay's ports)."""
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *dying_with_parent([sys.executable, "-m", self.module]),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
                # Its own session: a Ctrl-C in the terminal reaches the benchmark alone,
                # which stops it in order.
                start_new_session=True,
                limit=1 << 24,
            )
        self._first = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read(), name=f"{self.name} reader")
        self._write(config)
        async with asyncio.timeout(timeout):
            first: dict[str, Any] = await self._first
        return first

    def _write(self, message: dict[str, Any]) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            try:
                message = json.loads(line)
            except ValueError:  # not one of ours (a library's print): in its log instead
                with self.log.open("ab") as log:
                    log.write(line)
                continue
            if message.get("t") == "done":
                waiter = self._waiting.pop(message["id"], None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(message)
            elif self._first is not None and not self._first.done():
                self._first.set_result(message)
            else:
                try:
                    self.on_message(self, message)
                except (KeyError, ValueError, IndexError, TypeError) as exc:
                    # A report this side cannot read must not stop it reading the next.
                    with self.log.open("a") as log:
                        log.write(f"benchmark: unreadable {message!r}: {exc!r}\n")
        tail = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
        gone = RuntimeError(f"{self.name} exited; the end of its log:\n{tail}")
        for waiter in [self._first, *self._waiting.values()]:
            if waiter is not None and not waiter.done():
                waiter.set_exception(gone)

    async def request(
        self, op: str, timeout: float = REQUEST_SECONDS, **fields: Any
    ) -> dict[str, Any]:
        """Ask it for `op`; its answer (RuntimeError when it says it could not)."""
        self._ids += 1
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._ids] = waiter
        self._write({"id": self._ids, "op": op, **fields})
        async with asyncio.timeout(timeout):
            answer = await waiter
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {op}: {answer['error']}")
        return answer

    async def close(self, grace: float) -> None:
        """Ask it to stop; SIGKILL once `grace` has passed."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            await self.request("stop", timeout=grace)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await proc.wait()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
        if self._reader is not None:
            self._reader.cancel()


@dataclass
class Source:
    """One worker's or relay's own measurements."""

    lag_max: float = 0.0
    """The largest lag since the benchmark last took it (a phase's window)."""
    lag_max_all: float = 0.0
    spikes: list[tuple[float, float]] = field(default_factory=list)
    cpu: float = 0.0
    cpu_cores_max: float = 0.0
    _anchor: tuple[float, float] | None = None

    def update(self, report: dict[str, Any]) -> None:
        self.lag_max = max(self.lag_max, report["lag_max"])
        self.lag_max_all = max(self.lag_max_all, report["lag_max"])
        self.spikes.extend((end, lag) for end, lag in report["spikes"])
        self.cpu = report["cpu"]
        at = report["at"]
        if self._anchor is None:
            self._anchor = (at, self.cpu)
        elif at - self._anchor[0] >= 0.45:  # a rate over less is noise
            rate = (self.cpu - self._anchor[1]) / (at - self._anchor[0])
            self.cpu_cores_max = max(self.cpu_cores_max, rate)
            self._anchor = (at, self.cpu)


@dataclass
class NodeView:
    """What the benchmark knows of one simulated node."""

    node_id: str
    index: int
    spare: bool
    worker: int
    target: int
    relayed: bool
    registered: bool = False
    registrations: int = 0
    dead: bool = False
    hung: bool = False
    unhealthy: bool = False
    generation: int = 0
    """The job's generation it holds ranks in (0: none)."""


class Fleet:
    """Every simulated node, in `procs` worker processes (node i in worker i % procs), the
    relayed ones through their worker's relay process."""

    def __init__(
        self,
        root: Path,
        targets: list[str],
        interval: float,
        step_seconds: float,
        tls_dir: Path | None,
        procs: int,
    ) -> None:
        self.root, self.targets, self.tls_dir = root, targets, tls_dir
        self.interval, self.step_seconds = interval, step_seconds
        self.procs = procs
        self.nodes: list[NodeView] = []
        self._by_id: dict[str, NodeView] = {}
        self.workers: dict[int, Child] = {}
        self.relays: dict[int, Child] = {}
        self.sources: dict[str, Source] = {}
        self.sent_by: dict[str, dict[str, int]] = {}
        self.steps_by: dict[str, dict[str, int]] = {}
        self.registrations_by: dict[str, int] = {}
        # generation -> node id -> when its command for it arrived
        self.received: dict[int, dict[str, float]] = {}
        self.command_bytes: dict[int, int] = {}
        self.restore_steps: dict[int, int] = {}
        """Generation -> the step its commands told the nodes to resume from."""

    def add_nodes(self, total: int, workers_of_job: int, streams: int, relayed: set[int]) -> None:
        """`total` nodes, the first `workers_of_job` workers and the rest spares, spread
        over `streams` schedulers; those in `relayed` behind their worker's relay."""
        for i in range(total):
            view = NodeView(
                node_id_of(i), i, i >= workers_of_job, i % self.procs, i % streams, i in relayed
            )
            self.nodes.append(view)
            self._by_id[view.node_id] = view

    def by_id(self, node_id: str) -> NodeView:
        return self._by_id[node_id]

    async def start(self) -> None:
        """Every relay, then every worker, side by side."""
        await asyncio.gather(*(self._start_worker(w) for w in range(self.procs)))

    async def _start_worker(self, w: int) -> None:
        mine = [v for v in self.nodes if v.worker == w]
        relayed = {v.node_id: [v.index, v.target] for v in mine if v.relayed}
        ports: dict[str, int] = {}
        hosts: dict[str, int] = {}
        if relayed:
            relay = Child(
                f"relay-{w}", "bench._scale_relay", self.root / f"relay-{w}.log", self._message
            )
            self.relays[w] = relay
            self.sources[relay.name] = Source()
            first = await relay.start({"targets": self.targets, "nodes": relayed})
            ports, hosts = first["ports"], first["probe_ports"]
        worker = Child(
            f"worker-{w}", "bench._scale_worker", self.root / f"worker-{w}.log", self._message
        )
        self.workers[w] = worker
        self.sources[worker.name] = Source()
        await worker.start(
            {
                "targets": self.targets,
                "interval": self.interval,
                "step_seconds": self.step_seconds,
                "tls_dir": None if self.tls_dir is None else str(self.tls_dir),
                "nodes": [[v.index, v.spare, v.target] for v in mine],
                "relay_ports": ports,
                "host_ports": hosts,
            }
        )

    def _message(self, child: Child, message: dict[str, Any]) -> None:
        if message.get("t") == "report":
            self._report(child, message)
        elif message.get("t") == "notes":
            for note in message["notes"]:
                self._note(note)

    def _report(self, child: Child, report: dict[str, Any]) -> None:
        self.sources[child.name].update(report)
        if "sent" in report:
            self.sent_by[child.name] = report["sent"]
            self.steps_by[child.name] = report["steps"]
            self.registrations_by[child.name] = report.get("registrations", 0)

    def _note(self, note: list[Any]) -> None:
        kind, node = note[0], self._by_id[note[1] if note[0] != "cmd" else note[2]]
        if kind == "reg":
            node.registered, node.target = True, int(note[2])
            node.registrations += 1
        elif kind == "down":
            node.registered = False
        elif kind == "left":
            node.generation = 0
        elif kind == "cmd":
            _, generation, _, at, size, ranks, restore = note
            self.received.setdefault(generation, {}).setdefault(node.node_id, at)
            self.command_bytes[generation] = max(self.command_bytes.get(generation, 0), size)
            node.generation = generation if ranks else 0
            if ranks:
                known = self.restore_steps.get(generation, restore)
                self.restore_steps[generation] = min(known, restore)

    async def connect(self, timeout: float) -> float:
        """Start every node, at most 200 registering at once over the fleet; the seconds
        until every one has."""
        began = time.monotonic()
        wave = max(25, 200 // self.procs)
        await asyncio.gather(*(w.request("start", wave=wave) for w in self.workers.values()))
        while not all(v.registered for v in self.nodes):
            if time.monotonic() - began > timeout:
                left = sum(not v.registered for v in self.nodes)
                raise RuntimeError(f"{left} simulated nodes not registered after {timeout:.0f} s")
            await asyncio.sleep(0.05)
        return time.monotonic() - began

    async def refresh(self) -> None:
        """A report now from every worker and relay (a worker's stall that lasts is seen
        when it ends: the answer waits for it). One that does not answer counts as a
        stall of REQUEST_SECONDS."""

        async def ask(child: Child) -> None:
            try:
                self._report(child, await child.request("report"))
            except (TimeoutError, RuntimeError):
                source = self.sources[child.name]
                source.spikes.append((time.time(), REQUEST_SECONDS))
                source.lag_max = max(source.lag_max, REQUEST_SECONDS)

        await asyncio.gather(*(ask(c) for c in [*self.workers.values(), *self.relays.values()]))

    def lagged(self, since: float, until: float) -> float:
        """The largest event-loop lag over LAG_LIMIT of any worker or relay that overlapped
        [since, until] (wall-clock seconds); 0.0 when none did."""
        worst = 0.0
        for source in self.sources.values():
            for end, lag in source.spikes:
                if end >= since and end - lag <= until:
                    worst = max(worst, lag)
        return worst if worst > LAG_LIMIT else 0.0

    def take_lag(self) -> tuple[float, float]:
        """The largest lag of the workers and of the relays since the last take."""
        workers = max((s.lag_max for n, s in self.sources.items() if "worker" in n), default=0)
        relays = max((s.lag_max for n, s in self.sources.items() if "relay" in n), default=0)
        for source in self.sources.values():
            source.lag_max = 0.0
        return workers, relays

    def counters(self) -> dict[str, Any]:
        """Messages sent and registrations so far, the workers' and relays' CPU seconds."""
        sent: dict[str, int] = {}
        for counts in self.sent_by.values():
            for key, value in counts.items():
                sent[key] = sent.get(key, 0) + value
        return {
            "sent": sent,
            "registrations": sum(self.registrations_by.values()),
            "sim_cpu": sum(s.cpu for n, s in self.sources.items() if "worker" in n),
            "relay_cpu": sum(s.cpu for n, s in self.sources.items() if "relay" in n),
        }

    def step(self, job_id: str) -> int:
        """The newest step any node reported for the job (as of the last reports)."""
        return max((steps.get(job_id, 0) for steps in self.steps_by.values()), default=0)

    def processes(self) -> dict[str, Any]:
        """Each worker's and relay's largest CPU (cores, over half-second reports) and
        event-loop lag over the run."""

        def of(kind: str) -> dict[str, list[float]]:
            named = [(int(n.rsplit("-", 1)[1]), s) for n, s in self.sources.items() if kind in n]
            chosen = [s for _, s in sorted(named, key=lambda pair: pair[0])]
            return {
                "cpu_cores_max": [round(s.cpu_cores_max, 3) for s in chosen],
                "lag_max_s": [round(s.lag_max_all, 3) for s in chosen],
            }

        return {"procs": len(self.workers), "workers": of("worker"), "relays": of("relay")}

    async def act(self, op: str, node: NodeView, **fields: Any) -> float:
        """Ask the node's worker for `op` on it; when it was done (the worker's clock)."""
        answer = await self.workers[node.worker].request(op, node=node.node_id, **fields)
        return float(answer["at"])

    async def network(self, op: str, nodes: list[NodeView]) -> float:
        """Cut or heal (`op`) the networks of `nodes` at once, at their workers' relays;
        when the first relay did it."""
        by_worker: dict[int, list[str]] = {}
        for v in nodes:
            if not v.relayed:
                raise RuntimeError(f"{v.node_id} has no relay: its network cannot be cut")
            by_worker.setdefault(v.worker, []).append(v.node_id)
        answers = await asyncio.gather(
            *(self.relays[w].request(op, nodes=ids) for w, ids in by_worker.items())
        )
        return min(float(a["at"]) for a in answers) if answers else time.time()

    async def set_alive(self, targets: set[int]) -> None:
        """Only `targets` are up: nodes of the others reconnect to them (and the relays
        dial them)."""
        children = [*self.workers.values(), *self.relays.values()]
        await asyncio.gather(*(c.request("alive", targets=sorted(targets)) for c in children))

    async def finish(self, job_id: str, generation: int) -> int:
        """Every rank of the job's `generation` exits 0; how many did."""
        answers = await asyncio.gather(
            *(w.request("finish", job=job_id, generation=generation) for w in self.workers.values())
        )
        return sum(int(a["ranks"]) for a in answers)

    def pids(self) -> list[int]:
        children = [*self.workers.values(), *self.relays.values()]
        return [c.pid for c in children if c.pid is not None]

    async def close(self, grace: float = 2.0) -> None:
        children = [*self.workers.values(), *self.relays.values()]
        await asyncio.gather(*(c.close(grace) for c in children), return_exceptions=True)


def default_procs(nodes: int) -> int:
    """Enough simulator processes for about NODES_PER_PROCESS nodes each."""
    return max(1, math.ceil(nodes / NODES_PER_PROCESS))
