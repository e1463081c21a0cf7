"""What the agent tells the scheduler about itself when a stream opens: the Register."""

from __future__ import annotations

import asyncio
import importlib.metadata
import socket
from collections.abc import Callable

from pitstop.agent.config import AgentSettings
from pitstop.agent.gpu import GpuBackend
from pitstop.agent.heartbeats import timestamp
from pitstop.v1 import agent_pb2, common_pb2


def agent_version() -> str:
    """The installed pitstop version."""
    try:
        return importlib.metadata.version("pitstop")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


async def register_message(
    settings: AgentSettings,
    backend: GpuBackend,
    running: Callable[[], list[agent_pb2.RunningRank]],
    started_at: float,
    recent_exits: Callable[[], list[agent_pb2.RankExited]] = list,
) -> agent_pb2.AgentMessage:
    """The Register that opens every stream: the node, its GPUs, its labels and role,
    the ranks it runs now (`running`) and those that exited lately (`recent_exits`)."""
    gpus = await asyncio.to_thread(backend.inventory)
    return agent_pb2.AgentMessage(
        register=agent_pb2.Register(
            node_id=settings.node_id,
            inventory=common_pb2.Inventory(
                hostname=settings.advertise_host or socket.gethostname(),
                driver_version=backend.driver_version(),
                gpus=gpus,
                agent_version=agent_version(),
                gpu_backend=backend.name,
                checkpointd_address=settings.checkpointd_address,
            ),
            labels=common_pb2.TopologyLabels(
                zone=settings.zone,
                block=settings.block,
                rack=settings.rack,
                nvlink_domain=settings.nvlink_domain,
            ),
            requested_role=(
                common_pb2.NODE_ROLE_SPARE
                if settings.role == "spare"
                else common_pb2.NODE_ROLE_WORKER
            ),
            running_ranks=running(),
            agent_started_at=timestamp(started_at),
            recent_exits=recent_exits(),
        )
    )
