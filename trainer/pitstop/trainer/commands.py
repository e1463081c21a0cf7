"""Commands from the agent, and how all ranks come to act on one at the same boundary.

The agent relays every command of a job to every rank of the job on its node, each copy
with its own id to acknowledge. Each rank therefore keeps an `Inbox`: one thread reads
the rank's Commands stream (joined at `close`: closing the client cancels the stream).
The inbox only collects; nothing is acted on from that thread, with one exception: a
Reconfigure to a newer generation abandons the collective in flight (`group.abandon`),
so the ranks reach the boundary that acts on it at once.

Deciding is Determined's `_preempt` pattern: one decision, broadcast, acted on only at
a step boundary, then acknowledged. At every boundary each rank contributes, per kind
(stop, reconfigure, pause), 1 if it holds a copy; the chief (rank 0) adds `world_size`
more once its own copy has waited `command_wait` seconds. One small SUM all_reduce
then gives every rank the same verdict: act on a kind when the sum reaches world_size,
i.e. when every rank holds its copy (so each acknowledges its own id), or when the chief
says so (so a rank whose agent lags cannot hold the job up). A rank that acts without
its copy acknowledges the copy when it arrives. Reconfigure is never forced: a rank
needs its own copy to learn the new rank map. While paused the process group is idle,
so each rank waits on its own inbox for Resume, Stop or Reconfigure.

`agree` is the only collective this module makes: one int32 tensor of three elements
per step. Off-cluster there is no inbox and no collective at all.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist

import pitstop.trainer.group as group
from pitstop.rankside.rankclient import RankControlClient
from pitstop.v1 import rank_pb2

log = logging.getLogger(__name__)

STOP, RECONFIGURE, PAUSE, RESUME = "stop", "reconfigure", "pause", "resume"
AGREED_KINDS = (STOP, RECONFIGURE, PAUSE)
"""Kinds the ranks agree on, in the order they win when several are due at once."""
_FORCEABLE = frozenset({STOP, PAUSE})
Flops = tuple[float, float]
Restored = tuple[float, str]
"""When (epoch seconds) and from where a rank loaded its restore step."""
"""A step's (model FLOPs, the accelerator's peak FLOP/s); zeros when not stated."""
_RETRY_FIRST, _RETRY_MAX = 0.2, 5.0


@dataclass
class Pending:
    """A command copy this rank holds, with when it arrived (monotonic seconds)."""

    command: rank_pb2.RankCommand
    kind: str
    arrived: float


class Inbox:
    """The rank's commands as they arrive, read by one joinable thread.

    If the stream breaks, the thread reopens it with backoff for up to `agent_lost_after`
    seconds; after that (or when the agent ends the stream) `broken` says why.
    """

    def __init__(self, client: RankControlClient, agent_lost_after: float = 30.0) -> None:
        self._client = client
        self._agent_lost_after = agent_lost_after
        self._pending: list[Pending] = []
        self._owed: dict[str, list[int]] = {}
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self.broken = ""
        self._threads: list[threading.Thread] = []
        self.watch(client.rank)

    def watch(self, rank: int) -> None:
        """Read the Commands stream of `rank` (again, after a Reconfigure renumbered us)."""
        # Joined by `join`; daemon only so that a script that dies without closing its
        # session still exits (the stream would otherwise hold the process).
        thread = threading.Thread(
            target=self._read, args=(rank,), name=f"pitstop-commands-{rank}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _read(self, rank: int) -> None:
        failing_since: float | None = None
        delay = _RETRY_FIRST
        while not self._closed.is_set() and self._client.rank == rank:
            try:
                for command in self._client.commands():
                    failing_since, delay = None, _RETRY_FIRST
                    self._arrived(command)
                self._break(f"the agent ended the command stream of rank {rank}")
                return
            except grpc.RpcError as exc:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self._agent_lost_after:
                    self._break(f"command stream of rank {rank} lost: {exc.code().name}")
                    return
                log.warning("command stream broke (%s); reopening", exc.code().name)
                self._closed.wait(delay)  # wakes at once on close
                delay = min(delay * 2, _RETRY_MAX)

    def _arrived(self, command: rank_pb2.RankCommand) -> None:
        kind = command.WhichOneof("body") or ""
        if kind == RECONFIGURE:
            log.info("Reconfigure to generation %d arrived", command.reconfigure.generation)
            # A newer generation means the current one is over: end the collective in
            # flight now (a peer may be gone), not at the next boundary or its timeout.
            group.abandon(older_than=command.reconfigure.generation)
        with self._changed:
            owed = self._owed.get(kind, [])
            acted_at = owed.pop(0) if owed else None
            if acted_at is None:
                self._pending.append(Pending(command, kind, time.monotonic()))
            self._changed.notify_all()
        if acted_at is not None:  # the ranks already acted on it at the chief's word
            self.acknowledge(command, ok=True, step=acted_at)

    def _break(self, reason: str) -> None:
        if self._closed.is_set():
            return
        log.warning("%s: commands can no longer reach this rank", reason)
        with self._changed:
            self.broken = reason
            self._changed.notify_all()

    def holds(self, kind: str) -> Pending | None:
        """The oldest copy of `kind` held, if any."""
        with self._changed:
            return next((p for p in self._pending if p.kind == kind), None)

    def newest_generation(self) -> int:
        """The newest generation among the Reconfigure copies held (0: none), left in
        place."""
        with self._changed:
            return max(
                (p.command.reconfigure.generation for p in self._pending if p.kind == RECONFIGURE),
                default=0,
            )

    def take(self, kind: str, step: int) -> rank_pb2.RankCommand | None:
        """Remove and return the oldest copy of `kind`; without one, the next copy to
        arrive is acknowledged on arrival as acted on at `step`."""
        with self._changed:
            for pending in self._pending:
                if pending.kind == kind:
                    self._pending.remove(pending)
                    return pending.command
            self._owed.setdefault(kind, []).append(step)
            return None

    def wait_for(self, kinds: tuple[str, ...], timeout: float | None) -> Pending | None:
        """The oldest copy of any of `kinds`, removed; None after `timeout` seconds or
        once the stream is broken. Wakes on arrival: no polling."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                for pending in self._pending:
                    if pending.kind in kinds:
                        self._pending.remove(pending)
                        return pending
                left = None if deadline is None else deadline - time.monotonic()
                if self.broken or (left is not None and left <= 0):
                    return None
                self._changed.wait(left)

    def drain(self, kind: str) -> list[rank_pb2.RankCommand]:
        """Remove every copy of `kind`."""
        with self._changed:
            taken = [p.command for p in self._pending if p.kind == kind]
            self._pending = [p for p in self._pending if p.kind != kind]
            return taken

    def acknowledge(
        self, command: rank_pb2.RankCommand, ok: bool, step: int, error: str = ""
    ) -> None:
        """Acknowledge `command`; a failure to reach the agent is logged, not raised."""
        try:
            self._client.acknowledge(command.command_id, ok=ok, error=error, step=step)
        except grpc.RpcError as exc:
            log.warning("ack of command %d failed: %s", command.command_id, exc.code().name)

    def close(self) -> None:
        """Stop reading (the caller closes the client, which ends the streams) and join."""
        self._closed.set()
        with self._changed:
            self._changed.notify_all()

    def join(self, timeout: float = 10.0) -> None:
        """Join the reading threads (after the client is closed)."""
        for thread in self._threads:
            thread.join(timeout)


