"""What one agent stream remembers, and what the commands sent down it mean."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass, field

from pitstop.scheduler.services import node_commands as node_command_service
from pitstop.v1 import agent_pb2, common_pb2


@dataclass
class StreamState:
    """What one open stream remembers, so unchanged heartbeats cost no database write."""

    node_id: str
    seq: int
    probe_address: str = ""
    """Where the node's host is asked whether it is up when the stream ends (its
    checkpoint daemon's address, as registered)."""
    registered_at: dt.datetime | None = None
    """The registration this stream made (the node's `last_seen_at` it wrote): when its
    end is judged, a node registered again since (another stream, here or at another
    scheduler process) is not lost."""
    verdict: int = common_pb2.HEALTH_VERDICT_UNSPECIFIED
    reasons: tuple[str, ...] = ()
    # Commands sent down this stream and not yet acknowledged: id -> what an ack means.
    commands: dict[int, SentCommand | None] = field(default_factory=dict)
    ended_check_at: float = 0.0
    # The last heartbeat's health as sent (its bytes), and as kept in Redis (JSON text,
    # with the jobs whose standby waits): a health that did not change is not checked
    # or converted again (ingest reads thousands of heartbeats in a recovery's burst).
    health_sent: tuple[bytes, tuple[str, ...]] | None = None
    health_json: str = "{}"
    # When this process last read a message of the stream (time.monotonic(); a stalled
    # judge moves it on), and the wall time it did (the node's last sign of life).
    last_seen: float = field(default_factory=time.monotonic)
    heard_at: float = field(default_factory=time.time)
    # The stale-process check in flight: it reads PostgreSQL, so it runs beside the
    # stream's reader, never in its way (the next heartbeat must not wait for a pool).
    stale_check: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class SentCommand:
    """A job command whose acknowledgement is recorded (node_commands)."""

    job_id: str
    generation: int
    actions: tuple[node_command_service.NodeAction, ...]


def tracked(message: agent_pb2.SchedulerMessage) -> SentCommand | None:
    """What an acknowledgement of this command records, if anything."""
    kind = message.WhichOneof("body")
    if kind == "start_ranks" and not message.start_ranks.standby_gpus:
        start = message.start_ranks
        return SentCommand(
            start.job_id, start.generation, node_command_service.actions_of(kind, False)
        )
    if kind == "reconfigure":
        new = message.reconfigure
        actions = node_command_service.actions_of(kind, bool(new.adopted_ranks))
        return SentCommand(new.job_id, new.generation, actions)
    if kind == "reconfigure_kept":
        kept = message.reconfigure_kept
        actions = node_command_service.actions_of("reconfigure", False)
        return SentCommand(kept.job_id, kept.generation, actions)
    return None


@dataclass(frozen=True)
class Beats:
    """What agents are told about heartbeats, and the deadline that follows (seconds)."""

    interval: float
    """How often an agent looks at its node and flushes step times."""
    refresh: float
    """The longest an agent goes without a heartbeat."""
    liveness_timeout: float
    """No heartbeat for this long: the liveness scan declares the node LOST."""
    steps: float = 0.0
    """How often an agent reports step summaries (0: every interval)."""
