"""Fork servers for tests (`python -m pitstop.agent.forkserver`), a test's own
connection to one, and the ranks of a gloo world run on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from kit.dirs import short_tempdir
from kit.ports import free_port
from kit.processes import terminate
from pitstop.agent.forkserver import FORK_SERVER_DIR_ENV


@contextlib.contextmanager
def forking(preload: str, env: dict[str, str]) -> Iterator[ForkClient]:
    """A fork server with `preload` imported (started with `env`, which its children's
    start-up variables must equal), in a folder of its own, and this test's connection
    to it; all of it gone afterwards."""
    with (
        short_tempdir("pf-") as folder,
        ForkServerProcess(folder / "fork.sock", preload, env) as server,
    ):
        client = ForkClient(server.socket_path)
        try:
            yield client
        finally:
            client.close()


def run_mesh_ranks(
    argv: list[str],
    dp: int,
    tp: int,
    timeout: float,
    pp: int = 1,
    fork: ForkClient | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run `python *argv` as the dp x pp x tp ranks of one gloo world on loopback (RANK,
    WORLD_SIZE, MASTER_*, PITSTOP_DP/PP/TP set as the agent sets them, on top of `env`,
    this process's by default); every rank must exit 0 within `timeout`. With `fork`, the
    ranks are forked from that fork server rather than started afresh. Returns each
    rank's output; none is left running."""
    world, port = dp * pp * tp, str(free_port())
    shape = {"PITSTOP_DP": str(dp), "PITSTOP_PP": str(pp), "PITSTOP_TP": str(tp)}
    ranks: list[subprocess.Popen[bytes] | ForkedChild] = []
    with tempfile.TemporaryDirectory(prefix="pitstop-mesh-") as logs:
        try:
            for rank in range(world):
                own = dict(os.environ if env is None else env)
                own.update(RANK=str(rank), WORLD_SIZE=str(world), **shape)
                own.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                if fork is not None:
                    log = Path(logs) / f"rank-{rank}.log"
                    ranks.append(fork.launch([sys.executable, *argv], own, log))
                    continue
                ranks.append(
                    subprocess.Popen(
                        [sys.executable, *argv],
                        env=own,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + timeout
            outputs = []
            for i, proc in enumerate(ranks):
                left = max(0.0, deadline - time.monotonic())
                if isinstance(proc, ForkedChild):
                    proc.wait(left)
                    outputs.append((Path(logs) / f"rank-{i}.log").read_text(errors="replace"))
                else:
                    outputs.append(proc.communicate(timeout=left)[0].decode(errors="replace"))
        finally:
            for proc in ranks:
                proc.kill()
                proc.wait()
    for proc, output in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    return outputs


class ForkServerProcess:
    """`python -m pitstop.agent.forkserver` on `socket_path`, having imported `preload`
    (comma-separated): agents given `--fork-server socket_path` fork their ranks from it.
    A context manager; it stops the server (SIGTERM, SIGKILL after 30 s)."""

    def __init__(self, socket_path: Path, preload: str, env: dict[str, str]) -> None:
        self.socket_path = socket_path
        # Where it keeps its children's environments: the test's, so it is removed even
        # after a test kills the server.
        self.env_dir = Path(tempfile.mkdtemp(prefix="pitstop-forkserver-"))
        env = env | {FORK_SERVER_DIR_ENV: str(self.env_dir)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pitstop.agent.forkserver",
                *("--socket", str(socket_path), "--preload", preload),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # said once it listens (after the imports)
        assert "listening on" in line, f"the fork server did not start: {line!r}"

    def __enter__(self) -> ForkServerProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        terminate(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.env_dir, ignore_errors=True)


class ForkedChild:
    """A process a fork server started for a `ForkClient`: what a test uses of a
    `subprocess.Popen` (`pid`, `poll`, `wait`, `send_signal`, `kill`)."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _set_exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()


class ForkClient:
    """A test's own connection to a fork server (what an agent's `ForkServerClient` does,
    from a thread rather than an event loop): `launch` forks `python ...` there, its
    output to a file. The server kills what this client started when it closes."""

    def __init__(self, socket_path: Path) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(socket_path))
        self._lock = threading.Lock()
        self._ids = 0
        self._replies: dict[int, Future[ForkedChild | str]] = {}
        self._children: dict[int, ForkedChild] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def launch(
        self, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
    ) -> ForkedChild:
        """Fork `argv` (this Python: `[-u] -m MODULE ...` or `[-u] SCRIPT ...`) with `env`;
        its stdout and stderr appended to `log`. Fails with the server's reason if it
        refuses."""
        reply: Future[ForkedChild | str] = Future()
        with self._lock:
            self._ids += 1
            self._replies[self._ids] = reply
            request = {"id": self._ids, "argv": argv, "env": env, "cwd": cwd, "log": str(log)}
            self._sock.sendall(json.dumps(request, default=str).encode() + b"\n")
        answer = reply.result(timeout=30)
        assert isinstance(answer, ForkedChild), f"the fork server did not start {argv}: {answer}"
        answer.args = argv
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(10)

    def _read(self) -> None:
        with contextlib.suppress(OSError), self._sock.makefile("rb") as lines:
            for line in lines:
                message = json.loads(line)
                if "exited" in message:
                    child = self._children.pop(int(message["exited"]), None)
                    if child is not None:
                        child._set_exited(int(message["returncode"]))
                    continue
                with self._lock:
                    reply = self._replies.pop(message.get("id"), None)
                if reply is None:  # an answer to no request of ours
                    continue
                if "pid" in message:  # known before the next line, which may be its exit
                    child = ForkedChild(int(message["pid"]), [])
                    self._children[child.pid] = child
                    reply.set_result(child)
                else:
                    reply.set_result(str(message.get("refused", message)))
        with self._lock:  # the server is gone, and what it started with it
            for reply in self._replies.values():
                reply.set_result("the fork server is gone")
            self._replies.clear()
        for child in list(self._children.values()):
            child._set_exited(-signal.SIGKILL)
