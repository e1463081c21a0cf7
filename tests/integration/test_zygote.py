"""The agent's own fork server (pitstop.agent.zygote): ranks start fresh until it serves
and are forked from then on; killed, it is started again and forks again (what it had
forked dies with it and is reported so); told to preload what cannot be imported, it is
not started again; it dies with its agent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kit.dirs import short_tempdir
from kit.waits import until, wait_until
from pitstop.agent.forkserver import ForkedProcess, ForkServerClient
from pitstop.agent.liveness import RestartBackoff
from pitstop.agent.zygote import Zygote
from pitstop.client.localcluster.processes import pid_alive

TIMEOUT = 30.0
SCRIPT = "import time, sys; print('up', flush=True); time.sleep(60 if sys.argv[1:] else 0)\n"


@pytest.fixture
async def folder() -> AsyncIterator[Path]:
    with short_tempdir("ps-zy-") as path:  # a short socket path
        yield path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PITSTOP_RANK_KEY": "secret"}


async def forked(client: ForkServerClient, script: Path, log: Path, *args: str) -> ForkedProcess:
    """Launch until the zygote serves (a launch before that is refused: started fresh)."""
    found: list[ForkedProcess] = []

    async def attempt() -> bool:
        process = await client.launch([sys.executable, str(script), *args], env(), None, log)
        if process is not None:
            found.append(process)
        return process is not None

    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while not await attempt():
        assert asyncio.get_running_loop().time() < deadline, "the zygote never served"
        await asyncio.sleep(0.1)
    return found[0]


async def test_ranks_are_forked_once_it_serves_and_again_after_it_was_killed(
    folder: Path, tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    zygote = Zygote(
        folder / "agent.zygote",
        "json",
        tmp_path / "zygote.log",
        backoff=RestartBackoff(first=0.1, longest=0.1),
    )
    client = ForkServerClient(zygote.socket_path)
    stop = asyncio.Event()
    keeper = asyncio.create_task(zygote.run(stop))
    try:
        held = await forked(client, script, tmp_path / "a.log", "hold")
        first = zygote.pid
        assert first is not None
        # Its children's environments sit beside its socket, not in a folder of /tmp
        # that a killed server would leave behind for ever.
        envs = folder / "agent.zygote.env"
        assert (envs / f"{held.pid}.env").exists()
        os.kill(first, signal.SIGKILL)
        # What it forked dies with it, and is reported killed.
        assert await asyncio.wait_for(held.wait(), TIMEOUT) == -signal.SIGKILL
        await until(lambda: zygote.pid not in (None, first), "started again", TIMEOUT)
        # The next one on the socket takes the folder over, emptied.
        await until(lambda: not (envs / f"{held.pid}.env").exists(), "emptied", TIMEOUT)
        again = await forked(client, script, tmp_path / "b.log")
        assert await asyncio.wait_for(again.wait(), TIMEOUT) == 0
        assert zygote.starts == 2
        assert "up" in (tmp_path / "b.log").read_text()
    finally:
        stop.set()
        await keeper
        await client.close()
        await zygote.close()
    assert zygote.pid is None


async def test_a_preload_that_cannot_be_imported_is_not_started_again(
    folder: Path, tmp_path: Path
) -> None:
    zygote = Zygote(folder / "agent.zygote", "no_such_module_here", tmp_path / "zygote.log")
    await asyncio.wait_for(zygote.run(asyncio.Event()), TIMEOUT)
    assert zygote.gave_up
    assert zygote.starts == 1
    assert "no_such_module_here" in (tmp_path / "zygote.log").read_text()
    # Launches fall back to fresh processes.
    client = ForkServerClient(zygote.socket_path)
    assert await client.launch([sys.executable, "-c", "0"], env(), None, tmp_path / "x") is None
    await client.close()


def test_it_dies_with_its_agent(tmp_path: Path) -> None:
    """The agent SIGKILLed: its zygote (--parent) goes too, not left behind forever."""
    with short_tempdir("ps-zy-") as folder:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import asyncio, sys\n"
                "from pathlib import Path\n"
                "from pitstop.agent.zygote import Zygote\n"
                "z = Zygote(Path(sys.argv[1]), 'json', Path(sys.argv[2]))\n"
                "async def main():\n"
                "    task = asyncio.create_task(z.run(asyncio.Event()))\n"
                "    while z.pid is None:\n"
                "        await asyncio.sleep(0.02)\n"
                "    print(z.pid, flush=True)\n"
                "    await task\n"
                "asyncio.run(main())\n",
                str(folder / "agent.zygote"),
                str(tmp_path / "zygote.log"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert agent.stdout is not None
            pid = int(agent.stdout.readline())
            wait_until(lambda: (folder / "agent.zygote").exists(), "it serves", TIMEOUT)
            agent.kill()
            agent.wait(TIMEOUT)
            wait_until(lambda: not pid_alive(pid), "the zygote dies with its agent", TIMEOUT)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(TIMEOUT)
