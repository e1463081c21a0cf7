"""What the rank supervisor knows of the processes it started: one entry per rank and
per standby process, the table that finds them, and how a set of them is stopped.

The supervisor (`pitstop.agent.supervisor`) starts the processes and decides when they
stop; this module answers what runs here and signals process groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.v1 import agent_pb2, common_pb2

logger = logging.getLogger("pitstop.agent.supervisor")

STDERR_TAIL_BYTES = 4096
# After SIGKILL only a process stuck in the kernel can still be alive; do not hang on it.
KILL_WAIT_SECONDS = 30.0


class RankProcess(Protocol):
    """What the supervisor uses of a process: an asyncio subprocess, or one a fork
    server started (`pitstop.agent.forkserver.ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


@dataclass
class RankEntry:
    """One process the supervisor started: a rank, or a standby process."""

    job_id: str
    generation: int
    rank: int
    gpu_index: int
    process: RankProcess
    log_path: Path
    step: int = 0
    result: dict[str, str] = field(default_factory=dict)
    watcher: asyncio.Task[None] | None = None
    key: str = ""  # the secret it calls the agent's socket with (PITSTOP_RANK_KEY)
    standby: bool = False  # a standby process, not (yet) a rank
    beside: bool = False  # a standby beside the job's ranks, for restarting one in place

    def describe(self) -> str:
        if self.standby:
            where = "beside the ranks" if self.beside else f"on GPU {self.gpu_index}"
            return f"standby process of job {self.job_id} {where}"
        return f"rank {self.rank} of job {self.job_id}"


class RankTable:
    """The ranks running on node `node_id` by (job id, rank), and the standby processes
    by (job id, GPU) with the command that started each job's."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.ranks: dict[tuple[str, int], RankEntry] = {}
        self.standbys: dict[tuple[str, int], RankEntry] = {}
        self.standby_commands: dict[str, agent_pb2.StartRanks] = {}
        self.launching: dict[tuple[str, int], int] = {}
        """(job id, rank) -> GPU of each rank whose process is being started: a forked
        rank runs at once and may call the agent before its entry is recorded."""
        self.standby_waits: Callable[[str, int], bool] = lambda job_id, pid: False
        """Whether process `pid` of job `job_id` waits for a rank now (the local
        endpoint knows; the heartbeat reports such a standby ready)."""

    @contextlib.contextmanager
    def starting(self, job_id: str, rank: int, gpu_index: int) -> Iterator[None]:
        """The rank is known here (`gpu_index`) while its process is started: forked, it
        runs at once and may call the agent before its entry is recorded."""
        self.launching[(job_id, rank)] = gpu_index
        try:
            yield
        finally:
            self.launching.pop((job_id, rank), None)

    def entries(self) -> list[RankEntry]:
        """Every process here: the ranks, then the standby processes."""
        return [*self.ranks.values(), *self.standbys.values()]

    def of_job(self, job_id: str, named: Collection[int]) -> list[RankEntry]:
        """The job's ranks here, by rank: those in `named`, every one when it is empty."""
        return [
            entry
            for (job, rank), entry in sorted(self.ranks.items())
            if job == job_id and (not named or rank in named)
        ]

    def others_on(self, gpus: set[int], job_id: str) -> list[RankEntry]:
        """The ranks of jobs other than `job_id` on any of `gpus`."""
        return [e for (j, _), e in self.ranks.items() if j != job_id and e.gpu_index in gpus]

    def forget(self, entry: RankEntry) -> None:
        """Drop an entry whose process exited (unless another took its place)."""
        table, key = (
            (self.standbys, (entry.job_id, entry.gpu_index))
            if entry.standby
            else (self.ranks, (entry.job_id, entry.rank))
        )
        if table.get(key) is entry:
            del table[key]

    def standby_pid(self, job_id: str, gpu_index: int) -> int | None:
        """The pid of the job's standby process on the GPU; None when it has none."""
        entry = self.standbys.get((job_id, gpu_index))
        return None if entry is None else entry.process.pid

    def standby_gpu_for(self, job_id: str, gpu_index: int) -> int | None:
        """Where the standby process that would take a rank of the job on GPU
        `gpu_index` waits: on that GPU, else (one beside the job's ranks touches no GPU
        before it is handed a rank) on any; None when the job has none here."""
        if (job_id, gpu_index) in self.standbys:
            return gpu_index
        beside = [g for (j, g), e in sorted(self.standbys.items()) if j == job_id and e.beside]
        return beside[0] if beside else None

    def running(self) -> list[agent_pb2.RunningRank]:
        """Every rank alive now, by job and rank, with the last step it reported; then
        the standby processes (standby set, rank 0; ready when it waits for a rank)."""
        entries = [e for _, e in sorted(self.ranks.items())]
        entries += [e for _, e in sorted(self.standbys.items())]
        return [
            agent_pb2.RunningRank(
                job_id=entry.job_id,
                generation=entry.generation,
                rank=entry.rank,
                pid=entry.process.pid,
                step=entry.step,
                standby=entry.standby,
                ready=entry.standby and self.standby_waits(entry.job_id, entry.process.pid),
            )
            for entry in entries
        ]

    def gpu_index(self, job_id: str, rank: int) -> int | None:
        """The GPU a running (or starting) rank uses; None when the rank does not run
        here."""
        entry = self.ranks.get((job_id, rank))
        return self.launching.get((job_id, rank)) if entry is None else entry.gpu_index

    def pids_on(self, gpu_index: int) -> list[int]:
        """The process ids of the ranks running on GPU `gpu_index` (not its standbys)."""
        return [e.process.pid for e in self.ranks.values() if e.gpu_index == gpu_index]

    def pid(self, job_id: str, rank: int) -> int | None:
        """The process id of a running rank; None when the rank does not run here."""
        entry = self.ranks.get((job_id, rank))
        return None if entry is None else entry.process.pid

    def log_path(self, job_id: str, rank: int) -> Path | None:
        """Where a running rank's output goes; None when the rank does not run here."""
        entry = self.ranks.get((job_id, rank))
        return None if entry is None else entry.log_path

    def record_step(self, job_id: str, rank: int, step: int) -> None:
        """Remember the last step a rank reported; ignored for a rank not running here."""
        entry = self.ranks.get((job_id, rank))
        if entry is not None:
            entry.step = step

    def record_generation(self, job_id: str, rank: int, generation: int) -> None:
        """A surviving rank moved to a newer generation (it re-formed after a
        Reconfigure); `running` reports it there from now on."""
        entry = self.ranks.get((job_id, rank))
        if entry is not None and generation > entry.generation:
            entry.generation = generation

    def record_result(self, job_id: str, rank: int, result: Mapping[str, str]) -> None:
        """Remember a rank's final result, reported with its exit."""
        entry = self.ranks.get((job_id, rank))
        if entry is None:
            logger.warning("result of rank %d of job %s, which does not run here", rank, job_id)
            return
        entry.result.update(result)

    def renumber(self, job_id: str, rank_map: common_pb2.RankMap) -> dict[int, int]:
        """A Reconfigure may give a surviving rank a new number (a shrink renumbers the
        ranks): key each of the job's processes here by the rank the new map places on
        its GPU, as the rank itself will call from now on. Returns old -> new."""
        placed = {a.gpu_index: a.rank for a in rank_map.ranks if a.node_id == self.node_id}
        moved = {}
        for key in [k for k in self.ranks if k[0] == job_id]:
            entry = self.ranks[key]
            new = placed.get(entry.gpu_index)
            if new is not None and new != entry.rank:
                moved[entry.rank] = new
        entries = {old: self.ranks.pop((job_id, old)) for old in moved}
        for old, new in moved.items():
            entries[old].rank = new
            self.ranks[(job_id, new)] = entries[old]
        return moved

    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]:
        """SIGKILL the process group of every rank on GPU `gpu_index`: an application or
        fatal Xid left their CUDA contexts (or the GPU) broken, so they can neither finish
        the step nor save anything worth keeping. Each exit is reported as usual (the
        scheduler restarts the rank in place, or has moved it off a failed node). Returns
        the (job id, rank) pairs killed."""
        killed = []
        for (job_id, rank), entry in sorted(self.ranks.items()):
            if entry.gpu_index == gpu_index:
                logger.warning(
                    "killing rank %d of job %s on GPU %d: %s", rank, job_id, gpu_index, reason
                )
                signal_group(entry.process.pid, signal.SIGKILL)
                killed.append((job_id, rank))
        for (_, gpu), entry in sorted(self.standbys.items()):
            # A standby on that GPU goes too (the scheduler starts a spare's again where
            # it qualifies), but not one beside the ranks: it touches no GPU until it
            # takes over a rank, and it is what restarts the killed one in place.
            if gpu == gpu_index and not entry.beside:
                logger.warning("killing the %s: %s", entry.describe(), reason)
                signal_group(entry.process.pid, signal.SIGKILL)
        return killed


async def outlived(entries: list[RankEntry], seconds: float) -> list[RankEntry]:
    """Of `entries`, those still alive after waiting up to `seconds` for them to exit
    on their own (no signal sent)."""
    watchers = {entry.watcher: entry for entry in entries if entry.watcher is not None}
    if not watchers:
        return []
    _, lingering = await asyncio.wait(watchers, timeout=max(seconds, 0.0))
    if lingering:
        logger.warning(
            "%d process(es) did not stop at a step boundary within %.1f s: signalling them",
            len(lingering),
            seconds,
        )
    return [watchers[w] for w in lingering]


async def stop_entries(
    entries: list[RankEntry], grace: float, first: signal.Signals = signal.SIGTERM
) -> None:
    """Signal each entry's process group with `first`, SIGKILL those alive after
    `grace` seconds, and wait until each watcher has reported its exit."""
    watchers = {entry.watcher: entry for entry in entries if entry.watcher is not None}
    if not watchers:
        return
    for entry in entries:
        signal_group(entry.process.pid, first)
    _, lingering = await asyncio.wait(watchers, timeout=max(grace, 0.0))
    for watcher in lingering:
        entry = watchers[watcher]
        logger.warning("%s outlived SIGTERM by %.1f s: SIGKILL", entry.describe(), grace)
        signal_group(entry.process.pid, signal.SIGKILL)
    if lingering:
        _, stuck = await asyncio.wait(lingering, timeout=KILL_WAIT_SECONDS)
        for watcher in stuck:
            entry = watchers[watcher]
            logger.error(
                "%s (pid %d) survives SIGKILL: stuck in the kernel?",
                entry.describe(),
                entry.process.pid,
            )


def exit_report(entry: RankEntry, returncode: int) -> agent_pb2.RankExited:
    """The RankExited the scheduler gets for a rank that exited with `returncode`."""
    now = Timestamp()
    now.FromNanoseconds(time.time_ns())
    return agent_pb2.RankExited(
        job_id=entry.job_id,
        generation=entry.generation,
        rank=entry.rank,
        exit_code=max(returncode, 0),
        signal=max(-returncode, 0),
        time=now,
        stderr_tail=_tail(entry.log_path),
        result=entry.result,
    )


ExitCause = Callable[[int, int], str]
"""What ended process (pid) killed by (signal), where the host knows more than the
signal ("the kernel killed it for memory (OOM)"); "" where it does not."""


async def explained(
    exited: agent_pb2.RankExited, pid: int, cause: ExitCause | None
) -> agent_pb2.RankExited:
    """`exited` with its cause, asked of `cause` off the event loop for a killed rank."""
    if cause is not None and exited.signal:
        try:
            exited.cause = await asyncio.to_thread(cause, pid, exited.signal)
        except Exception:  # the exit is reported, with or without its cause
            logger.exception("explaining the exit of rank %d of %s", exited.rank, exited.job_id)
    return exited


def signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - STDERR_TAIL_BYTES, 0))
            return log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc.strerror})"
