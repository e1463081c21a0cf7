"""The fork server (pitstop.agent.forkserver): a process forked from it is the command
as `python` would run it, lives and dies as one the agent starts itself, and anything
it cannot fork faithfully is refused so the agent starts it afresh."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kit.dirs import short_tempdir
from kit.forking import ForkServerProcess
from kit.waits import until
from pitstop.agent.forkserver import ForkServerClient
from pitstop.client.localcluster.processes import environ, pid_alive

TIMEOUT = 20.0

SCRIPT = """
import json, os, sys, time
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("X"), "name": __name__,
    "path0": sys.path[0], "ppid": os.getppid(), "pgid": os.getpgid(0), "pid": os.getpid(),
}))
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "exit3":
    sys.exit(3)
if what == "raise":
    raise RuntimeError("a bug in the script")
if what == "message":
    sys.exit("gave up: no data")
if what == "sigkill":
    os.kill(os.getpid(), 9)
if what == "hold":
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(json.dumps({"child": child.pid}))
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with short_tempdir("ps-fs-") as path:  # a short socket path
        yield path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ForkServerProcess]:
    with ForkServerProcess(folder / "fork.sock", "json", dict(os.environ)) as started:
        yield started


@pytest.fixture
async def client(server: ForkServerProcess) -> AsyncIterator[ForkServerClient]:
    client = ForkServerClient(server.socket_path)
    yield client
    await client.close()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "rank.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PITSTOP_RANK_KEY": "secret", **extra}


def lines(log: Path) -> list[dict[str, object]]:
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def test_a_forked_script_runs_as_python_would_run_it(
    client: ForkServerClient, server: ForkServerProcess, script: Path, tmp_path: Path
) -> None:
    log = tmp_path / "rank.log"
    process = await client.launch(
        [sys.executable, str(script), "exit3", "more"], env(X="ex"), str(tmp_path), log
    )
    assert process is not None

    assert await asyncio.wait_for(process.wait(), TIMEOUT) == 3
    (seen,) = lines(log)
    assert seen == {
        "argv": [str(script), "exit3", "more"],
        "cwd": str(tmp_path),
        "x": "ex",
        "name": "__main__",
        "path0": str(script.parent),
        "ppid": server.proc.pid,  # forked, not started afresh
        "pgid": process.pid,  # the leader of a session of its own
        "pid": process.pid,
    }
    assert process.returncode == 3


async def test_a_forked_module_runs_as_python_m_would(
    client: ForkServerClient, script: Path, tmp_path: Path
) -> None:
    log = tmp_path / "rank.log"
    argv = [sys.executable, "-u", "-m", "rank", "exit3"]
    process = await client.launch(argv, env(), str(script.parent), log)
    assert process is not None

    assert await asyncio.wait_for(process.wait(), TIMEOUT) == 3
    (seen,) = lines(log)
    assert (seen["argv"], seen["name"], seen["path0"]) == (
        [str(script), "exit3"],
        "__main__",
        str(script.parent),
    )


@pytest.mark.parametrize(
    ("what", "code", "said"),
    [
        ("", 0, ""),
        ("raise", 1, "RuntimeError: a bug in the script"),
        ("message", 1, "gave up: no data"),
        ("sigkill", -signal.SIGKILL, ""),
    ],
)
async def test_exit_statuses_and_errors_are_as_a_fresh_process_gives_them(
    client: ForkServerClient, script: Path, tmp_path: Path, what: str, code: int, said: str
) -> None:
    log = tmp_path / "rank.log"
    process = await client.launch([sys.executable, str(script), what], env(), None, log)
    assert process is not None

    assert await asyncio.wait_for(process.wait(), TIMEOUT) == code
    assert said in log.read_text()


async def test_unbuffered_output_reaches_the_log_while_the_process_runs(
    client: ForkServerClient, script: Path, tmp_path: Path
) -> None:
    log = tmp_path / "rank.log"
    process = await client.launch([sys.executable, str(script), "hold"], env(), None, log)
    assert process is not None

    await until(
        lambda: len(lines(log)) == 2, "both lines in the log of a live process", TIMEOUT, poll=0.02
    )
    assert process.returncode is None
    os.killpg(process.pid, signal.SIGTERM)
    assert await asyncio.wait_for(process.wait(), TIMEOUT) == -signal.SIGTERM


async def test_its_environment_is_found_by_pid_without_the_rank_key(
    client: ForkServerClient, script: Path, tmp_path: Path
) -> None:
    log = tmp_path / "rank.log"
    process = await client.launch([sys.executable, str(script), "hold"], env(X="found"), None, log)
    assert process is not None
    await until(lambda: len(lines(log)) == 2, "the process runs", TIMEOUT, poll=0.02)

    seen = environ(process.pid)
    assert seen["X"] == "found"
    assert "PITSTOP_RANK_KEY" not in seen
    os.killpg(process.pid, signal.SIGKILL)
    await asyncio.wait_for(process.wait(), TIMEOUT)


