"""Rank supervision: start the ranks placed on this node, watch every exit, stop them.

Each rank runs in its own session, so its process group holds the rank and whatever
it forks (data-loader workers, compilers): stopping a rank signals the whole group,
and when a rank ends, what it left behind in its group is killed with it. One asyncio
task per process waits for its exit and reports it at once; nothing polls.

On a spare, a job may keep standby processes: its command, started with
PITSTOP_STANDBY=1 on a GPU but no rank yet. Such a process imports torch and the script
and waits on the agent; `adopt` makes it a rank (from then on supervised as one). A
standby's own exit is logged, not reported: no rank was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.agent.forkserver import ForkServerClient
from pitstop.common.tls import TLS_DIR_ENV
from pitstop.rankside.rankclient import RANK_KEY_ENV
from pitstop.v1 import agent_pb2, common_pb2

logger = logging.getLogger(__name__)

ExitCallback = Callable[[agent_pb2.RankExited], Awaitable[None]]
"""Receives every rank exit; must not await start_ranks, stop_ranks or shutdown."""

DEFAULT_GRACE_SECONDS = 10.0
PREEMPT_WAIT_SECONDS = 90.0
"""The longest a job's start waits for another job's ranks to leave its GPUs (a
preempted job's stop: its step boundary, then its grace) before stopping them."""
STDERR_TAIL_BYTES = 4096
# After SIGKILL only a process stuck in the kernel can still be alive; do not hang on it.
KILL_WAIT_SECONDS = 30.0
STANDBY_NICE = 10
"""A standby imports at this niceness, so its start never slows the node's ranks, the
agent or (on a shared machine) a recovery in flight; the rank it becomes runs at 0."""


class RankProcess(Protocol):
    """What the supervisor uses of a process: an asyncio subprocess, or one a fork
    server started (`pitstop.agent.forkserver.ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


@dataclass
class _Rank:
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
        # Where ranks and standbys are forked from a process with torch imported; None,
        # or a command it refuses: each starts as a fresh process.
        self.fork_server = fork_server
        # With mutual TLS, ranks present the node's certificate to its checkpoint daemon
        # and the scheduler (PITSTOP_TLS_DIR).
        self.tls_dir = tls_dir
        # Ranks ask the scheduler's catalog where else their shards live when this
        # node's checkpoint daemon is gone.
        self.scheduler_address = scheduler_address
        self.socket_path = Path(socket_path)
        self.log_dir = Path(log_dir)
        self.checkpointd_address = checkpointd_address
        self._on_exit = on_exit
        self._ranks: dict[tuple[str, int], _Rank] = {}
        # Standby processes by (job id, GPU), and the command that started each job's.
        self._standbys: dict[tuple[str, int], _Rank] = {}
        self._standby_commands: dict[str, agent_pb2.StartRanks] = {}
        # The keys of the processes being started: a forked child can call the agent's
        # socket before the fork server's answer (its pid) is read and its entry recorded.
        self._launching: set[str] = set()
        # Starts and stops run one at a time, so a start never races the stop it follows.
        self._lock = asyncio.Lock()
        self._closed = False
        self.standby_waits: Callable[[str, int], bool] = lambda job_id, pid: False
        """Whether process `pid` of job `job_id` waits for a rank now (the local
        endpoint knows; the heartbeat reports such a standby ready)."""

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
        _check_job_id(job_id)
        if not command.command:
            raise ValueError(f"StartRanks for job {job_id!r}: command is empty; give the argv")
        mine = [a for a in command.rank_map.ranks if a.node_id == self.node_id]
        local_world_size = len(mine)
        if only is not None:
            mine = [a for a in mine if a.rank in only]
        if not mine:
            raise ValueError(
                f"StartRanks for job {job_id!r} generation {generation}: no rank of the "
                f"rank map is placed on node {self.node_id!r}; send it to the nodes it names"
            )
        if len({a.rank for a in mine}) != len(mine):
            raise ValueError(f"StartRanks for job {job_id!r}: a rank appears twice on this node")
        master = _parse_rendezvous(command.rendezvous_address)
        cwd = _check_working_dir(job_id, command.working_dir)
        await self._vacate({a.gpu_index for a in mine}, job_id)
        async with self._lock:
            if self._closed:
                raise RuntimeError("the rank supervisor is shut down; it starts no ranks")
            older: list[_Rank] = []
            for assignment in mine:
                running = self._ranks.get((job_id, assignment.rank))
                if running is not None and running.generation > generation:
                    raise ValueError(
                        f"StartRanks for job {job_id!r} generation {generation} is stale: "
                        f"rank {assignment.rank} runs generation {running.generation}"
                    )
                if running is not None and running.generation < generation:
                    older.append(running)
                standby = self._standbys.get((job_id, assignment.gpu_index))
                if standby is not None and not standby.beside:
                    older.append(standby)  # the rank takes its GPU: it would only hold memory
            await self._stop(older, DEFAULT_GRACE_SECONDS)
            for assignment in mine:
                if (job_id, assignment.rank) not in self._ranks:
                    env = self._rank_env(command, generation, assignment, local_world_size, master)
                    await self._spawn(command, generation, assignment, env, cwd)
        return [a.rank for a in mine]

    async def start_standbys(self, command: agent_pb2.StartRanks) -> list[int]:
        """Start a standby process of `command.job_id` on each GPU of
        `command.standby_gpus` that has none (nor a rank of the job, unless
        `command.beside_ranks`); return those GPUs. Raises ValueError for a command that
        cannot run here, RuntimeError after shutdown."""
        job_id = command.job_id
        _check_job_id(job_id)
        if not command.command:
            raise ValueError(f"StartRanks for job {job_id!r}: command is empty; give the argv")
        gpus = list(command.standby_gpus)
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"StartRanks for job {job_id!r}: a standby GPU appears twice")
        cwd = _check_working_dir(job_id, command.working_dir)
        async with self._lock:
            if self._closed:
                raise RuntimeError("the rank supervisor is shut down; it starts no ranks")
            self._standby_commands[job_id] = command
            for gpu in gpus:
                taken = any(e.gpu_index == gpu for (j, _), e in self._ranks.items() if j == job_id)
                if (job_id, gpu) in self._standbys or (taken and not command.beside_ranks):
                    continue
                env = self._process_env(command, command.generation, gpu)
                env["PITSTOP_STANDBY"] = "1"
                log_path = self.log_dir / job_id / f"standby-gpu{gpu}.log"
                process = await self._launch(
                    job_id, command.command, env, cwd, log_path, f"standby on GPU {gpu}"
                )
                _renice(process.pid, STANDBY_NICE)
                entry = _Rank(
                    job_id,
                    command.generation,
                    0,
                    gpu,
                    process,
                    log_path,
                    key=env[RANK_KEY_ENV],
                    standby=True,
                    beside=command.beside_ranks,
                )
                self._standbys[(job_id, gpu)] = entry
                self._watch_entry(entry)
        return gpus

    def standby_pid(self, job_id: str, gpu_index: int) -> int | None:
        """The pid of the job's standby process on the GPU; None when it has none."""
        entry = self._standbys.get((job_id, gpu_index))
        return None if entry is None else entry.process.pid

    def standby_gpu_for(self, job_id: str, gpu_index: int) -> int | None:
        """Where the standby process that would take a rank of the job on GPU
        `gpu_index` waits: on that GPU, else (one beside the job's ranks touches no GPU
        before it is handed a rank) on any; None when the job has none here."""
        if (job_id, gpu_index) in self._standbys:
            return gpu_index
        beside = [g for (j, g), e in sorted(self._standbys.items()) if j == job_id and e.beside]
        return beside[0] if beside else None

    def standby_command(self, job_id: str) -> agent_pb2.StartRanks | None:
        """The command that started the job's standby processes here, if any did."""
        return self._standby_commands.get(job_id)

    def adopt(
        self, job_id: str, gpu_index: int, rank: int, generation: int, on_gpu: int | None = None
    ) -> int | None:
        """Make the job's standby process on the GPU rank `rank` of `generation` (running
        on GPU `on_gpu`, when not the standby's own): from now on it is supervised,
        reported and stopped as that rank, and its log becomes the rank's `rank-N.log`
        (an earlier one here is kept as `rank-N.1.log`, `.2`, ...). Its pid; None when no
        standby process is there or the rank already runs here."""
        entry = self._standbys.get((job_id, gpu_index))
        if entry is None or entry.process.returncode is not None:
            return None
        if (job_id, rank) in self._ranks:
            return None
        del self._standbys[(job_id, gpu_index)]
        _renice(entry.process.pid, 0)
        entry.standby, entry.beside, entry.rank, entry.generation = False, False, rank, generation
        entry.gpu_index = gpu_index if on_gpu is None else on_gpu
        target = self.log_dir / job_id / f"rank-{rank}.log"
        try:
            if target.exists():  # the rank ran here before: keep its log beside
                earlier = itertools.count(1)
                while (kept := target.with_suffix(f".{next(earlier)}.log")).exists():
                    pass
                target.rename(kept)
            entry.log_path.rename(target)  # the process writes on through its descriptor
            entry.log_path = target
        except OSError as exc:
            logger.warning("rank %d of job %s logs to %s: %s", rank, job_id, entry.log_path, exc)
        self._ranks[(job_id, rank)] = entry
        logger.info(
            "standby pid %d on GPU %d became rank %d of job %s generation %d",
            entry.process.pid,
            gpu_index,
            rank,
            job_id,
            generation,
        )
        return entry.process.pid

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
            targets = [
                entry
                for (job_id, rank), entry in sorted(self._ranks.items())
                if job_id == command.job_id and (not named or rank in named)
            ]
            standbys = []
            if not named:
                self._standby_commands.pop(command.job_id, None)
                standbys = [e for (j, _), e in self._standbys.items() if j == command.job_id]
            if targets or standbys:
                logger.info(
                    "stopping ranks %s of job %s%s: %s",
                    [t.rank for t in targets],
                    command.job_id,
                    " at their next step boundary" if command.at_boundary else "",
                    command.reason or "no reason given",
                )
            if not command.at_boundary:
                await self._stop(targets + standbys, grace, first)
                return [entry.rank for entry in targets]
            await self._stop(standbys, DEFAULT_GRACE_SECONDS)
        lingering = await self._outlived(targets, grace)
        if lingering:
            async with self._lock:
                await self._stop(lingering, DEFAULT_GRACE_SECONDS, first)
        return [entry.rank for entry in targets]

    async def _outlived(self, entries: list[_Rank], seconds: float) -> list[_Rank]:
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

    async def _vacate(self, gpus: set[int], job_id: str) -> None:
        """Before a job's ranks start on `gpus`: the ranks of other jobs still there (a
        preempted job on its way out: the scheduler booked the GPUs anew) get
        PREEMPT_WAIT_SECONDS to exit, then are stopped. Waits outside the lock, so the
        StopRanks that tells them to go can run meanwhile."""
        others = [
            e for (other, _), e in self._ranks.items() if other != job_id and e.gpu_index in gpus
        ]
        if not others:
            return
        logger.info(
            "job %s: waiting for %s to leave GPUs %s",
            job_id,
            sorted({f"{e.job_id} rank {e.rank}" for e in others}),
            sorted(gpus),
        )
        lingering = await self._outlived(others, PREEMPT_WAIT_SECONDS)
        if lingering:
            async with self._lock:
                await self._stop(lingering, DEFAULT_GRACE_SECONDS)

    def running(self) -> list[agent_pb2.RunningRank]:
        """Every rank alive now, by job and rank, with the last step it reported; then
        the standby processes (standby set, rank 0; ready when it waits for a rank)."""
        entries = [e for _, e in sorted(self._ranks.items())]
        entries += [e for _, e in sorted(self._standbys.items())]
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
        """The GPU a running rank uses; None when the rank does not run here."""
        entry = self._ranks.get((job_id, rank))
        return None if entry is None else entry.gpu_index

    def pid(self, job_id: str, rank: int) -> int | None:
        """The process id of a running rank; None when the rank does not run here."""
        entry = self._ranks.get((job_id, rank))
        return None if entry is None else entry.process.pid

    def log_path(self, job_id: str, rank: int) -> Path | None:
        """Where a running rank's output goes; None when the rank does not run here."""
        entry = self._ranks.get((job_id, rank))
        return None if entry is None else entry.log_path

    def record_step(self, job_id: str, rank: int, step: int) -> None:
        """Remember the last step a rank reported; ignored for a rank not running here."""
        entry = self._ranks.get((job_id, rank))
        if entry is not None:
            entry.step = step

    def record_generation(self, job_id: str, rank: int, generation: int) -> None:
        """A surviving rank moved to a newer generation (it re-formed after a
        Reconfigure); `running` reports it there from now on."""
        entry = self._ranks.get((job_id, rank))
        if entry is not None and generation > entry.generation:
            entry.generation = generation

    def renumber(self, job_id: str, rank_map: common_pb2.RankMap) -> dict[int, int]:
        """A Reconfigure may give a surviving rank a new number (a shrink renumbers the
        ranks): key each of the job's processes here by the rank the new map places on
        its GPU, as the rank itself will call from now on. Returns old -> new."""
        placed = {a.gpu_index: a.rank for a in rank_map.ranks if a.node_id == self.node_id}
        moved = {}
        for key in [k for k in self._ranks if k[0] == job_id]:
            entry = self._ranks[key]
            new = placed.get(entry.gpu_index)
            if new is not None and new != entry.rank:
                moved[entry.rank] = new
        entries = {old: self._ranks.pop((job_id, old)) for old in moved}
        for old, new in moved.items():
            entries[old].rank = new
            self._ranks[(job_id, new)] = entries[old]
        return moved

    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]:
        """SIGKILL the process group of every rank on GPU `gpu_index`: an application or
        fatal Xid left their CUDA contexts (or the GPU) broken, so they can neither finish
        the step nor save anything worth keeping. Each exit is reported as usual (the
        scheduler restarts the rank in place, or has moved it off a failed node). Returns
        the (job id, rank) pairs killed."""
        killed = []
        for (job_id, rank), entry in sorted(self._ranks.items()):
            if entry.gpu_index == gpu_index:
                logger.warning(
                    "killing rank %d of job %s on GPU %d: %s", rank, job_id, gpu_index, reason
                )
                _signal_group(entry.process.pid, signal.SIGKILL)
                killed.append((job_id, rank))
        for (_, gpu), entry in sorted(self._standbys.items()):
            # A standby on that GPU goes too (the scheduler starts a spare's again where
            # it qualifies), but not one beside the ranks: it touches no GPU until it
            # takes over a rank, and it is what restarts the killed one in place.
            if gpu == gpu_index and not entry.beside:
                logger.warning("killing the %s: %s", entry.describe(), reason)
                _signal_group(entry.process.pid, signal.SIGKILL)
        return killed

    def record_result(self, job_id: str, rank: int, result: Mapping[str, str]) -> None:
        """Remember a rank's final result, reported with its exit."""
        entry = self._ranks.get((job_id, rank))
        if entry is None:
            logger.warning("result of rank %d of job %s, which does not run here", rank, job_id)
            return
        entry.result.update(result)

    async def shutdown(self, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
        """Stop every rank (SIGTERM, SIGKILL after `grace_seconds`) and wait until each
        exit is reported. No rank starts afterwards."""
        async with self._lock:
            self._closed = True
            await self._stop([*self._ranks.values(), *self._standbys.values()], grace_seconds)

    def _process_env(
        self, command: agent_pb2.StartRanks, generation: int, gpu_index: int
    ) -> dict[str, str]:
        """What every process of a job here gets, a rank or a standby."""
        env = {**os.environ, **command.env}
        env.update(
            CUDA_VISIBLE_DEVICES=str(gpu_index),
            PITSTOP_JOB_ID=command.job_id,
            PITSTOP_GENERATION=str(generation),
            PITSTOP_NODE_ID=self.node_id,
            PITSTOP_AGENT_SOCKET=str(self.socket_path),
            PITSTOP_CHECKPOINTD=self.checkpointd_address,
            PITSTOP_SCHEDULER=self.scheduler_address,
            PITSTOP_AGENT_PID=str(os.getpid()),  # it dies with the agent (see the trainer)
        )
        if self.tls_dir is not None:
            env[TLS_DIR_ENV] = str(self.tls_dir)
        env[RANK_KEY_ENV] = secrets.token_urlsafe(24)
        return env

    def started(self, key: str) -> bool:
        """Whether `key` is the rank key of a process this supervisor started and still
        watches (a rank, or a standby): the agent's socket takes calls from those only."""
        if not key:
            return False
        keys = [e.key for e in (*self._ranks.values(), *self._standbys.values()) if e.key]
        keys.extend(self._launching)
        # Every key compared, in constant time: timing says nothing about a key.
        found = [hmac.compare_digest(k, key) for k in keys]
        return any(found)

    def _rank_env(
        self,
        command: agent_pb2.StartRanks,
        generation: int,
        assignment: common_pb2.RankAssignment,
        local_world_size: int,
        master: tuple[str, str] | None,
    ) -> dict[str, str]:
        env = self._process_env(command, generation, assignment.gpu_index)
        env.update(
            RANK=str(assignment.rank),
            WORLD_SIZE=str(command.rank_map.world_size or len(command.rank_map.ranks)),
            LOCAL_RANK=str(assignment.local_rank),
            LOCAL_WORLD_SIZE=str(local_world_size),
            PITSTOP_RESTORE_STEP=str(command.restore_step),
        )
        env.update(_shape_env(command.rank_map, assignment))
        if master is not None:
            env["MASTER_ADDR"], env["MASTER_PORT"] = master
        return env

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
        process = await self._launch(command.job_id, command.command, env, cwd, log_path, what)
        entry = _Rank(
            command.job_id,
            generation,
            assignment.rank,
            assignment.gpu_index,
            process,
            log_path,
            key=env[RANK_KEY_ENV],
        )
        self._ranks[(entry.job_id, entry.rank)] = entry
        self._watch_entry(entry)
        logger.info(
            "started rank %d of job %s generation %d as pid %d on GPU %d",
            entry.rank,
            entry.job_id,
            generation,
            process.pid,
            entry.gpu_index,
        )

    async def _launch(
        self,
        job_id: str,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: str | None,
        log_path: Path,
        what: str,
    ) -> RankProcess:
        """Start `argv` in a session of its own, its output appended to `log_path`
        (forked by the fork server, when there is one and it takes the command).

        The process may call the agent's socket at once, so its key is accepted from
        before it exists; the caller records its entry (which accepts the key from then
        on) right after this returns, with no await between."""
        key = env[RANK_KEY_ENV]
        self._launching.add(key)
        try:
            log = _open_log(log_path, what)
            if self.fork_server is not None:
                log.close()
                forked = await self.fork_server.launch(argv, env, cwd, log_path)
                if forked is not None:
                    return forked
                log = log_path.open("ab")
            try:
                return await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ValueError(
                    f"job {job_id!r} {what}: cannot run {argv[0]!r}: "
                    f"{exc.strerror or exc}; check the job's command"
                ) from exc
            finally:
                log.close()  # the child holds its own descriptor
        finally:
            self._launching.discard(key)

    def _watch_entry(self, entry: _Rank) -> None:
        entry.watcher = asyncio.create_task(self._watch(entry), name=entry.describe())

    async def _watch(self, entry: _Rank) -> None:
        returncode = await entry.process.wait()
        # The rank is gone; whatever it forked into its group goes with it.
        _signal_group(entry.process.pid, signal.SIGKILL)
        if entry.standby:
            if self._standbys.get((entry.job_id, entry.gpu_index)) is entry:
                del self._standbys[(entry.job_id, entry.gpu_index)]
            logger.warning(
                "the %s (pid %d) exited with %d before it was handed a rank; see %s",
                entry.describe(),
                entry.process.pid,
                returncode,
                entry.log_path,
            )
            return
        if self._ranks.get((entry.job_id, entry.rank)) is entry:
            del self._ranks[(entry.job_id, entry.rank)]
        now = Timestamp()
        now.FromNanoseconds(time.time_ns())
        exited = agent_pb2.RankExited(
            job_id=entry.job_id,
            generation=entry.generation,
            rank=entry.rank,
            exit_code=max(returncode, 0),
            signal=max(-returncode, 0),
            time=now,
            stderr_tail=_tail(entry.log_path),
            result=entry.result,
        )
        logger.info(
            "rank %d of job %s exited: code %d signal %d",
            entry.rank,
            entry.job_id,
            exited.exit_code,
            exited.signal,
        )
        try:
            await self._on_exit(exited)
        except Exception:
            logger.exception("reporting the exit of rank %d of job %s", entry.rank, entry.job_id)

    async def _stop(
        self, entries: list[_Rank], grace: float, first: signal.Signals = signal.SIGTERM
    ) -> None:
        watchers = {entry.watcher: entry for entry in entries if entry.watcher is not None}
        if not watchers:
            return
        for entry in entries:
            _signal_group(entry.process.pid, first)
        _, lingering = await asyncio.wait(watchers, timeout=max(grace, 0.0))
        for watcher in lingering:
            entry = watchers[watcher]
            logger.warning("%s outlived SIGTERM by %.1f s: SIGKILL", entry.describe(), grace)
            _signal_group(entry.process.pid, signal.SIGKILL)
        if lingering:
            _, stuck = await asyncio.wait(lingering, timeout=KILL_WAIT_SECONDS)
            for watcher in stuck:
                entry = watchers[watcher]
                logger.error(
                    "%s (pid %d) survives SIGKILL: stuck in the kernel?",
                    entry.describe(),
                    entry.process.pid,
                )


def _check_job_id(job_id: str) -> None:
    # The job id names the rank log folder: it must stay one path component.
    if not job_id or job_id in {".", ".."} or "/" in job_id or "\0" in job_id:
        raise ValueError(f"StartRanks job_id {job_id!r}: give a job id without '/'")


def _check_working_dir(job_id: str, working_dir: str) -> str | None:
    if working_dir and not Path(working_dir).is_dir():
        raise ValueError(f"StartRanks for job {job_id!r}: working_dir {working_dir!r} is no folder")
    return working_dir or None


def _parse_rendezvous(address: str) -> tuple[str, str] | None:
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous_address {address!r}: use host:port, e.g. 10.0.0.1:29500")
    return host, port


def _renice(pid: int, niceness: int) -> None:
    """Set every thread of process `pid` to `niceness` (Linux nice values are per
    thread). Raising priority again needs CAP_SYS_NICE: without it the process keeps
    its niceness, which is logged."""
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:
            continue
        except PermissionError:
            logger.warning("process %d keeps its niceness: setting %d needs root", pid, niceness)
            return


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _open_log(path: Path, what: str) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("ab")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    log.write(f"--- pitstop: {what} starting at {stamp} ---\n".encode())
    log.flush()
    return log


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - STDERR_TAIL_BYTES, 0))
            return log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc.strerror})"


def _shape_env(
    rank_map: common_pb2.RankMap, assignment: common_pb2.RankAssignment
) -> dict[str, str]:
    """The job's dp x pp x tp and the rank's coordinates (tp varies fastest), for the
    trainer's DeviceMesh and for scripts that build their own groups."""
    if rank_map.dp_size:
        sizes = [rank_map.dp_size, rank_map.pp_size, rank_map.tp_size]
    elif rank_map.node_local:
        return {}  # the job's sizes are not given: the trainer assumes pure data parallel
    else:  # the whole map, from a scheduler that sends no sizes: they span it
        sizes = [1 + max(getattr(a, dim) for a in rank_map.ranks) for dim in ("dp", "pp", "tp")]
    if sizes[0] * sizes[1] * sizes[2] != (rank_map.world_size or len(rank_map.ranks)):
        return {}  # a map without coordinates: the trainer assumes pure data parallel
    names = ("PITSTOP_DP", "PITSTOP_PP", "PITSTOP_TP")
    env = {name: str(size) for name, size in zip(names, sizes, strict=True)}
    for name, dim in zip(names, ("dp", "pp", "tp"), strict=True):
        env[f"{name}_RANK"] = str(getattr(assignment, dim))
    return env
