"""The test side of `tests/integration/fake_rank.py`, a rank for the agent's tests: the
socket its ranks report to (`RankNotices`), the supervisor's exits (`ExitLog`), the
StartRanks that runs it (`start_command`), and waiting for processes to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from pitstop.v1 import agent_pb2, common_pb2

FAKE_RANK = Path(__file__).resolve().parents[1] / "integration" / "fake_rank.py"
NODE = "n1"
TIMEOUT = 10.0


class RankNotices:
    """Test side of --notify: a Unix socket server collecting each fake rank's lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._queues: defaultdict[int, asyncio.Queue[dict[str, Any]]] = defaultdict(asyncio.Queue)
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            notice = json.loads(line)
            self._writers[notice["rank"]] = writer
            self._queues[notice["rank"]].put_nowait(notice)
        writer.close()

    async def next(self, rank: int, timeout: float = 10.0) -> dict[str, Any]:
        """The next line from rank `rank`."""
        return await asyncio.wait_for(self._queues[rank].get(), timeout)

    async def go(self, rank: int) -> None:
        """Let rank `rank`, waiting after --wait-go, go on."""
        writer = self._writers[rank]
        writer.write(b"go\n")
        await writer.drain()

    async def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class ExitLog:
    """An `on_exit` callback collecting every RankExited the supervisor reports."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[agent_pb2.RankExited] = asyncio.Queue()

    async def __call__(self, exited: agent_pb2.RankExited) -> None:
        self.queue.put_nowait(exited)

    async def next(self) -> agent_pb2.RankExited:
        return await asyncio.wait_for(self.queue.get(), TIMEOUT)


async def wait_gone(pids: list[int]) -> None:
    """Wait until none of `pids` runs: a pidfd turns readable when its process ends."""
    loop = asyncio.get_running_loop()
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        ended = loop.create_future()
        loop.add_reader(pidfd, ended.set_result, None)
        try:
            await asyncio.wait_for(ended, TIMEOUT)
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        with contextlib.suppress(psutil.NoSuchProcess):  # reaped already
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def start_command(
    job_id: str,
    notices: RankNotices,
    *options: str,
    ranks: tuple[tuple[int, str, int], ...] = ((0, NODE, 0),),
    generation: int = 1,
    **fields: Any,
) -> agent_pb2.StartRanks:
    """StartRanks running fake_rank.py with `options`; ranks are (rank, node, gpu_index)."""
    local_ranks: dict[str, int] = defaultdict(int)
    assignments = []
    for rank, node, gpu in ranks:
        assignments.append(
            common_pb2.RankAssignment(
                rank=rank, node_id=node, gpu_index=gpu, local_rank=local_ranks[node]
            )
        )
        local_ranks[node] += 1
    return agent_pb2.StartRanks(
        job_id=job_id,
        generation=generation,
        command=[sys.executable, str(FAKE_RANK), "--notify", str(notices.path), *options],
        rank_map=common_pb2.RankMap(
            generation=generation, world_size=len(ranks), ranks=assignments
        ),
        **fields,
    )
