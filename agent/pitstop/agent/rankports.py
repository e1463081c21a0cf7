"""What the agent's command handling needs of the rank supervisor and of the ranks'
local endpoint, as protocols (the executor, the standby hand-over and the link take
these, so tests can hand them fakes)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from pitstop.v1 import agent_pb2, common_pb2, rank_pb2


class RankSupervision(Protocol):
    """What the link needs of the rank supervisor: for the commands, the registration
    and (`kill_gpu`) the Xid handling."""

    async def start_ranks(
        self, command: agent_pb2.StartRanks, only: Collection[int] | None = None
    ) -> list[int]: ...
    async def stop_ranks(self, command: agent_pb2.StopRanks) -> list[int]: ...
    def running(self) -> list[agent_pb2.RunningRank]: ...
    def renumber(self, job_id: str, rank_map: common_pb2.RankMap) -> dict[int, int]: ...
    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]: ...
    def log_path(self, job_id: str, rank: int) -> Path | None: ...
    async def start_standbys(self, command: agent_pb2.StartRanks) -> list[int]: ...
    def standby_pid(self, job_id: str, gpu_index: int) -> int | None: ...
    def standby_gpu_for(self, job_id: str, gpu_index: int) -> int | None: ...
    def standby_command(self, job_id: str) -> agent_pb2.StartRanks | None: ...
    def adopt(
        self, job_id: str, gpu_index: int, rank: int, generation: int, on_gpu: int | None = None
    ) -> int | None: ...


class RankChannel(Protocol):
    """What the commands need of the local endpoint: commands to ranks, generations."""

    async def send_command(self, job_id: str, rank: int, command: rank_pb2.RankCommand) -> bool: ...
    def set_generation(
        self,
        job_id: str,
        generation: int,
        restore_step: int,
        windows: agent_pb2.StepWindows | None = None,
    ) -> None: ...
    async def assign_standby(
        self, job_id: str, assignment: rank_pb2.StandbyAssignment, pid: int | None = None
    ) -> bool: ...
    async def wait_standby_process(
        self, job_id: str, pid: int, timeout: float, alive: Callable[[], bool]
    ) -> bool: ...
