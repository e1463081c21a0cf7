"""Rank supervision: start the ranks placed on this node, watch every exit, stop them.

Each rank runs in its own session, so its process group holds the rank and whatever
it forks (data-loader workers, compilers): stopping a rank signals the whole group,
and when a rank ends, what it left behind in its group is killed with it. One asyncio
task per process waits for its exit and reports it at once; nothing polls.

On a spare, a job may keep standby processes: its command, started with
PITSTOP_STANDBY=1 on a GPU but no rank yet. Such a process imports torch and the script
and waits on the agent; `adopt` makes it a rank (from then on supervised as one). A
standby's own exit is logged, not reported: no rank was lost.

The supervisor decides; its collaborators do: `RankLauncher` (pitstop.agent.ranklaunch)
starts processes, `RankTable` (pitstop.agent.ranktable) knows what runs here.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path

from pitstop.agent.forkserver import ForkServerClient
from pitstop.agent.ranklaunch import (
    RankLauncher,
    check_command,
    check_working_dir,
    parse_rendezvous,
    placed_here,
)
from pitstop.agent.ranktable import (
    KILL_WAIT_SECONDS,
    STDERR_TAIL_BYTES,
    ExitCause,
    RankEntry,
    RankProcess,
    RankTable,
    exit_report,
    explained,
    outlived,
    signal_group,
    stop_entries,
)
from pitstop.agent.standbys import STANDBY_NICE, Standbys
from pitstop.rankside.rankclient import RANK_KEY_ENV
from pitstop.v1 import agent_pb2, common_pb2

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "KILL_WAIT_SECONDS",
    "PREEMPT_WAIT_SECONDS",
    "STANDBY_NICE",
    "STDERR_TAIL_BYTES",
    "ExitCallback",
    "RankProcess",
    "RankSupervisor",
]

logger = logging.getLogger(__name__)

ExitCallback = Callable[[agent_pb2.RankExited], Awaitable[None]]
"""Receives every rank exit; must not await start_ranks, stop_ranks or shutdown."""

DEFAULT_GRACE_SECONDS = 10.0
PREEMPT_WAIT_SECONDS = 90.0
"""The longest a job's start waits for another job's ranks to leave its GPUs (a
preempted job's stop: its step boundary, then its grace) before stopping them."""


class RankSupervisor:
    """Starts, watches and stops the rank processes of every job on node `node_id`.

    Every exit, whatever its cause, is reported once through `on_exit`.
    """

    def __init__(
        self,
        node_id: str,
        socket_path: Path,
        log_dir: Path,
        on_exit: ExitCallback,
        checkpointd_address: str = "",
        scheduler_address: str = "",
        tls_dir: Path | None = None,
        fork_server: ForkServerClient | None = None,
    ) -> None:
        self.node_id = node_id
        self.socket_path = Path(socket_path)
        self.log_dir = Path(log_dir)
        self.fork_server = fork_server
        self.launcher = RankLauncher(
            node_id,
            self.socket_path,
            self.log_dir,
            checkpointd_address,
            scheduler_address,
            tls_dir,
            fork_server,
        )
        self.table = RankTable(node_id)
        self.standbys = Standbys(self.launcher, self.table, self._watch_entry)
        self._on_exit = on_exit
        self.exit_cause: ExitCause | None = None  # the host's word on a killed rank (OOM)
        # Starts and stops run one at a time, so a start never races the stop it follows.
        self._lock = asyncio.Lock()
        self._closed = False

    @property
    def standby_waits(self) -> Callable[[str, int], bool]:
        """Whether process `pid` of job `job_id` waits for a rank now (the local
        endpoint knows; the heartbeat reports such a standby ready)."""
        return self.table.standby_waits

    @standby_waits.setter
    def standby_waits(self, waits: Callable[[str, int], bool]) -> None:
        self.table.standby_waits = waits

    async def start_ranks(
        self, command: agent_pb2.StartRanks, only: Collection[int] | None = None
    ) -> list[int]:
        """Start the ranks of `command.rank_map` placed on this node (those in `only`,
        when given); return their global ranks.

        A rank already running in the same generation is left alone, so a repeated
        command is harmless; one running an older generation is stopped first. Raises
        ValueError for a command that cannot run here, RuntimeError after shutdown.
        """
        job_id = command.job_id
        generation = command.generation or command.rank_map.generation
        check_command(command)
        mine, local_world_size = placed_here(command, self.node_id, generation, only)
        master = parse_rendezvous(command.rendezvous_address)
        cwd = check_working_dir(job_id, command.working_dir)
        await self._vacate({a.gpu_index for a in mine}, job_id)
        async with self._lock:
            self._check_open()
            older: list[RankEntry] = []
            for assignment in mine:
                running = self.table.ranks.get((job_id, assignment.rank))
                if running is not None and running.generation > generation:
                    raise ValueError(
                        f"StartRanks for job {job_id!r} generation {generation} is stale: "
                        f"rank {assignment.rank} runs generation {running.generation}"
                    )
                if running is not None and running.generation < generation:
                    older.append(running)
                standby = self.table.standbys.get((job_id, assignment.gpu_index))
                if standby is not None and not standby.beside:
                    older.append(standby)  # the rank takes its GPU: it would only hold memory
            await stop_entries(older, DEFAULT_GRACE_SECONDS)
            for assignment in mine:
                if (job_id, assignment.rank) not in self.table.ranks:
                    env = self.launcher.rank_env(
                        command, generation, assignment, local_world_size, master
                    )
                    await self._spawn(command, generation, assignment, env, cwd)
        return [a.rank for a in mine]

    async def start_standbys(self, command: agent_pb2.StartRanks) -> list[int]:
        """Start a standby process of `command.job_id` on each GPU of
        `command.standby_gpus` that has none (nor a rank of the job, unless
        `command.beside_ranks`); return those GPUs. Raises ValueError for a command that
        cannot run here, RuntimeError after shutdown."""
        job_id = command.job_id
        check_command(command)
        gpus = list(command.standby_gpus)
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"StartRanks for job {job_id!r}: a standby GPU appears twice")
        cwd = check_working_dir(job_id, command.working_dir)
        async with self._lock:
            self._check_open()
            await self.standbys.start(command, cwd)
        return gpus

    def standby_pid(self, job_id: str, gpu_index: int) -> int | None:
        """The pid of the job's standby process on the GPU; None when it has none."""
        return self.table.standby_pid(job_id, gpu_index)

    def standby_gpu_for(self, job_id: str, gpu_index: int) -> int | None:
        """Where a standby to take a rank on the GPU waits (RankTable.standby_gpu_for)."""
        return self.table.standby_gpu_for(job_id, gpu_index)

    def standby_command(self, job_id: str) -> agent_pb2.StartRanks | None:
        """The command that started the job's standby processes here, if any did."""
        return self.table.standby_commands.get(job_id)

    def adopt(
        self, job_id: str, gpu_index: int, rank: int, generation: int, on_gpu: int | None = None
    ) -> int | None:
        """Make the job's standby process on the GPU rank `rank` of `generation` (see
        Standbys.adopt); its pid, None when no standby process is there or the rank
        already runs here."""
        return self.standbys.adopt(job_id, gpu_index, rank, generation, on_gpu)

    async def stop_ranks(self, command: agent_pb2.StopRanks) -> list[int]:
        """SIGTERM each named rank's process group (every rank of the job when none is
        named), SIGKILL what is left after `grace_seconds` (10 when 0); waits until each
        exit is reported and returns the ranks stopped. With `at_boundary` the ranks
        (told by the caller to stop at their next step boundary) get `grace_seconds` to
        exit on their own first, waited for outside the lock (another job's commands go
        on meanwhile); the job's standby processes, holding no state, stop at once."""
        grace = command.grace_seconds or DEFAULT_GRACE_SECONDS
        first = signal.SIGKILL if command.kill else signal.SIGTERM
        named = set(command.ranks)
        async with self._lock:
            targets = self.table.of_job(command.job_id, named)
            standbys = []
            if not named:
                self.table.standby_commands.pop(command.job_id, None)
                standbys = [e for (j, _), e in self.table.standbys.items() if j == command.job_id]
            if targets or standbys:
                logger.info(
                    "stopping ranks %s of job %s%s: %s",
                    [t.rank for t in targets],
                    command.job_id,
                    " at their next step boundary" if command.at_boundary else "",
                    command.reason or "no reason given",
                )
            if not command.at_boundary:
                await stop_entries(targets + standbys, grace, first)
                return [entry.rank for entry in targets]
            await stop_entries(standbys, DEFAULT_GRACE_SECONDS)
        lingering = await outlived(targets, grace)
        if lingering:
            async with self._lock:
                await stop_entries(lingering, DEFAULT_GRACE_SECONDS, first)
        return [entry.rank for entry in targets]

    async def _vacate(self, gpus: set[int], job_id: str) -> None:
        """Before a job's ranks start on `gpus`: the ranks of other jobs still there (a
        preempted job on its way out: the scheduler booked the GPUs anew) get
        PREEMPT_WAIT_SECONDS to exit, then are stopped. Waits outside the lock, so the
        StopRanks that tells them to go can run meanwhile."""
        others = self.table.others_on(gpus, job_id)
        if not others:
            return
        logger.info(
            "job %s: waiting for %s to leave GPUs %s",
            job_id,
            sorted({f"{e.job_id} rank {e.rank}" for e in others}),
            sorted(gpus),
        )
        lingering = await outlived(others, PREEMPT_WAIT_SECONDS)
        if lingering:
            async with self._lock:
                await stop_entries(lingering, DEFAULT_GRACE_SECONDS)

    def running(self) -> list[agent_pb2.RunningRank]:
        """Every rank alive now, then the standby processes (RankTable.running)."""
        return self.table.running()

    def gpu_index(self, job_id: str, rank: int) -> int | None:
        """The GPU a running rank uses; None when the rank does not run here."""
        return self.table.gpu_index(job_id, rank)

    def pid(self, job_id: str, rank: int) -> int | None:
        """The process id of a running rank; None when the rank does not run here."""
        return self.table.pid(job_id, rank)

    def log_path(self, job_id: str, rank: int) -> Path | None:
        """Where a running rank's output goes; None when the rank does not run here."""
        return self.table.log_path(job_id, rank)

    def record_step(self, job_id: str, rank: int, step: int) -> None:
        """Remember the last step a rank reported; ignored for a rank not running here."""
        self.table.record_step(job_id, rank, step)

    def record_generation(self, job_id: str, rank: int, generation: int) -> None:
        """A surviving rank moved to a newer generation (RankTable.record_generation)."""
        self.table.record_generation(job_id, rank, generation)

    def renumber(self, job_id: str, rank_map: common_pb2.RankMap) -> dict[int, int]:
        """Renumber the job's ranks as the new map places them (RankTable.renumber)."""
        return self.table.renumber(job_id, rank_map)

    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]:
        """SIGKILL every rank on the GPU (RankTable.kill_gpu); (job id, rank) killed."""
        return self.table.kill_gpu(gpu_index, reason)

    def record_result(self, job_id: str, rank: int, result: Mapping[str, str]) -> None:
        """Remember a rank's final result, reported with its exit."""
        self.table.record_result(job_id, rank, result)

    async def shutdown(self, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
        """Stop every rank (SIGTERM, SIGKILL after `grace_seconds`) and wait until each
        exit is reported. No rank starts afterwards."""
        async with self._lock:
            self._closed = True
            await stop_entries(self.table.entries(), grace_seconds)

    def started(self, key: str) -> bool:
        """Whether `key` is the rank key of a process this supervisor started and still
        watches (a rank, or a standby): the agent's socket takes calls from those only."""
        if not key:
            return False
        keys = [e.key for e in self.table.entries() if e.key]
        keys.extend(self.launcher.launching)
        # Every key compared, in constant time: timing says nothing about a key.
        found = [hmac.compare_digest(k, key) for k in keys]
        return any(found)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the rank supervisor is shut down; it starts no ranks")

    async def _spawn(
        self,
        command: agent_pb2.StartRanks,
        generation: int,
        assignment: common_pb2.RankAssignment,
        env: dict[str, str],
        cwd: str | None,
    ) -> None:
        log_path = self.log_dir / command.job_id / f"rank-{assignment.rank}.log"
        what = f"generation {generation} rank {assignment.rank}"
        with self.table.starting(command.job_id, assignment.rank, assignment.gpu_index):
            process = await self.launcher.launch(
                command.job_id, command.command, env, cwd, log_path, what, command.preload_modules
            )
        entry = RankEntry(
            command.job_id,
            generation,
            assignment.rank,
            assignment.gpu_index,
            process,
            log_path,
            key=env[RANK_KEY_ENV],
        )
        self.table.ranks[(entry.job_id, entry.rank)] = entry
        self._watch_entry(entry)
        logger.info(
            "started rank %d of job %s generation %d as pid %d on GPU %d",
            entry.rank,
            entry.job_id,
            generation,
            process.pid,
            entry.gpu_index,
        )

    def _watch_entry(self, entry: RankEntry) -> None:
        entry.watcher = asyncio.create_task(self._watch(entry), name=entry.describe())

    async def _watch(self, entry: RankEntry) -> None:
        returncode = await entry.process.wait()
        # The rank is gone; whatever it forked into its group goes with it.
        signal_group(entry.process.pid, signal.SIGKILL)
        self.table.forget(entry)
        if entry.standby:
            logger.warning(
                "the %s (pid %d) exited with %d before it was handed a rank; see %s",
                entry.describe(),
                entry.process.pid,
                returncode,
                entry.log_path,
            )
            return
        exited = await explained(exit_report(entry, returncode), entry.process.pid, self.exit_cause)
        logger.info(
            "rank %d of job %s exited: code %d signal %d%s",
            entry.rank,
            entry.job_id,
            exited.exit_code,
            exited.signal,
            f" ({exited.cause})" if exited.cause else "",
        )
        try:
            await self._on_exit(exited)
        except Exception:
            logger.exception("reporting the exit of rank %d of job %s", entry.rank, entry.job_id)
