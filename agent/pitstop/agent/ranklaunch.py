"""How the rank supervisor starts a process: the environment a rank or a standby gets,
its log, its session, and the fork server when there is one; and the checks a
StartRanks passes before anything starts."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import subprocess
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from pitstop.agent.forkserver import ForkServerClient
from pitstop.agent.ranktable import RankEntry, RankProcess
from pitstop.common.tls import TLS_DIR_ENV
from pitstop.rankside.rankclient import RANK_KEY_ENV
from pitstop.v1 import agent_pb2, common_pb2

logger = logging.getLogger("pitstop.agent.supervisor")


@dataclass
class RankLauncher:
    """Starts the processes of the jobs on node `node_id`, each in a session of its own
    with its output appended to a log under `log_dir`."""

    node_id: str
    socket_path: Path
    log_dir: Path
    checkpointd_address: str = ""
    # Ranks ask the scheduler's catalog where else their shards live when this node's
    # checkpoint daemon is gone.
    scheduler_address: str = ""
    # With mutual TLS, ranks present the node's certificate to its checkpoint daemon and
    # the scheduler (PITSTOP_TLS_DIR).
    tls_dir: Path | None = None
    # Where ranks and standbys are forked from a process with torch imported; None, or
    # a command it refuses: each starts as a fresh process.
    fork_server: ForkServerClient | None = None
    # The keys of the processes being started: a forked child can call the agent's
    # socket before the fork server's answer (its pid) is read and its entry recorded.
    launching: set[str] = field(default_factory=set)

    def process_env(
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

    def rank_env(
        self,
        command: agent_pb2.StartRanks,
        generation: int,
        assignment: common_pb2.RankAssignment,
        local_world_size: int,
        master: tuple[str, str] | None,
    ) -> dict[str, str]:
        env = self.process_env(command, generation, assignment.gpu_index)
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

    async def launch(
        self,
        job_id: str,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: str | None,
        log_path: Path,
        what: str,
        preload: Sequence[str] = (),
    ) -> RankProcess:
        """Start `argv` in a session of its own, its output appended to `log_path`
        (forked by the fork server, when there is one and it takes the command, after it
        has imported the job's `preload` modules).

        The process may call the agent's socket at once, so its key is accepted from
        before it exists; the caller records its entry (which accepts the key from then
        on) right after this returns, with no await between."""
        key = env[RANK_KEY_ENV]
        self.launching.add(key)
        try:
            log = _open_log(log_path, what)
            if self.fork_server is not None:
                log.close()
                forked = await self.fork_server.launch(argv, env, cwd, log_path, preload)
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
            self.launching.discard(key)

    def take_rank_log(self, entry: RankEntry) -> None:
        """An adopted standby's log becomes the rank's `rank-N.log` (an earlier one here
        is kept as `rank-N.1.log`, `.2`, ...)."""
        target = self.log_dir / entry.job_id / f"rank-{entry.rank}.log"
        try:
            if target.exists():  # the rank ran here before: keep its log beside
                earlier = itertools.count(1)
                while (kept := target.with_suffix(f".{next(earlier)}.log")).exists():
                    pass
                target.rename(kept)
            entry.log_path.rename(target)  # the process writes on through its descriptor
            entry.log_path = target
        except OSError as exc:
            logger.warning(
                "rank %d of job %s logs to %s: %s", entry.rank, entry.job_id, entry.log_path, exc
            )


def check_command(command: agent_pb2.StartRanks) -> None:
    """Raise ValueError for a StartRanks no process can be started from."""
    job_id = command.job_id
    # The job id names the rank log folder: it must stay one path component.
    if not job_id or job_id in {".", ".."} or "/" in job_id or "\0" in job_id:
        raise ValueError(f"StartRanks job_id {job_id!r}: give a job id without '/'")
    if not command.command:
        raise ValueError(f"StartRanks for job {job_id!r}: command is empty; give the argv")


def placed_here(
    command: agent_pb2.StartRanks, node_id: str, generation: int, only: Collection[int] | None
) -> tuple[list[common_pb2.RankAssignment], int]:
    """The assignments of `command.rank_map` on node `node_id` (those in `only`, when
    given) and how many the map places here in all; ValueError when none or one twice."""
    job_id = command.job_id
    mine = [a for a in command.rank_map.ranks if a.node_id == node_id]
    local_world_size = len(mine)
    if only is not None:
        mine = [a for a in mine if a.rank in only]
    if not mine:
        raise ValueError(
            f"StartRanks for job {job_id!r} generation {generation}: no rank of the "
            f"rank map is placed on node {node_id!r}; send it to the nodes it names"
        )
    if len({a.rank for a in mine}) != len(mine):
        raise ValueError(f"StartRanks for job {job_id!r}: a rank appears twice on this node")
    return mine, local_world_size


def check_working_dir(job_id: str, working_dir: str) -> str | None:
    if working_dir and not Path(working_dir).is_dir():
        raise ValueError(f"StartRanks for job {job_id!r}: working_dir {working_dir!r} is no folder")
    return working_dir or None


def parse_rendezvous(address: str) -> tuple[str, str] | None:
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous_address {address!r}: use host:port, e.g. 10.0.0.1:29500")
    return host, port


def renice(pid: int, niceness: int) -> None:
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


def _open_log(path: Path, what: str) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("ab")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    log.write(f"--- pitstop: {what} starting at {stamp} ---\n".encode())
    log.flush()
    return log


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
