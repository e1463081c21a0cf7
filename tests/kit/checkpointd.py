"""What the checkpointd tests share: a fake catalog (the scheduler's side), daemons in a
thread or in a child process, and a rank's state without torch."""

from __future__ import annotations

import array
import asyncio
import ctypes
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kit.processes import line_with
from pitstop.checkpointd.config import CheckpointdSettings
from pitstop.checkpointd.daemon import CheckpointDaemon
from pitstop.checkpointd.instances import MARKER_SUFFIX, SHM_DIR, segment_prefix
from pitstop.client.launch import checkpointd_command, clean_env
from pitstop.rankside.writer import SnapshotWriter
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

TIMEOUT = 15.0
LOCAL, REPLICA, DURABLE = (
    checkpoint_pb2.SHARD_TIER_LOCAL,
    checkpoint_pb2.SHARD_TIER_REPLICA,
    checkpoint_pb2.SHARD_TIER_DURABLE,
)
Report = checkpoint_pb2.ReportShardsRequest


class FakeCatalog(checkpoint_pb2_grpc.CheckpointCatalogServiceServicer):
    """The scheduler's CheckpointCatalogService, recording every report."""

    def __init__(self) -> None:
        self.reports: list[Report] = []
        self.addresses: dict[str, str] = {}
        """node id -> checkpointd host:port, for GetRestorePoint's answers."""
        self.buddy = ("", "")
        self.ended: set[str] = set()
        """Jobs a report's answer names as ended, where the report holds them."""
        """(node id, host:port) GetBuddy answers: none until a test sets one."""
        self._changed = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        checkpoint_pb2_grpc.add_CheckpointCatalogServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def ReportShards(self, request: Report, context: Any) -> Any:  # noqa: N802
        with self._changed:
            self.reports.append(request)
            self._changed.notify_all()
            ended = sorted(self.ended & set(request.held_jobs))
        return checkpoint_pb2.ReportShardsResponse(ended_jobs=ended)

    def GetBuddy(self, request: Any, context: Any) -> Any:  # noqa: N802
        return checkpoint_pb2.GetBuddyResponse(
            buddy_node_id=self.buddy[0], buddy_address=self.buddy[1]
        )

    def GetRestorePoint(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Where each rank's shard of `request.step` sits in memory, as reported (the
        committed step, for 0: the newest held on two nodes)."""
        held: dict[tuple[int, int], set[str]] = {}
        with self._changed:
            for report in self.reports:
                for info in report.added:
                    key = info.header.key
                    if key.job_id == request.job_id and info.tier in (LOCAL, REPLICA):
                        held.setdefault((key.rank, key.step), set()).add(report.node_id)
                for key in report.removed:
                    if key.job_id == request.job_id:
                        held.get((key.rank, key.step), set()).discard(report.node_id)
        twice = [step for (_, step), nodes in held.items() if len(nodes) >= 2]
        step = request.step or max(twice, default=0)
        response = checkpoint_pb2.GetRestorePointResponse(committed_step=max(twice, default=0))
        for (rank, at), nodes in held.items():
            if at == step and nodes:
                where = response.locations[rank]
                where.node_ids.extend(sorted(nodes))
                where.addresses.extend(self.addresses.get(n, "") for n in sorted(nodes))
        return response

    def wait_for(self, holds: Callable[[list[Report]], bool], timeout: float = TIMEOUT) -> None:
        """Until `holds` for the reports received so far."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not holds(self.reports):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no such reports in {timeout}s: {self.reports}")
                self._changed.wait(left)


def added(
    node: str, job: str, step: int, tier: int, ranks: set[int]
) -> Callable[[list[Report]], bool]:
    """Whether `node` has reported holding `ranks` of (job, step) in `tier`."""

    def holds(reports: list[Report]) -> bool:
        got = {
            s.header.key.rank
            for report in reports
            if report.node_id == node
            for s in report.added
            if s.tier == tier and s.header.key.job_id == job and s.header.key.step == step
        }
        return ranks <= got

    return holds


