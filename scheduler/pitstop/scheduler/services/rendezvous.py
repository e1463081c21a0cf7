"""torchrun rendezvous state: opaque bytes per run id under compare-and-set tokens.

This is the storage half of torch's ``RendezvousBackend`` contract. A token is the
decimal form of the row's version counter: the first store makes it 1 and every
successful compare-and-set adds one, so a token, once seen, never matches again. The
scheduler never looks inside the state; the trainer's backend owns its encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.jobspec import check_text

MAX_RUN_ID = 253
# torch pickles its whole rendezvous state on every set: about 85 bytes a node, so
# 12,500 nodes are ~1.1 MB. 3 MiB leaves headroom and stays under gRPC's 4 MiB default
# message limit.
MAX_STATE_BYTES = 3 << 20
FIRST_TOKEN = 1


@dataclass(frozen=True)
class StoredState:
    """A version of a run's state and the token that names it."""

    state: bytes
    token: str


@dataclass(frozen=True)
class SetOutcome:
    """What a compare-and-set left behind: the stored version (None when nothing is
    stored) and whether it is the caller's."""

    current: StoredState | None
    stored: bool


def check_run_id(run_id: str) -> None:
    """Raise InvalidArgument unless ``run_id`` is a usable rendezvous key."""
    if not run_id:
        raise InvalidArgument("run_id", run_id, "give the rendezvous id (torchrun's --rdzv-id)")
    check_text("run_id", run_id, max_len=MAX_RUN_ID)


async def get_state(session: AsyncSession, run_id: str) -> StoredState | None:
    """The stored state of ``run_id`` and its token, or None when none is stored."""
    check_run_id(run_id)
    row = await session.get(models.RendezvousState, run_id)
    return None if row is None else StoredState(row.state, str(row.token))


async def set_state(session: AsyncSession, run_id: str, state: bytes, token: str) -> SetOutcome:
    """Store ``state`` if ``token`` names the stored version; an empty ``token`` stores
    only when nothing is stored yet. Any other token (stale, malformed, from another
    run) stores nothing and returns the current version."""
    check_run_id(run_id)
    if len(state) > MAX_STATE_BYTES:
        raise InvalidArgument(
            "state",
            len(state),
            f"must be at most {MAX_STATE_BYTES} bytes (torch's state grows by about 85 "
            "bytes a node); run fewer nodes in one torchrun rendezvous",
        )
    if not token:
        # ON CONFLICT instead of read-then-insert: two first writers race on the primary
        # key, and the loser must see the winner's row rather than an integrity error.
        created = await session.scalar(
            insert(models.RendezvousState)
            .values(run_id=run_id, state=state, token=FIRST_TOKEN)
            .on_conflict_do_nothing(index_elements=[models.RendezvousState.run_id])
            .returning(models.RendezvousState.token)
        )
        if created is not None:
            return SetOutcome(StoredState(state, str(created)), stored=True)
        return SetOutcome(await get_state(session, run_id), stored=False)
    # The row lock makes compare and set one step against concurrent writers.
    row = await session.scalar(
        select(models.RendezvousState)
        .where(models.RendezvousState.run_id == run_id)
        .with_for_update()
    )
    if row is None:
        return SetOutcome(None, stored=False)
    if token != str(row.token):
        return SetOutcome(StoredState(row.state, str(row.token)), stored=False)
    row.state = state
    row.token += 1
    await session.flush()
    return SetOutcome(StoredState(row.state, str(row.token)), stored=True)
