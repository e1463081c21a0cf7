"""What a rank does at a step boundary: agree with the other ranks on the command due
(see commands.py), then carry it out: stop, reconfigure, or pause until told to go on.

While paused the process group is idle, so each rank waits on its own inbox, without
polling, for Resume, Stop or Reconfigure. A Reconfigure ends the pause: the new
generation runs. A rank that loses its agent while paused exits non-zero.
"""

from __future__ import annotations

import logging

import pitstop.trainer.group as group
from pitstop.trainer.commands import PAUSE, RECONFIGURE, RESUME, STOP, Inbox, agree, flags
from pitstop.trainer.context import RankContext
from pitstop.trainer.recovery import Recovery
from pitstop.trainer.state import TrainState

log = logging.getLogger(__name__)


def at_boundary(context: RankContext, recovery: Recovery, state: TrainState) -> bool:
    """Agree on and carry out the command due at this boundary; True when the state
    or the group changed."""
    inbox = context.inbox
    if inbox is None:
        return False
    if inbox.holds(PAUSE) is None:
        for stale in inbox.drain(RESUME):  # not paused: nothing to resume
            inbox.acknowledge(stale, ok=True, step=state.step)
    contribution = flags(inbox, context.is_chief, context.world_size, context.config.command_wait)
    try:
        kind = agree(contribution, context.world_size, context.device)
    except Exception as exc:
        if not group.is_peer_loss(exc):
            raise
        recovery.after_peer_loss(state, exc)
        return True
    if kind == STOP:
        context.stop(state, inbox.take(STOP, state.step))
    elif kind == RECONFIGURE:
        command = inbox.take(RECONFIGURE, state.step)
        if command is None:  # another rank's copy came first: wait here for this one's
            recovery.after_peer_loss(
                state, RuntimeError("the other ranks act on a Reconfigure not yet here")
            )
        else:
            recovery.reconfigure(state, command, cut_short=False)
    elif kind == PAUSE:
        _pause(context, recovery, state, inbox)
    return kind is not None


def _pause(context: RankContext, recovery: Recovery, state: TrainState, inbox: Inbox) -> None:
    command = inbox.take(PAUSE, state.step)
    if command is not None:
        inbox.acknowledge(command, ok=True, step=state.step)
    log.info("rank %d paused after step %d", context.rank, state.step)
    while True:
        pending = inbox.wait_for((RESUME, STOP, RECONFIGURE), timeout=None)
        if pending is None:
            raise RuntimeError(
                f"rank {context.rank} paused at step {state.step} and {inbox.broken}; "
                "exiting so that the scheduler restarts it"
            )
        if pending.kind == RESUME:
            inbox.acknowledge(pending.command, ok=True, step=state.step)
            log.info("rank %d resumed at step %d", context.rank, state.step)
            return
        if pending.kind == STOP:
            context.stop(state, pending.command)
            return
        # A Reconfigure ends the pause: the new generation runs.
        if recovery.reconfigure(state, pending.command, cut_short=False):
            return