class DaemonThread:
    """A real CheckpointDaemon on its own event loop in a thread."""

    def __init__(self, settings: CheckpointdSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def start() -> CheckpointDaemon:
            daemon = CheckpointDaemon(settings)
            await daemon.start()
            return daemon

        self.daemon: CheckpointDaemon = self.call(start())

    def call(self, work: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(TIMEOUT)

    @property
    def address(self) -> str:
        return self.daemon.address

    def stop(self) -> None:
        self.call(self.daemon.stop(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(TIMEOUT)
        self.loop.close()


class DaemonProcess:
    """`python -m pitstop.checkpointd.main run` as a child process, for kill -9."""

    def __init__(
        self,
        node_id: str,
        state_dir: Path,
        *args: str,
        port: int = 0,
        scheduler: str = "",
        **env: str,
    ) -> None:
        self.node_id = node_id
        environ = clean_env(**{f"PITSTOP_CHECKPOINTD_{k.upper()}": v for k, v in env.items()})
        command = checkpointd_command(
            node_id=node_id,
            host="127.0.0.1",
            port=port,
            scheduler=scheduler,
            state_dir=state_dir,
            as_module=True,
            extra=args,
        )
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self.wait_for_line("listening on").split("listening on ")[1].split()[0]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip())

    def wait_for_line(self, text: str, timeout: float = TIMEOUT) -> str:
        never = f"{self.node_id} never printed {text!r}"
        return line_with(self.lines, text, time.monotonic() + timeout, never)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(TIMEOUT)

    def stop(self) -> None:
        """SIGTERM, as a graceful stop; SIGKILL if it is still there after TIMEOUT."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.kill()


class RankCalls(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Records every unary call a rank's channel makes: (method, calling thread's name).
    With `old_daemon`, SealSlot asks for no next slot, so the daemon answers as one from
    before SealSlotRequest.next_size_bytes would: without a slot."""

    def __init__(self, *, old_daemon: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self._old_daemon = old_daemon

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        self.calls.append((method, threading.current_thread().name))
        if self._old_daemon and method == "SealSlot":
            request = checkpoint_pb2.SealSlotRequest(
                key=request.key, shm_name=request.shm_name, size_bytes=request.size_bytes
            )
        return continuation(details, request)

    def count(self, method: str) -> int:
        return sum(1 for name, _ in self.calls if name == method)

    def install(self, monkeypatch: Any) -> None:
        """Every channel opened from here on (the writer's among them) goes through this."""
        plain = grpc.insecure_channel

        def intercepted(target: str, options: Any = None, compression: Any = None) -> Any:
            return grpc.intercept_channel(plain(target, options, compression), self)

        monkeypatch.setattr(grpc, "insecure_channel", intercepted)


def node_segments(node_id: str) -> list[Path]:
    """Every segment in /dev/shm of every daemon of `node_id`, markers left out."""
    prefix = segment_prefix(node_id)
    return sorted(
        p for p in SHM_DIR.iterdir() if p.name.startswith(prefix) and p.suffix != MARKER_SUFFIX
    )


def make_state(rank: int, step: int) -> dict[str, Any]:
    """A rank's whole state without torch: weights, two Adam moments, RNG bytes."""
    n = 50_000
    return {
        "model.weight": array.array("f", (float(rank * 7 + step + i % 97) for i in range(n))),
        "optim.exp_avg": array.array("f", (0.5 * step + i % 13 for i in range(n))),
        "optim.exp_avg_sq": array.array("d", (0.25 * step + i % 5 for i in range(n // 2))),
        "optim.step": array.array("q", [step]),
        "rng.python": bytes(range(rank, rank + 200)),
    }


def as_bytes(state: dict[str, Any]) -> dict[str, bytes]:
    return {name: bytes(memoryview(value).cast("B")) for name, value in state.items()}


def restored_bytes(writer: SnapshotWriter, step: int = 0) -> tuple[dict[str, bytes], Any]:
    """The restored state as raw bytes per tensor, and the RestoredState."""
    restored = writer.restore(step)
    return {name: tensor_bytes(v) for name, v in restored.tensors.items()}, restored


def tensor_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    value = value.contiguous()
    return ctypes.string_at(value.data_ptr(), value.numel() * value.element_size())


def stub(address: str) -> Any:
    return checkpoint_pb2_grpc.CheckpointServiceStub(grpc.insecure_channel(address))


def key(job: str, rank: int, step: int) -> checkpoint_pb2.ShardKey:
    return checkpoint_pb2.ShardKey(job_id=job, rank=rank, step=step)


def daemon_settings(node_id: str, state_dir: Path, **overrides: Any) -> CheckpointdSettings:
    """A checkpoint daemon's settings for a test: any free port on loopback, no
    scheduler, 64 MiB of memory, quick retries, no durable flush within a test."""
    values: dict[str, Any] = {
        "node_id": node_id,
        "host": "127.0.0.1",
        "port": 0,
        "scheduler": "",
        "state_dir": state_dir,
        "memory_budget_bytes": 64 << 20,
        "retry_max_seconds": 0.2,
        "flush_every_steps": 1000,
        **overrides,
    }
    return CheckpointdSettings(**values)