def flags(inbox: Inbox, is_chief: bool, world_size: int, command_wait: float) -> list[int]:
    """This rank's contribution to `agree`, per kind of AGREED_KINDS."""
    now = time.monotonic()
    contribution = []
    for kind in AGREED_KINDS:
        pending = inbox.holds(kind)
        value = 0 if pending is None else 1
        if pending is not None and kind == RECONFIGURE:
            # A Reconfigure is the scheduler's decision, not a request: any rank holding
            # one makes every rank act on it at this boundary. A rank whose copy has not
            # come waits for it there; one left out (its agent hung, say) never gets
            # one and is simply not in the new group.
            value += world_size
        elif (
            pending is not None
            and is_chief
            and kind in _FORCEABLE
            and now - pending.arrived >= command_wait
        ):
            value += world_size
        contribution.append(value)
    return contribution


def agree(
    contribution: list[int], world_size: int, device: torch.device | None = None
) -> str | None:
    """The kind every rank acts on at this boundary, or None. With world_size > 1 this
    is a collective: every rank must call it at the same boundary."""
    sums = contribution
    if world_size > 1:
        tensor = torch.tensor(contribution, dtype=torch.int32, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        sums = [int(v) for v in tensor.tolist()]
    for kind, total in zip(AGREED_KINDS, sums, strict=True):
        if total >= world_size:
            return kind
    return None


class StepReporter:
    """Sends step reports to the agent from one joinable thread, so a slow agent never
    lengthens a step. Reports queue up (bounded); a full queue drops the newest."""

    def __init__(self, report: Callable[..., bool], max_queued: int = 1024) -> None:
        self._report = report
        self._queue: queue.Queue[
            tuple[
                int,
                float,
                float | torch.Tensor,
                int,
                Flops,
                Restored | None,
                float | torch.Tensor | None,
            ]
            | None
        ]
        self._queue = queue.Queue(max_queued)
        self._failures = 0
        self._thread = threading.Thread(target=self._send, name="pitstop-steps", daemon=True)
        self._thread.start()

    def put(
        self,
        step: int,
        seconds: float,
        loss: float | torch.Tensor,
        tokens: int,
        flops: Flops = (0.0, 0.0),
        restored: Restored | None = None,
        grad_norm: float | torch.Tensor | None = None,
    ) -> None:
        """Queue one finished step; `restored`: on the first step after a restore, when
        and from where the rank loaded it; `flops`: its (model FLOPs, the accelerator's peak
        FLOP/s), zeros when not stated. A tensor loss is read on the reporting thread, so
        a GPU loss does not make the training thread wait for the device."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.detach()
        try:
            self._queue.put_nowait((step, seconds, loss, tokens, flops, restored, grad_norm))
        except queue.Full:
            log.debug("step report queue full: step %d not reported", step)

    def _send(self) -> None:
        while (item := self._queue.get()) is not None:
            step, seconds, loss, tokens, (model_flops, peak_flops), restored, norm = item
            restored_at, restored_from = restored or (0.0, "")
            try:
                self._report(
                    step,
                    seconds,
                    loss=float(loss),
                    tokens=tokens,
                    model_flops=model_flops,
                    peak_flops=peak_flops,
                    restored_at=restored_at,
                    restored_from=restored_from,
                    grad_norm=0.0 if norm is None else float(norm),
                )
                self._failures = 0
            except grpc.RpcError as exc:
                self._failures += 1
                if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                    log.warning(
                        "step %d not reported to the agent (%d failures in a row): %s",
                        step,
                        self._failures,
                        exc.code().name,
                    )

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop and join."""
        self._queue.put(None)
        self._thread.join(timeout)
