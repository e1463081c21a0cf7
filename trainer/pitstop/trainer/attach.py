"""How a rank started by the agent attaches to it before its session begins: it dies
with the agent, prints its stacks on SIGUSR1, and asks the agent (Attach) where the
node's checkpoint daemon is and from which step to restore. Then the session
connects (`connect`): its snapshot writer, its command reader, its process group.
Off-cluster (no PITSTOP_AGENT_SOCKET) there is no agent to attach to; a writer and a
group are still opened when the environment asks for them."""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
from dataclasses import replace
from datetime import timedelta

import grpc

import pitstop.trainer.group as group
from pitstop.rankside.rankclient import FORK_SERVER_PID_ENV, RankControlClient
from pitstop.rankside.writer import SnapshotWriter
from pitstop.trainer.config import RankConfig
from pitstop.trainer.context import RankContext

log = logging.getLogger(__name__)


def attach(config: RankConfig) -> tuple[RankConfig, RankControlClient | None, str]:
    """The rank's config (with the restore step the agent gives), its client of the
    agent (None off-cluster) and the checkpoint daemon's address ("" when none)."""
    if config.agent_socket:
        _die_with_the_agent()
        # The agent's fallback when py-spy cannot attach: every thread's stack into
        # this rank's log on SIGUSR1 (pitstop.agent.stacks).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    control: RankControlClient | None = None
    checkpointd = config.checkpointd
    if config.agent_socket and config.standby:
        control = RankControlClient(config.agent_socket, config.job_id, 0)
    elif config.agent_socket:
        control = RankControlClient(config.agent_socket, config.job_id, config.rank)
        try:
            attached = control.attach(config.generation)
        except grpc.RpcError as exc:
            control.close()
            raise RuntimeError(
                f"rank {config.rank} cannot attach to the agent at {config.agent_socket}: "
                f"{exc.code().name}; is the pitstop agent running on this node?"
            ) from exc
        checkpointd = checkpointd or attached.checkpointd_address
        if attached.restore_step:
            config = replace(config, restore_step=int(attached.restore_step))
    return config, control, checkpointd


def connect(context: RankContext, checkpointd: str) -> None:
    """Open the snapshot writer, start the command reader, form the group."""
    config = context.config
    if checkpointd and config.job_id and not config.standby:
        context.writer = SnapshotWriter(
            checkpointd,
            config.job_id,
            config.rank,
            generation=config.generation,
            copy_threads=config.copy_threads or None,
            catalog_address=config.scheduler,
        )
    elif checkpointd and not config.job_id:
        log.warning("PITSTOP_CHECKPOINTD is set but PITSTOP_JOB_ID is not: no snapshots")
    if context.control is not None and not config.standby:
        context.start_commands()
    if config.distributed:
        context.device = group.device_for(config.local_rank)
        group.form(
            config.rank,
            config.world_size,
            config.timeout,
            device=context.device,
            wait=timedelta(seconds=config.reconfigure_timeout),
            generation=config.generation,
        )
    elif not config.standby:
        context.device = group.device_for(0)


_PR_SET_PDEATHSIG = 1


def _die_with_the_agent() -> None:
    """SIGKILL this rank when the agent that started it dies: a rank whose agent is gone
    can neither report nor be reconfigured or stopped, the scheduler treats its node as
    lost, and it must not train on in a generation that no longer exists. Exits at once
    if the agent is already gone. A rank forked by the agent's fork server
    (pitstop.agent.forkserver) has that server as its parent, which kills it when the
    agent's connection closes and whose death kills it too."""
    agent = os.environ.get("PITSTOP_AGENT_PID", "")
    if sys.platform != "linux" or not agent.isdigit():
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = os.getppid()
    forked_by = os.environ.get(FORK_SERVER_PID_ENV, "")
    if parent != int(agent) and not (forked_by.isdigit() and parent == int(forked_by)):
        raise SystemExit(f"the pitstop agent (pid {agent}) that started this rank is gone")
