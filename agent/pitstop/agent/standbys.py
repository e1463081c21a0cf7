"""A job's standby processes on a spare: started on a GPU with no rank yet, each imports
torch and the job's script and waits on the agent until it is handed a rank."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pitstop.agent.ranklaunch import RankLauncher, renice
from pitstop.agent.ranktable import RankEntry, RankTable
from pitstop.rankside.rankclient import RANK_KEY_ENV
from pitstop.v1 import agent_pb2

logger = logging.getLogger("pitstop.agent.supervisor")

STANDBY_NICE = 10
"""A standby imports at this niceness, so its start never slows the node's ranks, the
agent or (on a shared machine) a recovery in flight; the rank it becomes runs at 0."""


class Standbys:
    """Starts standby processes with `launcher`, keeps them in `table`, hands each to
    `watch` (which reports its exit) and makes one a rank on `adopt`."""

    def __init__(
        self, launcher: RankLauncher, table: RankTable, watch: Callable[[RankEntry], None]
    ) -> None:
        self.launcher = launcher
        self.table = table
        self.watch = watch

    async def start(self, command: agent_pb2.StartRanks, cwd: str | None) -> None:
        """Start a standby process of the job on each GPU of `command.standby_gpus`
        that has none (nor a rank of the job, unless `command.beside_ranks`)."""
        job_id = command.job_id
        self.table.standby_commands[job_id] = command
        for gpu in command.standby_gpus:
            taken = any(e.gpu_index == gpu for (j, _), e in self.table.ranks.items() if j == job_id)
            if (job_id, gpu) in self.table.standbys or (taken and not command.beside_ranks):
                continue
            env = self.launcher.process_env(command, command.generation, gpu)
            env["PITSTOP_STANDBY"] = "1"
            log_path = self.launcher.log_dir / job_id / f"standby-gpu{gpu}.log"
            process = await self.launcher.launch(
                job_id,
                command.command,
                env,
                cwd,
                log_path,
                f"standby on GPU {gpu}",
                command.preload_modules,
            )
            renice(process.pid, STANDBY_NICE)
            entry = RankEntry(
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
            self.table.standbys[(job_id, gpu)] = entry
            self.watch(entry)

    def adopt(
        self, job_id: str, gpu_index: int, rank: int, generation: int, on_gpu: int | None = None
    ) -> int | None:
        """Make the job's standby process on the GPU rank `rank` of `generation` (running
        on GPU `on_gpu`, when not the standby's own): from now on it is supervised,
        reported and stopped as that rank, and its log becomes the rank's `rank-N.log`
        (an earlier one here is kept as `rank-N.1.log`, `.2`, ...). Its pid; None when no
        standby process is there or the rank already runs here."""
        entry = self.table.standbys.get((job_id, gpu_index))
        if entry is None or entry.process.returncode is not None:
            return None
        if (job_id, rank) in self.table.ranks:
            return None
        del self.table.standbys[(job_id, gpu_index)]
        renice(entry.process.pid, 0)
        entry.standby, entry.beside, entry.rank, entry.generation = False, False, rank, generation
        entry.gpu_index = gpu_index if on_gpu is None else on_gpu
        self.launcher.take_rank_log(entry)
        self.table.ranks[(job_id, rank)] = entry
        logger.info(
            "standby pid %d on GPU %d became rank %d of job %s generation %d",
            entry.process.pid,
            gpu_index,
            rank,
            job_id,
            generation,
        )
        return entry.process.pid
