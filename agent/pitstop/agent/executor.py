"""The scheduler's commands, carried out on this node and acknowledged.

Every command the link receives runs as a task of its own and ends in exactly one
CommandAck: ok, or the error in words. Commands of one job run in arrival order (a stop
before the next start); other jobs and node-wide commands do not wait behind a slow
stop. The scheduler re-sends a command until its ack arrives, so a command that moves a
job's ranks to a generation (`_generation_command`) is done once: a repeat, or one of an
older generation, is acked without being done again.

To add a command kind: write a handler `async def _<kind>(self, message) -> str` that
returns "" when done or the error in words (the scheduler logs it: name the thing, the
value and what to do), and add one entry to the table in `CommandExecutor.__init__`,
keyed by the name of the SchedulerMessage oneof field. The ack, the commands metric and
the ordering come with the table (a body with a `job_id` field waits behind that job's
earlier commands). Only a command that moves a job's ranks to a generation needs more:
name it in `_generation_command` too, so that a re-sent copy is not carried out twice.
A kind missing from the table is acked with an error that asks for an agent upgrade.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable

from pitstop.agent import stacks
from pitstop.agent.config import AgentSettings
from pitstop.agent.gpu import GpuBackend
from pitstop.agent.gpu.base import FaultNotSupported
from pitstop.agent.handover import StandbyHandover
from pitstop.agent.metrics import AgentMetrics
from pitstop.agent.rankports import RankChannel, RankSupervision
from pitstop.v1 import agent_pb2, common_pb2, rank_pb2

__all__ = ["CommandExecutor", "CommandHandler"]

log = logging.getLogger(__name__)

CommandHandler = Callable[[agent_pb2.SchedulerMessage], Awaitable[str]]
"""Carries out one command kind; returns "" when done, or the error in words."""


def _generation_command(message: agent_pb2.SchedulerMessage, kind: str) -> tuple[int, str] | None:
    """(generation, what) of a command that moves a job's ranks to a generation; None
    for any other command (standbys, stops, pauses, node-wide commands)."""
    if kind == "start_ranks" and not message.start_ranks.standby_gpus:
        return message.start_ranks.generation, "start"
    if kind == "reconfigure":
        adopting = bool(message.reconfigure.adopted_ranks)
        return message.reconfigure.generation, "adopt" if adopting else "reconfigure"
    if kind == "reconfigure_kept":
        return message.reconfigure_kept.generation, "reconfigure"
    return None


class CommandExecutor:
    """Carries out the scheduler's commands and sends an ack for each through `send`
    (the link's outbox). `beat_soon` asks for a heartbeat at once."""

    def __init__(
        self,
        settings: AgentSettings,
        backend: GpuBackend,
        supervisor: RankSupervision,
        local: RankChannel,
        metrics: AgentMetrics,
        *,
        send: Callable[..., None],
        beat_soon: Callable[[], None],
        heartbeat: Callable[[], Awaitable[agent_pb2.Heartbeat]] | None = None,
        inject: Callable[[common_pb2.Fault], None] | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._inject = inject or backend.inject_fault
        """Carries out a drill: the node's FaultInjector (GPU and host faults)."""
        self._supervisor = supervisor
        self._local = local
        self._metrics = metrics
        self._send = send
        self._beat_soon = beat_soon
        self._heartbeat = heartbeat
        """The node's heartbeat now, sent with the ack of a generation command (so a
        recovery costs one message per node, not an ack and then a heartbeat)."""
        # The dispatch table: SchedulerMessage oneof field -> its handler.
        self._handlers: dict[str, CommandHandler] = {
            "start_ranks": self._start_ranks,
            "stop_ranks": self._stop_ranks,
            "reconfigure": self._reconfigure,
            "reconfigure_kept": self._reconfigure_kept,
            "pause": self._pause,
            "resume": self._resume,
            "drain": self._drain,
            "inject_fault": self._inject_fault,
            "dump_stacks": self._dump_stacks,
        }
        self._tasks: set[asyncio.Task[None]] = set()
        self._job_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # Per job, the (generation, command) pairs carried out, and the newest generation:
        # the scheduler re-sends a command until its ack arrives, and a repeat (or a
        # command of an older generation) must change nothing.
        self._carried_out: defaultdict[str, set[tuple[int, str]]] = defaultdict(set)
        self._newest: defaultdict[str, int] = defaultdict(int)
        self._rank_command_ids = itertools.count(1)
        # Per job, this node's ranks (assignments) as its last generation command placed
        # them: what a reconfigure_kept keeps.
        self._placed: dict[str, list[common_pb2.RankAssignment]] = {}
        self._handover = StandbyHandover(settings.node_id, supervisor, local)

    @property
    def kinds(self) -> frozenset[str]:
        """The command kinds (SchedulerMessage oneof fields) this agent carries out."""
        return frozenset(self._handlers)

    @property
    def in_flight(self) -> list[asyncio.Task[None]]:
        """The commands being carried out now, as tasks (the link cancels them at stop)."""
        return list(self._tasks)

    def submit(self, message: agent_pb2.SchedulerMessage) -> None:
        """Carry out `message` in a task of its own, then ack it."""
        kind = message.WhichOneof("body")
        task = asyncio.create_task(self._carry_out(message, kind or "empty"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _carry_out(self, message: agent_pb2.SchedulerMessage, kind: str) -> None:
        job_id = getattr(getattr(message, kind), "job_id", "") if kind != "empty" else ""
        lock = self._job_locks[job_id] if job_id else contextlib.nullcontext()
        key: tuple[int, str] | None = None
        async with lock:
            try:
                key = _generation_command(message, kind)
                if key is not None and self._already(job_id, key, message.command_id):
                    error = ""
                else:
                    error = await self._command(message, kind)
                    if key is not None and not error:
                        self._carried_out[job_id].add(key)
                        self._newest[job_id] = max(self._newest[job_id], key[0])
            except Exception as exc:
                log.exception("command %d (%s) failed", message.command_id, kind)
                error = (
                    f"{kind} failed on node {self._settings.node_id}: {type(exc).__name__}: {exc}"
                )
        if error:
            log.warning("command %d (%s) not carried out: %s", message.command_id, kind, error)
        ack = agent_pb2.CommandAck(command_id=message.command_id, ok=not error, error=error)
        if key is not None and self._heartbeat is not None:
            try:
                ack.heartbeat.CopyFrom(await self._heartbeat())
            except Exception:  # the ack goes without: the next look sends the heartbeat
                log.exception("command %d: no heartbeat for its ack", message.command_id)
        self._send(ack=ack)
        result = "error" if error else "ok"
        self._metrics.commands.labels(self._settings.node_id, kind, result).inc()

    def _already(self, job_id: str, key: tuple[int, str], command_id: int) -> bool:
        """True for a command to skip: carried out before, or of an older generation."""
        generation, what = key
        if key in self._carried_out[job_id]:
            log.debug("command %d: %s of generation %d repeated", command_id, what, generation)
            return True
        if generation < self._newest[job_id]:
            log.info(
                "command %d: %s of job %s generation %d ignored: generation %d runs here",
                command_id,
                what,
                job_id,
                generation,
                self._newest[job_id],
            )
            return True
        return False

    async def _command(self, message: agent_pb2.SchedulerMessage, kind: str) -> str:
        """Carry out one command; the error in words, or "" when done."""
        handler = self._handlers.get(kind)
        if handler is None:
            node_id = self._settings.node_id
            return f"command {kind!r} is unknown to the agent on node {node_id}; upgrade the agent"
        return await handler(message)

    # The handlers, one per entry of the table

    async def _start_ranks(self, message: agent_pb2.SchedulerMessage) -> str:
        start = message.start_ranks
        if start.standby_gpus:
            gpus = await self._supervisor.start_standbys(start)
            log.info("job %s: standby processes on GPUs %s", start.job_id, gpus)
            self._beat_soon()  # the heartbeat lists them: the scheduler sees them at once
            return ""
        # Before the start, so a rank that attaches at once sees its generation.
        self._local.set_generation(
            start.job_id, start.generation, start.restore_step, start.step_windows
        )
        started = await self._supervisor.start_ranks(start)
        log.info("job %s generation %d: started ranks %s", start.job_id, start.generation, started)
        self._place(start.job_id, start.rank_map)
        return ""

    async def _stop_ranks(self, message: agent_pb2.SchedulerMessage) -> str:
        if message.stop_ranks.at_boundary:
            # The ranks agree on a boundary, seal their snapshot and exit; the supervisor
            # waits for that before it signals what is left.
            stop = rank_pb2.RankCommand(stop=message.stop_ranks)
            missed = await self._relay(message.stop_ranks.job_id, stop)
            if missed:
                log.warning("%s", missed)
        stopped = await self._supervisor.stop_ranks(message.stop_ranks)
        if not message.stop_ranks.ranks:  # the job's every rank here: nothing to keep
            self._placed.pop(message.stop_ranks.job_id, None)
        log.info(
            "job %s: stopped ranks %s (%s)",
            message.stop_ranks.job_id,
            stopped,
            message.stop_ranks.reason or "no reason given",
        )
        return ""

    async def _reconfigure(self, message: agent_pb2.SchedulerMessage) -> str:
        new = message.reconfigure
        self._local.set_generation(new.job_id, new.generation, new.restore_step, new.step_windows)
        adopted, taken = await self._handover.hand_over(new)
        # The ranks taken over (or started afresh) here join the new generation on their
        # own; those already running here are told.
        relayed = await self._relay(new.job_id, rank_pb2.RankCommand(reconfigure=new), skip=taken)
        log.info(
            "job %s generation %d: reconfigured (ranks taken over here: %s)",
            new.job_id,
            new.generation,
            sorted(taken) or "none",
        )
        moved = self._supervisor.renumber(new.job_id, new.rank_map)
        if moved:
            log.info("job %s: ranks renumbered %s", new.job_id, moved)
        self._place(new.job_id, new.rank_map)
        return "; ".join(error for error in (adopted, relayed) if error)

    async def _reconfigure_kept(self, message: agent_pb2.SchedulerMessage) -> str:
        """A new generation in which this node keeps its ranks: the Reconfigure the
        node would get, with its ranks as they were placed here."""
        kept = message.reconfigure_kept
        placed = self._placed.get(kept.job_id)
        if not placed:
            return (
                f"job {kept.job_id}: node {self._settings.node_id} has no ranks of it placed "
                "to keep (its agent restarted?); send it the full Reconfigure"
            )
        full = agent_pb2.Reconfigure()
        full.CopyFrom(kept)
        full.rank_map.ranks.extend(placed)
        full.rank_map.node_local = True
        return await self._reconfigure(
            agent_pb2.SchedulerMessage(command_id=message.command_id, reconfigure=full)
        )

    def _place(self, job_id: str, rank_map: common_pb2.RankMap) -> None:
        node_id = self._settings.node_id
        self._placed[job_id] = [a for a in rank_map.ranks if a.node_id == node_id]

    async def _pause(self, message: agent_pb2.SchedulerMessage) -> str:
        return await self._relay(message.pause.job_id, rank_pb2.RankCommand(pause=message.pause))

    async def _resume(self, message: agent_pb2.SchedulerMessage) -> str:
        resume = rank_pb2.RankCommand(resume=message.resume)
        return await self._relay(message.resume.job_id, resume)

    async def _drain(self, message: agent_pb2.SchedulerMessage) -> str:
        node_id = self._settings.node_id
        log.warning("node %s is draining: %s", node_id, message.drain.reason or "no reason given")
        self._metrics.drains.labels(node_id).inc()
        return ""

    async def _inject_fault(self, message: agent_pb2.SchedulerMessage) -> str:
        if not self._settings.allow_fault_injection:
            return (
                f"fault injection is disabled on node {self._settings.node_id}; "
                "set allow_fault_injection: true in its agent config to allow drills"
            )
        try:
            await asyncio.to_thread(self._inject, message.inject_fault)
        except (ValueError, FaultNotSupported) as exc:
            return f"node {self._settings.node_id}: {exc}"
        log.warning("injected fault: %s", message.inject_fault)
        self._beat_soon()  # an extra heartbeat now, so the fault is seen at once
        return ""

    async def _dump_stacks(self, message: agent_pb2.SchedulerMessage) -> str:
        """Take every stack of the job's ranks here, all at once, and send each."""
        asked = message.dump_stacks
        ranks = [
            r
            for r in self._supervisor.running()
            if r.job_id == asked.job_id and not r.standby and r.generation == asked.generation
        ]

        async def one(rank: agent_pb2.RunningRank) -> None:
            path = self._supervisor.log_path(rank.job_id, rank.rank)
            taken = await asyncio.to_thread(stacks.take, rank.pid, path)
            if taken.error:
                log.warning("stacks of rank %d of job %s: %s", rank.rank, rank.job_id, taken.error)
            self._send(
                stacks=agent_pb2.RankStacks(
                    job_id=asked.job_id,
                    generation=asked.generation,
                    rank=rank.rank,
                    incident=asked.incident,
                    method=taken.method,
                    text=taken.text,
                    error=taken.error,
                )
            )

        await asyncio.gather(*(one(rank) for rank in ranks))
        log.warning(
            "job %s hangs (incident %d): sent the stacks of ranks %s",
            asked.job_id,
            asked.incident,
            [r.rank for r in ranks],
        )
        return ""

    # What the handlers share

    async def _relay(
        self, job_id: str, command: rank_pb2.RankCommand, skip: set[int] | None = None
    ) -> str:
        """Queue `command` for every rank of the job running here (but those in `skip`).
        Done when queued: the ranks act on it at their next step boundary."""
        ranks = [
            r.rank
            for r in self._supervisor.running()
            if r.job_id == job_id and not r.standby and r.rank not in (skip or set())
        ]
        missed = []
        for rank in ranks:
            # Each rank acks its copy by id, so every copy gets an id of its own.
            copy = rank_pb2.RankCommand(command_id=next(self._rank_command_ids))
            copy.MergeFrom(command)
            if not await self._local.send_command(job_id, rank, copy):
                missed.append(rank)
        if missed:
            return (
                f"job {job_id}: ranks {missed} on node {self._settings.node_id} "
                "have no open command stream; they may have exited"
            )
        return ""
