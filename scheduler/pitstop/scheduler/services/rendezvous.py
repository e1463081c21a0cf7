"""torchrun rendezvous state: opaque bytes per record under compare-and-set tokens.

This is the storage half of torch's ``RendezvousBackend`` contract. The scheduler never
looks inside the state; the trainer's backend owns its encoding.

*Keys.* The request's ``run_id`` names one record of one rendezvous: ``<id>`` is torch's
state of rendezvous ``<id>`` (torchrun's ``--rdzv-id``), ``<id>/<record>`` another record
of it, one of :data:`RECORDS` (``c10d-store``: the address of the c10d store its agents
share). A rendezvous id never contains ``/``, so every key belongs to exactly one
rendezvous: no id can name, or share a prefix path into, another's records. Anything else
is refused with INVALID_ARGUMENT.

*Tokens* name one version of one record: ``<version>.<binding>``, where the version is
the row's counter (the first store makes it 1, each successful compare-and-set adds one)
and the binding a digest of the key. A token, once seen, never matches again, and a token
of one record can never match another's: one issued for another key is refused with
INVALID_ARGUMENT (the caller mixed up its rendezvous); any other token that is not the
current one (stale, unknown, or of the bare-counter form an earlier scheduler issued) is
answered, as torch's contract wants, with the current version and nothing stored. The
binding is not a secret: any caller with the agent role may read any record. It keeps
one rendezvous' token from ever passing for another's.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.jobspec import check_text

MAX_RUN_ID = 253  # the key column's width, record suffix included
RECORD_SEPARATOR = "/"
RECORDS = frozenset({"c10d-store"})
# torch pickles its whole rendezvous state on every set: about 85 bytes a node, so
# 12,500 nodes are ~1.1 MB. 3 MiB leaves headroom and stays under gRPC's 4 MiB default
# message limit.
MAX_STATE_BYTES = 3 << 20
FIRST_TOKEN = 1
_TOKEN_RE = re.compile(r"(?P<version>[0-9]{1,19})\.(?P<binding>[0-9a-f]{32})")


@dataclass(frozen=True)
class StoredState:
    """A version of a record and the token that names it."""

    state: bytes
    token: str


@dataclass(frozen=True)
class SetOutcome:
    """What a compare-and-set left behind: the stored version (None when nothing is
    stored) and whether it is the caller's."""

    current: StoredState | None
    stored: bool


def check_run_id(run_id: str) -> None:
    """Raise InvalidArgument unless ``run_id`` is a record key: ``<id>`` or
    ``<id>/<record>`` (see the module docstring)."""
    if not run_id:
        raise InvalidArgument("run_id", run_id, "give the rendezvous id (torchrun's --rdzv-id)")
    check_text("run_id", run_id, max_len=MAX_RUN_ID)
    rendezvous, separator, record = run_id.partition(RECORD_SEPARATOR)
    if not separator:
        return
    records = ", ".join(sorted(RECORDS))
    if not rendezvous:
        raise InvalidArgument(
            "run_id",
            run_id,
            f"give the rendezvous id before {RECORD_SEPARATOR!r}, as in <id>/{records}",
        )
    if record not in RECORDS:
        raise InvalidArgument(
            "run_id",
            run_id,
            f"{RECORD_SEPARATOR!r} separates a rendezvous id from one of its records "
            f"({records}), so a rendezvous id cannot contain it: start torchrun with a "
            f"--rdzv-id without {RECORD_SEPARATOR!r} (e.g. '-' in its place)",
        )


def _binding(run_id: str) -> str:
    return hashlib.blake2b(run_id.encode(), digest_size=16, person=b"pitstop-rdzv").hexdigest()


def issue_token(run_id: str, version: int) -> str:
    """The token of ``version`` of the record ``run_id``."""
    return f"{version}.{_binding(run_id)}"


def check_token(run_id: str, token: str) -> None:
    """Raise InvalidArgument if ``token`` was issued for another record than ``run_id``.
    Tokens of no record (unknown shapes, an earlier scheduler's bare counters) pass: they
    are merely not current."""
    issued = _TOKEN_RE.fullmatch(token)
    if issued is not None and issued["binding"] != _binding(run_id):
        raise InvalidArgument(
            "token",
            token,
            f"it was issued for another rendezvous record, not {run_id!r}; pass the token "
            f"GetState or SetState returned for {run_id!r} (empty if you have seen none)",
        )


async def get_state(session: AsyncSession, run_id: str) -> StoredState | None:
    """The stored state of ``run_id`` and its token, or None when none is stored."""
    check_run_id(run_id)
    row = await session.get(models.RendezvousState, run_id)
    return None if row is None else StoredState(row.state, issue_token(run_id, row.token))


async def set_state(session: AsyncSession, run_id: str, state: bytes, token: str) -> SetOutcome:
    """Store ``state`` if ``token`` names the stored version; an empty ``token`` stores
    only when nothing is stored yet. A token of another record raises InvalidArgument;
    any other token (stale, malformed) stores nothing and returns the current version."""
    check_run_id(run_id)
    check_token(run_id, token)
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
            return SetOutcome(StoredState(state, issue_token(run_id, created)), stored=True)
        return SetOutcome(await get_state(session, run_id), stored=False)
    # The row lock makes compare and set one step against concurrent writers.
    row = await session.scalar(
        select(models.RendezvousState)
        .where(models.RendezvousState.run_id == run_id)
        .with_for_update()
    )
    if row is None:
        return SetOutcome(None, stored=False)
    if token != issue_token(run_id, row.token):
        return SetOutcome(StoredState(row.state, issue_token(run_id, row.token)), stored=False)
    row.state = state
    row.token += 1
    await session.flush()
    return SetOutcome(StoredState(row.state, issue_token(run_id, row.token)), stored=True)