@pytest.mark.parametrize(
    ("argv", "extra", "why"),
    [
        (["/bin/sh", "-c", "true"], {}, "is not this server's Python"),
        ([sys.executable, "-c", "pass"], {}, "only -u and -m are forked"),
        ([sys.executable, "-m"], {}, "only -u and -m are forked"),
        ([sys.executable, "SCRIPT"], {"PYTHONPATH": "/elsewhere"}, "PYTHONPATH differs"),
        ([sys.executable, "SCRIPT"], {"OMP_NUM_THREADS": "3"}, "OMP_NUM_THREADS differs"),
    ],
)
async def test_what_it_cannot_fork_faithfully_is_refused_with_the_reason(
    client: ForkServerClient,
    script: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    argv: list[str],
    extra: dict[str, str],
    why: str,
) -> None:
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    with caplog.at_level(logging.INFO, logger="pitstop.agent.forkserver"):
        assert await client.launch(argv, env(**extra), None, tmp_path / "rank.log") is None
    assert why in caplog.text
    # The connection serves on: the next command is forked.
    process = await client.launch([sys.executable, str(script)], env(), None, tmp_path / "2.log")
    assert process is not None
    assert await asyncio.wait_for(process.wait(), TIMEOUT) == 0


async def test_the_agent_gone_its_processes_and_what_they_started_are_killed(
    server: ForkServerProcess, script: Path, tmp_path: Path
) -> None:
    client = ForkServerClient(server.socket_path)
    log = tmp_path / "rank.log"
    process = await client.launch([sys.executable, str(script), "hold"], env(), None, log)
    assert process is not None
    await until(lambda: len(lines(log)) == 2, "the process and its child run", TIMEOUT, poll=0.02)
    child = int(lines(log)[1]["child"])  # type: ignore[call-overload]

    await client.close()  # as when the agent dies: its connection closes

    await until(lambda: not pid_alive(process.pid), "the process is killed", TIMEOUT, poll=0.02)
    await until(
        lambda: not pid_alive(child), "what it started (its group) is killed", TIMEOUT, poll=0.02
    )


async def test_the_server_gone_its_processes_die_later_ones_start_afresh_until_it_serves(
    folder: Path, script: Path, tmp_path: Path
) -> None:
    with ForkServerProcess(folder / "doomed.sock", "", dict(os.environ)) as doomed:
        client = ForkServerClient(doomed.socket_path)
        log = tmp_path / "rank.log"
        process = await client.launch([sys.executable, str(script), "hold"], env(), None, log)
        assert process is not None
        await until(lambda: len(lines(log)) == 2, "the process runs", TIMEOUT, poll=0.02)

        doomed.proc.kill()

        assert await asyncio.wait_for(process.wait(), TIMEOUT) == -signal.SIGKILL
        await until(
            lambda: not pid_alive(process.pid),
            "the process dies with the server",
            TIMEOUT,
            poll=0.02,
        )
        assert await client.launch([sys.executable, str(script)], env(), None, log) is None
        # A server serving there again (an agent's zygote, restarted) forks again.
        with ForkServerProcess(doomed.socket_path, "", dict(os.environ)):
            process = await client.launch([sys.executable, str(script)], env(), None, log)
            assert process is not None
            assert await asyncio.wait_for(process.wait(), TIMEOUT) == 0
        await client.close()


async def test_a_process_that_exits_at_once_is_reported_exited(
    client: ForkServerClient, tmp_path: Path
) -> None:
    """Its exit may reach the agent in the same read as the reply naming its pid."""
    empty = tmp_path / "empty.py"
    empty.write_text("")
    launched = [
        await client.launch([sys.executable, str(empty)], env(), None, tmp_path / f"{i}.log")
        for i in range(40)
    ]
    assert all(p is not None for p in launched)
    codes = await asyncio.wait_for(
        asyncio.gather(*(p.wait() for p in launched if p is not None)), TIMEOUT
    )
    assert codes == [0] * 40


OTHER_USER = """
import os, socket, sys

os.setgroups([])
os.setgid(65534)
os.setuid(65534)  # nobody, from here on
answer = b"not connected"
try:
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(float(sys.argv[3]))
        probe.connect(sys.argv[1])
        answer = b"closed:"  # unless an answer comes
        probe.sendall(sys.argv[2].encode() + b"\\n")
        answer += probe.recv(100)
except OSError as exc:
    answer += f" ({exc!r})".encode() if answer != b"closed:" else b""
sys.stdout.buffer.write(answer)
"""
"""What another user's process does at the fork server's socket: become nobody, connect,
ask for a fork, print what came back (``closed:`` and nothing when the server hangs
up). Started by root, it has what it imports before it gives up root."""


