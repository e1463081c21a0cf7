"""Four real `pitstop-agent` processes on simulated GPUs against one scheduler: the CLI
lists four ready nodes of eight GPUs; after a scheduler restart every agent is back
within 5 s and no rank was restarted."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
from typer.testing import CliRunner

from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls
from pitstop.client.cli import app
from pitstop.client.launch import agent_command, clean_env
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc

NODES = [f"fleet-{i}" for i in range(4)]


def wait_for_events(address: str, wanted: set[tuple[str, str]], after: int, timeout: float) -> None:
    """Follow the event log until every (node, kind) in ``wanted`` was seen."""
    with grpc.insecure_channel(address) as channel:
        stream = nodes_pb2_grpc.EventServiceStub(channel).Watch(
            nodes_pb2.WatchEventsRequest(after_event_id=after), timeout=timeout
        )
        missing = set(wanted)
        for event in stream:
            missing.discard((event.node_id, event.kind))
            if not missing:
                stream.cancel()
                return
    raise AssertionError(f"never saw {missing}")


def newest_event(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        events = (
            nodes_pb2_grpc.EventServiceStub(channel)
            .List(nodes_pb2.ListEventsRequest(after_event_id=-1, limit=1))
            .events
        )
    return events[-1].id if events else 0


@contextlib.contextmanager
def agents(address: str, root: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = clean_env()
    procs = [
        subprocess.Popen(
            agent_command(
                fork_server="off",  # fake ranks or none: no zygote to import torch
                node_id=node,
                scheduler=address,
                gpus="sim:8",
                zone="z1",
                block="b1",
                rack=f"r{i % 2}",
                state_dir=root / node,
                metrics_port=0,
                log_level="WARNING",
            ),
            stdout=subprocess.DEVNULL,
            env=env,
        )
        for i, node in enumerate(NODES)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert proc.wait(30) == 0


def test_four_agents_register_and_outlive_a_scheduler_restart(
    stores: StoreUrls, tmp_path: Path, short_dir: Path
) -> None:
    settings = scheduler_settings(
        stores,
        tmp_path / "s1",
        database_url=stores.fresh_database(),
        leader_loops=True,
        redis_prefix=f"{stores.redis_prefix}fleet:",
    )
    scheduler = SchedulerThread(settings)
    address = scheduler.address
    with agents(address, short_dir):
        wait_for_events(address, {(n, "node.registered") for n in NODES}, 0, 30)
        listed = CliRunner().invoke(app, ["--server", address, "node", "list", "--json"])
        assert listed.exit_code == 0, listed.stderr
        nodes = json.loads(listed.stdout)
        assert sorted(n["id"] for n in nodes) == NODES
        assert {n["state"] for n in nodes} == {"NODE_STATE_READY"}
        assert [len(n["inventory"]["gpus"]) for n in nodes] == [8, 8, 8, 8]

        # A job with one long-running rank per node, so there are ranks to keep alive.
        # Each rank announces its pid on a datagram socket, then sleeps.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as hello:
            hello.bind(str(short_dir / "hello.sock"))
            hello.settimeout(30)
            rank = (
                "import os, socket, time; "
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                f"s.sendto(str(os.getpid()).encode(), {str(short_dir / 'hello.sock')!r}); "
                "time.sleep(600)"
            )
            spec = jobs_pb2.JobSpec(
                name="fleet", dp=4, gpus_per_node=1, command=[sys.executable, "-c", rank]
            )
            with grpc.insecure_channel(address) as channel:
                jobs = jobs_pb2_grpc.JobServiceStub(channel)
                job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job
            ranks = {int(hello.recv(64)) for _ in range(4)}

        port = scheduler.scheduler.port
        after = newest_event(address)
        scheduler.stop()
        scheduler = SchedulerThread(
            scheduler_settings(
                stores,
                tmp_path / "s2",
                database_url=settings.database_url,
                leader_loops=True,
                port=port,
                redis_prefix=settings.redis_prefix,
            )
        )
        try:
            wait_for_events(address, {(n, "node.reconnected") for n in NODES}, after, 10)
            alive = {pid for pid in ranks if psutil.pid_exists(pid)}
            assert alive == ranks  # the same processes, never restarted
            with grpc.insecure_channel(address) as channel:
                again = jobs_pb2_grpc.JobServiceStub(channel).Get(
                    jobs_pb2.GetJobRequest(job_id=job.id)
                )
            assert again.generation == 1  # never restarted
        finally:
            scheduler.stop()
