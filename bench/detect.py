"""Benchmark of failure detection: how fast a node's failure becomes its state change.

It starts a real scheduler (``pitstop-scheduler``, embedded PostgreSQL and Redis unless
--database-url/--redis-url are given) and --agents real agents (``pitstop-agent`` on
simulated GPUs, ``sim:8``), all on loopback, then measures from the client:

* xid: InjectFault(Xid 79) on a random GPU of a node -> the node's ``node.unhealthy``
  event arrives on an EventService.Watch stream (then the fault is cleared and the node
  uncordoned, ready for the next trial); --xid-trials of them (target p99 < 1 s);
* kill9: SIGKILL of an agent -> ``node.lost`` (the agent is then restarted);
* sigstop: SIGSTOP of an agent, its socket still open -> ``node.lost`` at the liveness
  deadline (then SIGCONT; the agent reconnects). Target for both: within 3 heartbeat
  intervals.

Run it from the repository root:

    .venv/bin/python bench/detect.py [--xid-trials 50] [--kill-trials 5] [--heartbeat 1.0]

Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from pitstop.client.cpuload import MAX_SECONDS, cpu_load
from pitstop.client.launch import agent_command, clean_env, scheduler_command
from pitstop.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

EVENT_TIMEOUT_S = 30.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(name: str, seconds: list[float], target_s: float, quantile_q: float) -> dict[str, Any]:
    judged = quantile(seconds, quantile_q)
    return {
        "trials": len(seconds),
        "p50_ms": round(statistics.median(seconds) * 1e3, 1),
        "p99_ms": round(quantile(seconds, 0.99) * 1e3, 1),
        "max_ms": round(max(seconds) * 1e3, 1),
        "target_ms": round(target_s * 1e3, 1),
        "judged_on": f"p{int(quantile_q * 100)}" if quantile_q < 1 else "max",
        "pass": judged <= target_s,
        "what": name,
    }


class EventFeed:
    """Every event the scheduler records, from one Watch stream read on its own thread."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._events: queue.Queue[common_pb2.Event] = queue.Queue()
        stub = nodes_pb2_grpc.EventServiceStub(channel)
        self._stream = stub.Watch(nodes_pb2.WatchEventsRequest(after_event_id=-1))
        self._thread = threading.Thread(target=self._pump, name="event-feed")
        self._thread.start()

    def _pump(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for event in self._stream:
                self._events.put(event)

    def wait(self, node_id: str, kind: str, timeout: float = EVENT_TIMEOUT_S) -> float:
        """perf_counter time at which the event arrived."""
        deadline = time.perf_counter() + timeout
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(f"no {kind} event for {node_id} within {timeout}s")
            try:
                event = self._events.get(timeout=remaining)
            except queue.Empty:
                continue
            if event.node_id == node_id and event.kind == kind:
                return time.perf_counter()

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(10)


class Cluster:
    """One scheduler and N agents as real processes on loopback."""

    def __init__(self, root: Path, agents: int, heartbeat: float, db: str, redis: str) -> None:
        self.root = root
        self.heartbeat = heartbeat
        env = clean_env(
            PITSTOP_HEARTBEAT_INTERVAL_SECONDS=str(heartbeat),
            PITSTOP_LIVENESS_STARTUP_GRACE_SECONDS="0",
            GRPC_VERBOSITY="ERROR",
        )
        if db:
            env["PITSTOP_DATABASE_URL"] = db
        if redis:
            env["PITSTOP_REDIS_URL"] = redis
        self.env = env
        self.scheduler = subprocess.Popen(
            scheduler_command(
                state_dir=root / "scheduler", port=0, metrics_port=0, log_level="WARNING"
            ),
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.scheduler.stdout is not None
        line = self.scheduler.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"scheduler did not start: {line!r}")
        self.address = line.rsplit(" ", 1)[1].strip()
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.node_ids = [f"bench-n{i}" for i in range(agents)]

    def start_agent(self, node_id: str) -> None:
        index = self.node_ids.index(node_id)
        self.agents[node_id] = subprocess.Popen(
            agent_command(
                fork_server="off",  # fake ranks or none: no zygote to import torch
                node_id=node_id,
                scheduler=self.address,
                gpus="sim:8",
                rack=f"r{index % 2}",
                zone="z1",
                block="b1",
                state_dir=self.root / node_id,
                metrics_port=0,
                log_level="WARNING",
            ),
            stdout=subprocess.DEVNULL,
            env=self.env,
        )

    def stop(self) -> None:
        for proc in self.agents.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        self.scheduler.terminate()
        self.scheduler.wait(60)


def until(call: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Retry a call refused as FAILED_PRECONDITION (state not there yet) until it passes."""
    deadline = time.perf_counter() + timeout
    delay = 0.01
    while True:
        try:
            return call()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION or time.perf_counter() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def xid_trials(cluster: Cluster, feed: EventFeed, nodes: Any, trials: int) -> list[float]:
    rng = random.Random(7)
    samples = []
    for trial in range(trials):
        node_id = cluster.node_ids[trial % len(cluster.node_ids)]
        gpu = rng.randrange(8)
        start = time.perf_counter()
        nodes.InjectFault(
            nodes_pb2.InjectFaultRequest(
                node_id=node_id, fault=common_pb2.Fault(gpu_index=gpu, xid=79)
            )
        )
        samples.append(feed.wait(node_id, "node.unhealthy") - start)
        nodes.InjectFault(
            nodes_pb2.InjectFaultRequest(
                node_id=node_id, fault=common_pb2.Fault(gpu_index=gpu, clear=True)
            )
        )
        request = nodes_pb2.NodeControlRequest(node_id=node_id, reason="bench: fault cleared")
        until(functools.partial(nodes.Uncordon, request))
    return samples


def process_trials(
    cluster: Cluster, feed: EventFeed, trials: int, how: signal.Signals
) -> list[float]:
    samples = []
    for trial in range(trials):
        node_id = cluster.node_ids[trial % len(cluster.node_ids)]
        agent = cluster.agents[node_id]
        start = time.perf_counter()
        agent.send_signal(how)
        samples.append(feed.wait(node_id, "node.lost") - start)
        if how == signal.SIGKILL:
            agent.wait(10)
            cluster.start_agent(node_id)
        else:
            agent.send_signal(signal.SIGCONT)
        feed.wait(node_id, "node.recovered")
    return samples


@contextlib.contextmanager
def running_cluster(args: argparse.Namespace) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="pitstop-detect-"))
    cluster = Cluster(root, args.agents, args.heartbeat, args.database_url, args.redis_url)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--xid-trials", type=int, default=50)
    parser.add_argument("--kill-trials", type=int, default=5)
    parser.add_argument("--stop-trials", type=int, default=5)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds")
    parser.add_argument("--database-url", default="")
    parser.add_argument("--redis-url", default="")
    parser.add_argument(
        "--load",
        type=int,
        default=0,
        help="busy processes beside the benchmark (pitstop.client.cpuload), as on a "
        "loaded machine; 0: none",
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.load:
            stack.enter_context(cpu_load(args.load, MAX_SECONDS))
            log(f"CPU load: {args.load} busy processes beside the benchmark")
        return run(args)


def run(args: argparse.Namespace) -> int:
    with running_cluster(args) as cluster:
        channel = grpc.insecure_channel(cluster.address)
        feed = EventFeed(channel)
        nodes = nodes_pb2_grpc.NodeServiceStub(channel)
        for node_id in cluster.node_ids:
            cluster.start_agent(node_id)
            feed.wait(node_id, "node.registered")
        log(f"scheduler {cluster.address}, {args.agents} agents on sim:8 registered")
        listed = nodes.List(nodes_pb2.ListNodesRequest()).nodes
        gpus = {n.id: len(n.inventory.gpus) for n in listed}
        xid = xid_trials(cluster, feed, nodes, args.xid_trials)
        log(f"xid 79 -> unhealthy: p50 {statistics.median(xid) * 1e3:.1f} ms over {len(xid)}")
        killed = process_trials(cluster, feed, args.kill_trials, signal.SIGKILL)
        log(f"kill -9 -> lost: p50 {statistics.median(killed) * 1e3:.1f} ms")
        stopped = process_trials(cluster, feed, args.stop_trials, signal.SIGSTOP)
        log(f"SIGSTOP -> lost: p50 {statistics.median(stopped) * 1e3:.1f} ms")
        feed.close()
        channel.close()
    window = 3 * args.heartbeat
    report = {
        "bench": "detect",
        "agents": args.agents,
        "gpus": gpus,
        "heartbeat_s": args.heartbeat,
        "cpu_load_procs": args.load,
        "xid": summary("InjectFault(Xid 79) -> node.unhealthy", xid, 1.0, 0.99),
        "kill9": summary("SIGKILL of the agent -> node.lost", killed, window, 1.0),
        "sigstop": summary("SIGSTOP of the agent -> node.lost", stopped, window, 1.0),
    }
    report["pass"] = all(report[k]["pass"] for k in ("xid", "kill9", "sigstop"))
    print(json.dumps(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
