"""A fork server: rank processes started from a process that has imported torch already.

A rank spends its first seconds importing Python, torch and the script's modules (2 to 5
CPU-seconds on a small machine). Where many agents share one host (a local cluster, the
fault matrix), every rank and standby pays that again. `python -m pitstop.agent.forkserver
--socket PATH --preload torch,...` imports the modules named once, then serves agents on
a Unix socket (the agent's `fork_server` setting): for each command it forks, and the
child becomes that command as `python` would run it.

Only a command whose child would be the same as a fresh interpreter's is forked: it must
run this server's Python (`python [-u] -m MODULE ...` or `python [-u] SCRIPT ...`), the
environment variables read while Python and its libraries start (`PYTHON*` but
PYTHONUNBUFFERED, which the child applies; `LD_*`, `OMP_*`, `MKL_*`, `KMP_*`, `GOMP_*`,
`TORCH_*`) must equal the server's, and the agent must share the server's network
namespace. Anything else is refused with the reason, and the agent starts the process
itself, as without a fork server. The server never initializes CUDA: a child does, as a
fresh process would.

Lifetimes, as with a process the agent starts:
- each child leads its own session (its process group is what the agent signals);
- a child dies with the server (PR_SET_PDEATHSIG) and with the agent that asked for
  it: when an agent's connection closes, the server SIGKILLs the process group of every
  child that agent asked for;
- the server reaps its children and tells the asking agent each exit status
  (negative: the signal), as `waitpid` would tell a parent.

`/proc/<pid>/environ` of a child shows the server's environment, not the child's. The
server writes each child's environment (without its rank key) to `<dir>/<pid>.env`,
`<dir>` being `FORK_SERVER_DIR_ENV` of the server's (and so of every child's)
`/proc/<pid>/environ`, for tools that find ranks by their environment; it removes the
file when it reaps the child.

The protocol is one JSON object per line each way. Agent to server:
`{"id": N, "argv": [...], "env": {...}, "cwd": "..." or null, "log": "path", "preload":
[module, ...]}` (preload optional: see `ForkServer.preload`). Server to
agent: `{"id": N, "pid": P}` or `{"id": N, "refused": "why"}`, and later, for each child,
`{"exited": P, "returncode": R}`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import importlib
import io
import json
import logging
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.rankside.rankclient import FORK_SERVER_PID_ENV, RANK_KEY_ENV

logger = logging.getLogger(__name__)

FORK_SERVER_DIR_ENV = "PITSTOP_FORK_SERVER_DIR"
"""In the server's environment: where it writes each child's environment."""
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_")
"""Environment variables read while Python and torch start: a child must match the
server in these, or be started afresh."""
APPLIED_IN_CHILD = frozenset({"PYTHONUNBUFFERED"})
SEND_TIMEOUT_SECONDS = 10.0
PRELOAD_PROBE_SECONDS = 120.0
"""The longest a probe may take to import the modules a job named."""
_PR_SET_PDEATHSIG = 1


# ----------------------------------------------------------------------------------------
# The server


@dataclass
class _Agent:
    """One agent's connection and the children it asked for."""

    sock: socket.socket
    peer_pid: int
    buffer: bytes = b""
    children: set[int] = field(default_factory=set)


