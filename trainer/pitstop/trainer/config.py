"""What a rank learns from its environment: who it is, where its agent and checkpoint
daemon are, what to restore, and the timeouts that bound every wait.

The agent's supervisor sets the first block for every rank it starts; torchrun sets
RANK/WORLD_SIZE/MASTER_*; nothing at all is set off-cluster. Read once, at
`Session.from_env`, never at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from pitstop.trainer.integrity import IntegrityPolicy, skipped_from
from pitstop.trainer.mesh import Shape, ShapeError


class ConfigError(ValueError):
    """An environment variable that cannot be used; the message names it and the fix."""


@dataclass(frozen=True)
class RankConfig:
    """One rank's view of its job, from the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    job_id: str = ""
    generation: int = 0
    node_id: str = ""
    gpu_index: int | None = None
    """The GPU the agent gave this rank (CUDA_VISIBLE_DEVICES when it names one)."""
    agent_socket: str = ""
    """PITSTOP_AGENT_SOCKET; empty off-cluster: no commands, no reports."""
    checkpointd: str = ""
    """host:port of the node's checkpoint daemon; empty: no snapshots."""
    scheduler: str = ""
    """PITSTOP_SCHEDULER: host:port of the scheduler, whose checkpoint catalog names
    the other nodes holding this rank's state when its own daemon is gone. Optional: a
    rank also learns it from its daemon with every snapshot it seals."""
    restore_step: int = 0
    """Step to restore at start; 0 starts fresh."""
    distributed: bool = False
    """Whether to form a torch.distributed process group (RANK/WORLD_SIZE were given)."""
    standby: bool = False
    """PITSTOP_STANDBY=1: this process waits on the agent to be handed a rank."""
    snapshot_every: int = 1
    """PITSTOP_SNAPSHOT_EVERY: snapshot when step % N == 0."""
    copy_threads: int = 0
    """PITSTOP_SNAPSHOT_COPY_THREADS: threads copying a snapshot into shared memory;
    0: the writer's default. 1 suits small states of many tensors."""
    collective_timeout: float = 30.0
    """PITSTOP_COLLECTIVE_TIMEOUT seconds: the backstop for a collective whose peer
    hangs; one whose peer is gone or left is abandoned at once (`group.abandon`)."""
    reconfigure_timeout: float = 60.0
    """PITSTOP_RECONFIGURE_TIMEOUT seconds: how long a rank that lost a peer waits for a
    Reconfigure before it exits non-zero (and is restarted from the committed step)."""
    command_wait: float = 10.0
    """PITSTOP_COMMAND_WAIT seconds: how long the chief waits for every rank to hold its
    copy of a Pause or Stop before it makes all ranks act on it anyway."""
    integrity: IntegrityPolicy = field(default_factory=IntegrityPolicy)
    """The job's IntegrityPolicy: PITSTOP_SDC_CHECK and PITSTOP_SPIKE_WATCH (0 or 1),
    PITSTOP_LOSS_WINDOW, PITSTOP_SPIKE_SIGMA, PITSTOP_MAX_ROLLBACKS (the scheduler sets
    them from the job spec)."""
    skip_steps: frozenset[int] = frozenset()
    """PITSTOP_SKIP_STEPS ("17,40"): steps whose batch is skipped (the job's record of
    rolled-back batches, or a fault-free run told to skip the same ones)."""
    shape: Shape = field(default_factory=Shape)
    """dp x pp x tp and this rank's coordinates (PITSTOP_DP/PP/TP and their _RANK, as
    the agent sets them); without them, pure data parallel over WORLD_SIZE."""

    @property
    def timeout(self) -> timedelta:
        """The process group's timeout."""
        return timedelta(seconds=self.collective_timeout)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankConfig:
        """The config from `environ` (default: os.environ). Raises ConfigError naming
        the variable when one is set but unusable."""
        env = os.environ if environ is None else environ
        standby = env.get("PITSTOP_STANDBY", "") in ("1", "true", "yes")
        rank = _integer(env, "RANK", 0)
        world_size = _integer(env, "WORLD_SIZE", 1, low=1)
        if rank >= world_size:
            raise ConfigError(
                f"RANK={rank} is not below WORLD_SIZE={world_size}; "
                "give every rank a number from 0 to WORLD_SIZE-1"
            )
        visible = env.get("CUDA_VISIBLE_DEVICES", "")
        try:
            shape = Shape.from_env(env, rank, world_size)
        except ShapeError as exc:
            raise ConfigError(str(exc)) from exc
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=_integer(env, "LOCAL_RANK", 0),
            job_id=env.get("PITSTOP_JOB_ID", ""),
            generation=_integer(env, "PITSTOP_GENERATION", 0),
            node_id=env.get("PITSTOP_NODE_ID", ""),
            gpu_index=int(visible) if visible.isdecimal() else None,
            agent_socket=env.get("PITSTOP_AGENT_SOCKET", ""),
            checkpointd=env.get("PITSTOP_CHECKPOINTD", ""),
            scheduler=env.get("PITSTOP_SCHEDULER", ""),
            restore_step=_integer(env, "PITSTOP_RESTORE_STEP", 0),
            distributed="WORLD_SIZE" in env and not standby,
            standby=standby,
            snapshot_every=_integer(env, "PITSTOP_SNAPSHOT_EVERY", 1, low=0),
            copy_threads=_integer(env, "PITSTOP_SNAPSHOT_COPY_THREADS", 0),
            collective_timeout=_seconds(env, "PITSTOP_COLLECTIVE_TIMEOUT", 30.0),
            reconfigure_timeout=_seconds(env, "PITSTOP_RECONFIGURE_TIMEOUT", 60.0),
            command_wait=_seconds(env, "PITSTOP_COMMAND_WAIT", 10.0),
            integrity=IntegrityPolicy(
                sdc_check=_flag(env, "PITSTOP_SDC_CHECK", True),
                spike_watch=_flag(env, "PITSTOP_SPIKE_WATCH", True),
                loss_window=_integer(env, "PITSTOP_LOSS_WINDOW", 100, low=2),
                spike_sigma=_seconds(env, "PITSTOP_SPIKE_SIGMA", 5.0, what="number"),
                max_rollbacks=_integer(env, "PITSTOP_MAX_ROLLBACKS", 3, low=1),
            ),
            skip_steps=_steps(env, "PITSTOP_SKIP_STEPS"),
            shape=shape,
        )


def _integer(env: Mapping[str, str], name: str, default: int, low: int = 0) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    if not text.isdecimal() or int(text) < low:
        raise ConfigError(f"{name}={text!r} is not a whole number >= {low}; fix or unset it")
    return int(text)


def _seconds(
    env: Mapping[str, str], name: str, default: float, what: str = "number of seconds"
) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={text!r} is not a positive {what}; fix or unset it")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text not in ("0", "1", "true", "false"):
        raise ConfigError(f"{name}={text!r} is not 0 or 1; fix or unset it")
    return text in ("1", "true")


def _steps(env: Mapping[str, str], name: str) -> frozenset[int]:
    text = env.get(name, "")
    try:
        steps = skipped_from(text)
    except ValueError:
        steps = {-1}
    if any(step < 1 for step in steps):
        raise ConfigError(f"{name}={text!r} is not a list of steps like 17,40; fix or unset it")
    return frozenset(steps)