def test_another_users_connection_is_closed_unanswered(
    server: ForkServerProcess, script: Path, tmp_path: Path
) -> None:
    """It runs commands as its user: a process of another user that reaches the socket
    (here opened to all on purpose) gets nothing forked and no answer."""
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root")
    folder = server.socket_path.parent
    log = tmp_path / "never.log"
    request = {"id": 1, "argv": [sys.executable, str(script)], "env": env(), "log": str(log)}
    os.chmod(folder, 0o755)
    os.chmod(server.socket_path, 0o666)
    try:
        # The other user: a fresh interpreter that turns itself into nobody, not a
        # fork of this one, whose threads (gRPC's among them) a forked child would
        # inherit half-held (such a child once died before it said anything).
        argv = [str(server.socket_path), json.dumps(request), str(TIMEOUT)]
        other = subprocess.run(
            [sys.executable, "-c", OTHER_USER, *argv],
            capture_output=True,
            timeout=TIMEOUT,
            check=False,
        )
        said = other.stdout
    finally:
        os.chmod(server.socket_path, 0o600)
        os.chmod(folder, 0o700)
    assert other.returncode == 0, other.stderr
    assert said == b"closed:", said  # connected, then closed without an answer
    assert not log.exists()


def test_a_malformed_request_is_refused_and_the_connection_serves_on(
    server: ForkServerProcess, script: Path, tmp_path: Path
) -> None:
    log = tmp_path / "rank.log"
    good = {"id": 3, "argv": [sys.executable, str(script)], "env": env(), "log": str(log)}
    with socket.socket(socket.AF_UNIX) as raw:
        raw.settimeout(TIMEOUT)
        raw.connect(str(server.socket_path))
        raw.sendall(b"not json\n" + b'{"id": 2, "argv": []}\n' + json.dumps(good).encode() + b"\n")
        replies: list[dict[str, object]] = []
        buffer = b""
        while len(replies) < 4:  # two refusals, the pid, its exit
            buffer += raw.recv(4096)
            *complete, buffer = buffer.split(b"\n")
            replies += [json.loads(line) for line in complete]
    assert replies[0] == {"id": None, "refused": replies[0]["refused"]}
    assert "bad request" in str(replies[0]["refused"])
    assert replies[1]["id"] == 2
    assert "bad request: 'env'" in str(replies[1]["refused"])
    assert replies[2]["id"] == 3
    assert "pid" in replies[2]
    assert replies[3] == {"exited": replies[2]["pid"], "returncode": 0}


async def test_the_modules_a_job_names_are_imported_once_in_the_server(tmp_path: Path) -> None:
    """A job's preload_modules: each forked child finds the importable ones imported
    (the server imported them once, after a probe did); one that raises on import, or
    that initialises CUDA when imported, is left for the child to import itself."""
    modules, imports = tmp_path / "modules", tmp_path / "imports.txt"
    modules.mkdir()
    (modules / "preload_ok.py").write_text(
        f"import os\nwith open({str(imports)!r}, 'a') as out:\n"
        "    out.write(f'{os.getpid()}\\n')\n"
    )
    (modules / "preload_bad.py").write_text("raise ImportError('no such backend here')\n")
    # No GPU here: the module leaves torch as one that initialised CUDA would.
    (modules / "preload_cuda.py").write_text(
        "import torch\ntorch.cuda.is_initialized = lambda: True\n"
    )
    script = tmp_path / "see.py"
    names = ("preload_ok", "preload_bad", "preload_cuda")
    script.write_text(
        f"import json, sys\nprint(json.dumps([m for m in {names!r} if m in sys.modules]))\n"
    )
    server_env = {**os.environ, "PYTHONPATH": str(modules)}
    with (
        short_tempdir("ps-pl-") as folder,
        ForkServerProcess(folder / "fork.sock", "json", server_env) as server,
    ):
        client = ForkServerClient(server.socket_path)
        try:
            for launch in range(2):
                log = tmp_path / f"rank-{launch}.log"
                process = await client.launch(
                    [sys.executable, str(script)], env(PYTHONPATH=str(modules)), None, log, names
                )
                assert process is not None
                assert await asyncio.wait_for(process.wait(), 3 * TIMEOUT) == 0
                assert json.loads(log.read_text().splitlines()[-1]) == ["preload_ok"]
        finally:
            await client.close()
        imported_by = imports.read_text().split()
        # Once in the probe, once in the server: not again for the second launch, and
        # never in a child (it found it imported).
        assert len(imported_by) == 2, imported_by
        assert imported_by[1] == str(server.proc.pid)