class ForkServer:
    """Serves agents on `socket_path`; `serve` runs until SIGTERM or SIGINT."""

    def __init__(self, socket_path: Path, env_dir: Path) -> None:
        self.socket_path = socket_path
        self.env_dir = env_dir
        self.python = os.path.realpath(sys.executable)
        self.netns = _netns(os.getpid())
        self._selector = selectors.DefaultSelector()
        self._agents: dict[socket.socket, _Agent] = {}
        self._owner: dict[int, _Agent] = {}
        self._stopping = False
        self._own_fds: list[int] = []  # closed in every child
        self.preloaded: set[str] = set()
        """Modules a job named that this server imported (see `preload`)."""
        self.not_preloaded: dict[str, str] = {}
        """Modules a job named that it did not import, and why."""

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd wakes the loop
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)  # this user's agents only
        listener.listen(64)
        self._own_fds = [wake_r, wake_w, listener.fileno()]
        self._selector.register(listener, selectors.EVENT_READ, "listen")
        self._selector.register(wake_r, selectors.EVENT_READ, "wake")
        print(f"pitstop fork server listening on {self.socket_path}", flush=True)
        try:
            while not self._stopping:
                for key, _ in self._selector.select():
                    if key.data == "listen":
                        self._accept(listener)
                    elif key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            while os.read(wake_r, 512):
                                pass
                        self._reap()
                    else:
                        self._read(key.data)
        finally:
            for agent in list(self._agents.values()):
                self._drop(agent, "the fork server stops")
            self._reap()
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            shutil.rmtree(self.env_dir, ignore_errors=True)

    def _stop(self, *_: Any) -> None:
        self._stopping = True

    def _accept(self, listener: socket.socket) -> None:
        sock, _ = listener.accept()
        sock.settimeout(SEND_TIMEOUT_SECONDS)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        peer_pid = int.from_bytes(creds[:4], sys.byteorder)
        peer_uid = int.from_bytes(creds[4:8], sys.byteorder)
        if peer_uid != os.getuid():  # it runs commands as this user: for this user only
            logger.warning("refused a connection of uid %d (pid %d)", peer_uid, peer_pid)
            sock.close()
            return
        agent = _Agent(sock, peer_pid)
        self._agents[sock] = agent
        self._selector.register(sock, selectors.EVENT_READ, agent)

    def _read(self, agent: _Agent) -> None:
        try:
            data = agent.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._drop(agent, f"agent pid {agent.peer_pid} closed its connection")
            return
        agent.buffer += data
        while b"\n" in agent.buffer and agent.sock in self._agents:
            line, agent.buffer = agent.buffer.split(b"\n", 1)
            try:
                request = json.loads(line)
                reply = self._fork(agent, request)
            except (ValueError, TypeError, KeyError) as exc:
                reply = {"id": _request_id(line), "refused": f"bad request: {exc}"}
            except OSError as exc:  # fork itself failed (no memory, too many processes)
                reply = {"id": _request_id(line), "refused": f"cannot fork: {exc}"}
            self._send(agent, reply)

    def _fork(self, agent: _Agent, request: dict[str, Any]) -> dict[str, Any]:
        argv = [str(a) for a in request["argv"]]
        env = {str(k): str(v) for k, v in dict(request["env"]).items()}
        cwd = request.get("cwd") or None
        log_path = str(request["log"])
        why = self.refusal(argv, env, agent.peer_pid)
        if why:
            return {"id": request["id"], "refused": why}
        self.preload([str(name) for name in request.get("preload") or ()])
        env[FORK_SERVER_PID_ENV] = str(os.getpid())
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing of the server's is written twice
        pid = os.fork()
        if pid == 0:
            self._selector.close()
            for sock in self._agents:
                sock.close()
            for descriptor in self._own_fds:
                with contextlib.suppress(OSError):
                    os.close(descriptor)
            _become(argv, env, cwd, log_path)  # never returns
        agent.children.add(pid)
        self._owner[pid] = agent
        shown = {k: v for k, v in env.items() if k != RANK_KEY_ENV}
        try:
            _write_private(self.env_dir / f"{pid}.env", json.dumps(shown))
        except OSError as exc:
            logger.warning("cannot write the environment of pid %d: %s", pid, exc)
        return {"id": request["id"], "pid": pid}

    def preload(self, names: Sequence[str]) -> None:
        """Import the modules a job named (its `preload_modules`) here, once, so that
        every child finds them imported. Each is first imported in a forked probe: one
        that cannot be imported, or that initialises CUDA when imported (a child of a
        process with CUDA initialised cannot use its GPU), is not imported here and is
        never tried again (logged once); the child imports it itself, as a fresh
        interpreter would."""
        new = [n for n in dict.fromkeys(names) if n not in self.preloaded]
        new = [n for n in new if n not in self.not_preloaded]
        if not new:
            return
        verdicts = _probe_imports(new, PRELOAD_PROBE_SECONDS)
        for name in new:
            verdict = verdicts.get(name)
            if verdict is None:  # the probe stopped before it: tried again next time
                continue
            if verdict == "ok":
                try:
                    importlib.import_module(name)
                except BaseException as exc:  # what a module raises is its own
                    verdict = f"importing it raised {exc!r}"
            if verdict == "ok":
                self.preloaded.add(name)
                logger.info("preloaded %s for the processes forked from here", name)
            else:
                self.not_preloaded[name] = verdict
                logger.warning("not preloading %s: %s", name, verdict)

    def refusal(self, argv: Sequence[str], env: Mapping[str, str], peer_pid: int) -> str:
        """Why the command cannot be forked here; "" when it can."""
        if not argv or os.path.realpath(argv[0]) != self.python:
            return f"{argv[0] if argv else 'an empty command'!r} is not this server's Python"
        try:
            _parse_python_argv(argv)
        except ValueError as exc:
            return str(exc)
        mine = os.environ
        for name in sorted(set(env) | set(mine)):
            startup = name.startswith(STARTUP_PREFIXES) and name not in APPLIED_IN_CHILD
            if startup and env.get(name) != mine.get(name):
                return f"{name} differs from the fork server's (read at start-up)"
        netns = _netns(peer_pid)
        if netns != self.netns:
            return "the agent runs in another network namespace than the fork server"
        return ""

    def _send(self, agent: _Agent, message: dict[str, Any]) -> None:
        try:
            agent.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError as exc:
            self._drop(agent, f"agent pid {agent.peer_pid} unreachable: {exc}")

    def _drop(self, agent: _Agent, why: str) -> None:
        """The agent is gone: so are the children it asked for (their process groups)."""
        if self._agents.pop(agent.sock, None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(agent.sock)
        agent.sock.close()
        if agent.children:
            logger.warning("%s: killing its processes %s", why, sorted(agent.children))
        for pid in agent.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            with contextlib.suppress(FileNotFoundError):
                (self.env_dir / f"{pid}.env").unlink()
            agent = self._owner.pop(pid, None)
            if agent is None:
                continue
            agent.children.discard(pid)
            if agent.sock in self._agents:
                code = os.waitstatus_to_exitcode(status)
                self._send(agent, {"exited": pid, "returncode": code})


def _probe_imports(names: Sequence[str], timeout: float) -> dict[str, str]:
    """Import `names` in a forked child, one after another: for each, "ok" or why not
    (what importing it raised, or that it initialised CUDA). The child is killed after
    `timeout` s; the modules it did not get to are missing from the answer."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe: nothing of the server's is run or flushed here
        code = 0
        try:
            os.close(read_end)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_DFL)
            for name in names:
                try:
                    importlib.import_module(name)
                    verdict = "ok" if not _cuda_initialized() else "importing it initialised CUDA"
                except BaseException as exc:
                    verdict = f"importing it raised {exc!r}"
                os.write(write_end, json.dumps({name: verdict}).encode() + b"\n")
                if _cuda_initialized():
                    break  # every later one would be blamed for it
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    verdicts: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                break
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    for line in data.splitlines():
        with contextlib.suppress(ValueError, AttributeError):
            verdicts.update({str(k): str(v) for k, v in json.loads(line).items()})
    return verdicts


def _cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (never, if it has not imported torch)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def _request_id(line: bytes) -> Any:
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return json.loads(line).get("id")
    return None


def _netns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def _write_private(path: Path, text: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)


def _parse_python_argv(argv: Sequence[str]) -> tuple[bool, str, str, list[str]]:
    """(unbuffered, "module" or "script", target, its arguments) of a Python command
    line; ValueError for any interpreter option but -u, or none of -m and a script."""
    unbuffered = False
    rest = list(argv[1:])
    while rest and rest[0].startswith("-"):
        option = rest.pop(0)
        if option == "-u":
            unbuffered = True
        elif option == "-m" and rest:
            return unbuffered, "module", rest[0], rest[1:]
        else:
            raise ValueError(f"interpreter option {option!r}: only -u and -m are forked")
    if not rest:
        raise ValueError("no script or -m module to run")
    return unbuffered, "script", rest[0], rest[1:]


# ----------------------------------------------------------------------------------------
# The child


def _become(argv: Sequence[str], env: Mapping[str, str], cwd: str | None, log: str) -> None:
    """In the forked child: become `argv` as `python` would run it, then exit."""
    code = 127
    try:
        server = os.getppid()
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:  # the server died before the line above
            os._exit(code)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if cwd:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        unbuffered, kind, target, args = _parse_python_argv(argv)
        _fresh_streams(unbuffered or bool(env.get("PYTHONUNBUFFERED")))
        logging.root.handlers.clear()  # the script configures its own, as in a new process
        logging.root.setLevel(logging.WARNING)
        code = _run(kind, target, args)
    except BaseException:  # a failure before the script runs: said in the rank's log
        with contextlib.suppress(BaseException):
            os.write(2, traceback.format_exc().encode())
    finally:
        os._exit(code)


def _fresh_streams(unbuffered: bool) -> None:
    """stdin, stdout and stderr on descriptors 0-2, buffered as Python buffers them."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    raw_out = io.FileIO(1, "w", closefd=False)
    out_buffer: Any = raw_out if unbuffered else io.BufferedWriter(raw_out)
    stdout = io.TextIOWrapper(
        out_buffer,
        encoding=encoding,
        errors=errors,
        write_through=unbuffered,
    )
    stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding=encoding,
        errors="backslashreplace",
        line_buffering=True,
        write_through=unbuffered,
    )
    stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout, sys.stderr, sys.stdin = stdout, stderr, stdin
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = stdout, stderr, stdin  # type: ignore[misc]


