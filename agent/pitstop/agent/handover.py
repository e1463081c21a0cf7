"""The standby hand-over: a Reconfigure that adopts ranks on this node gives each to
the job's standby process waiting here, or starts it afresh from the standby's command."""

from __future__ import annotations

import logging

from pitstop.agent.rankports import RankChannel, RankSupervision
from pitstop.v1 import agent_pb2, common_pb2, rank_pb2

log = logging.getLogger("pitstop.agent.executor")

STANDBY_WAIT_SECONDS = 60.0
"""How long a rank handed to a standby process still importing waits for it before it
starts afresh instead (a cold start takes as long as the import it would wait for)."""


class StandbyHandover:
    """Hands the ranks a Reconfigure adopts on node `node_id` to the job's standby
    processes there (`supervisor`), through the ranks' endpoint (`local`)."""

    def __init__(self, node_id: str, supervisor: RankSupervision, local: RankChannel) -> None:
        self._node_id = node_id
        self._supervisor = supervisor
        self._local = local

    async def hand_over(self, new: agent_pb2.Reconfigure) -> tuple[str, set[int]]:
        """Give each rank this node adopts to the job's standby process on the rank's GPU
        (or the one beside the job's ranks). One still importing is waited for; where none
        is left (it died, or was never started here), the rank starts as a fresh process
        from the standby's command. A rank of the job still running here (a node whose
        other rank died adopts in place) keeps its process. The error, if any, and the
        ranks taken over or started."""
        job_id, node_id = new.job_id, self._node_id
        placed = {a.rank: a for a in new.rank_map.ranks if a.node_id == node_id}
        running = {
            r.rank for r in self._supervisor.running() if r.job_id == job_id and not r.standby
        }
        missed, fresh, taken = [], [], set()
        for rank in new.adopted_ranks:
            where = placed.get(rank)
            if where is None:
                missed.append(rank)
                continue
            if rank in running:
                continue
            taken.add(rank)
            if not await self._adopt(new, where):
                fresh.append(rank)
        if fresh:
            spec = self._supervisor.standby_command(job_id)
            if spec is None:
                missed += fresh
            else:
                log.warning(
                    "job %s: no standby process waits for ranks %s here: starting them afresh",
                    job_id,
                    fresh,
                )
                start = agent_pb2.StartRanks(
                    job_id=job_id,
                    generation=new.generation,
                    command=spec.command,
                    env=spec.env,
                    working_dir=spec.working_dir,
                    rank_map=new.rank_map,
                    rendezvous_address=new.rendezvous_address,
                    restore_step=new.restore_step,
                )
                await self._supervisor.start_ranks(start, only=fresh)
        if missed:
            return (
                f"job {job_id}: node {node_id} cannot take ranks {missed}: not placed here in "
                "the rank map, or no standby process of the job was ever started here"
            ), taken
        return "", taken

    async def _adopt(self, new: agent_pb2.Reconfigure, where: common_pb2.RankAssignment) -> bool:
        """Hand rank `where` to the job's standby process on its GPU, once that process
        waits (at most STANDBY_WAIT_SECONDS); False when there is none to hand it to."""
        job_id = new.job_id
        gpu = self._supervisor.standby_gpu_for(job_id, where.gpu_index)
        pid = None if gpu is None else self._supervisor.standby_pid(job_id, gpu)
        if gpu is None or pid is None:
            return False

        def alive() -> bool:
            return self._supervisor.standby_pid(job_id, gpu) == pid

        # True: the process waits now, and no await comes before the hand-over, so it
        # cannot stop waiting in between.
        if not await self._local.wait_standby_process(job_id, pid, STANDBY_WAIT_SECONDS, alive):
            return False
        adopted = self._supervisor.adopt(
            job_id, gpu, where.rank, new.generation, on_gpu=where.gpu_index
        )
        if adopted != pid:
            return False
        assignment = rank_pb2.StandbyAssignment(
            reconfigure=new, rank=where.rank, local_rank=where.local_rank, gpu_index=where.gpu_index
        )
        return await self._local.assign_standby(job_id, assignment, pid=pid)