def _run(kind: str, target: str, args: list[str]) -> int:
    """Run the module or script as __main__; the exit code Python would give."""
    sys.argv = [target, *args]
    try:
        if kind == "module":
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as Python ends on an uncaught Ctrl-C
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does at exit: join non-daemon threads, run atexit, flush."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(Exception):
            shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# ----------------------------------------------------------------------------------------
# The agent's side


class ForkedProcess:
    """A process the fork server started for this agent: what the supervisor uses of an
    asyncio subprocess (`pid`, `returncode`, `wait`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return int(await asyncio.shield(self._exited))

    def _set_exited(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._exited.set_result(returncode)


class ForkServerClient:
    """An agent's connection to a fork server. `launch` returns None where the process
    must be started as usual: the server refused it (logged, with the reason) or is
    unreachable (not serving yet, or gone: logged once until it serves again). Each
    launch while it is unreachable tries to connect again, so a server that starts late
    or was restarted is used from then on."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[ForkedProcess | dict[str, Any]]] = {}
        self._processes: dict[int, ForkedProcess] = {}
        self._ids = 0
        self._unreachable_logged = False
        self._closing = False
        self._refusals: set[str] = set()
        self._lock = asyncio.Lock()

    async def launch(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        log_path: Path,
        preload: Sequence[str] = (),
    ) -> ForkedProcess | None:
        async with self._lock:
            if not await self._connect():
                return None
            self._ids += 1
            request_id = self._ids
            reply: asyncio.Future[ForkedProcess | dict[str, Any]] = (
                asyncio.get_running_loop().create_future()
            )
            self._pending[request_id] = reply
            request = {
                "id": request_id,
                "argv": list(argv),
                "env": dict(env),
                "cwd": cwd,
                "log": str(log_path),
                "preload": list(preload),
            }
            assert self._writer is not None
            try:
                self._writer.write(json.dumps(request).encode() + b"\n")
                await self._writer.drain()
            except OSError as exc:
                self._lost(f"cannot write to it: {exc}")
        answer = await reply
        if isinstance(answer, ForkedProcess):
            return answer
        why = str(answer.get("refused", "unreachable"))
        if why not in self._refusals:
            self._refusals.add(why)
            logger.info("the fork server at %s starts no %s: %s", self.socket_path, argv[0], why)
        return None

    async def close(self) -> None:
        """Close the connection (after the supervisor has stopped every process: the
        server kills what is left of this agent's)."""
        self._closing = True
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        if self._task is not None:
            await self._task

    @property
    def connected(self) -> bool:
        """Whether the last launch reached the server and it has not gone since."""
        return self._writer is not None

    async def _connect(self) -> bool:
        if self._closing:
            return False
        if self._writer is not None:
            return True
        if self._task is not None:  # the last connection's reader: done, or ending
            await self._task
            self._task = None
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                str(self.socket_path), limit=1 << 20
            )
        except OSError as exc:
            if not self._unreachable_logged:
                self._unreachable_logged = True
                logger.warning(
                    "no fork server at %s (%s): ranks start as fresh processes until it serves",
                    self.socket_path,
                    exc.strerror or exc,
                )
            return False
        if self._unreachable_logged:
            logger.info("the fork server at %s serves: ranks are forked again", self.socket_path)
        self._unreachable_logged = False
        self._task = asyncio.create_task(self._read(), name="fork server replies")
        return True

    async def _read(self) -> None:
        assert self._reader is not None
        why = "it closed the connection"
        try:
            while line := await self._reader.readline():
                message = json.loads(line)
                if "exited" in message:
                    process = self._processes.pop(int(message["exited"]), None)
                    if process is not None:
                        process._set_exited(int(message["returncode"]))
                else:
                    reply = self._pending.pop(int(message["id"]), None)
                    answer: ForkedProcess | dict[str, Any] = message
                    if "pid" in message:
                        # Known before the next line is read: that may be its exit.
                        answer = ForkedProcess(int(message["pid"]))
                        self._processes[answer.pid] = answer
                    if reply is not None and not reply.done():
                        reply.set_result(answer)
        except (OSError, ValueError) as exc:
            why = f"its connection broke: {exc}"
        self._lost(why)

    def _lost(self, why: str) -> None:
        """The server is gone, and with it (PR_SET_PDEATHSIG) every child it started:
        each is killed again to be sure and reported killed; later launches start fresh
        processes."""
        if self._writer is not None and not self._closing:
            logger.warning("the fork server at %s is gone (%s)", self.socket_path, why)
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None  # the next launch connects again
        for reply in self._pending.values():
            if not reply.done():
                reply.set_result({"refused": "the fork server is gone"})
        self._pending.clear()
        for pid, process in list(self._processes.items()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            process._set_exited(-signal.SIGKILL)
        self._processes.clear()


# ----------------------------------------------------------------------------------------
# Command line


def env_folder(socket_path: Path) -> Path:
    """Where the server on `socket_path` keeps its children's environments."""
    return socket_path.with_name(f"{socket_path.name}.env")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pitstop.agent.forkserver",
        description="Start rank processes for agents from a process that has imported "
        "the modules named (torch, say): each agent names this socket as its fork_server.",
    )
    parser.add_argument("--socket", type=Path, required=True, help="Unix socket to serve on")
    parser.add_argument(
        "--preload",
        default="torch",
        help="Comma-separated modules to import before serving [torch]",
    )
    parser.add_argument(
        "--parent",
        type=int,
        default=0,
        help="Die with this process (an agent's own fork server dies with its agent)",
    )
    args = parser.parse_args(argv)
    if args.parent:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != args.parent:  # it died before the line above
            parser.exit(1, f"--parent {args.parent}: that process is gone\n")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if FORK_SERVER_DIR_ENV not in os.environ:
        # The children's /proc/<pid>/environ is this process's: name the folder of
        # their real environments there, by starting again with it (nothing imported yet).
        # Beside the socket, and emptied here: a server killed with its agent leaves its
        # folder behind, and the one started after it on the same socket takes it over.
        folder = env_folder(args.socket)
        shutil.rmtree(folder, ignore_errors=True)
        os.execve(
            sys.executable,
            [
                sys.executable,
                "-m",
                "pitstop.agent.forkserver",
                *(sys.argv[1:] if argv is None else argv),
            ],
            {**os.environ, FORK_SERVER_DIR_ENV: str(folder)},
        )
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks")
    for name in filter(None, (n.strip() for n in args.preload.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            parser.exit(
                2, f"--preload {name!r}: cannot import it ({exc}); name an importable module\n"
            )
    env_dir = Path(os.environ[FORK_SERVER_DIR_ENV])
    env_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ForkServer(args.socket, env_dir).serve()


if __name__ == "__main__":
    main()
