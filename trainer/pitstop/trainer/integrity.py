"""The failures that do not crash, caught inside the ranks at every snapshot.

- Silent data corruption: data-parallel replicas hold bitwise the same state after every
  optimizer step (the whole product rests on determinism). At each snapshot step every
  rank hashes its state (xxh3 over the tensors' bytes, the RNG states left out) and the
  ranks exchange one small row each (`all_gather`, 40 bytes a rank). In a replica group
  (the ranks at the same pipeline and tensor coordinates) of three or more, the rank
  whose digest is not the majority's is named; with two (or a tie) every rank rolls
  back to the last checked snapshot and replays the steps since: the replay of a
  transient fault is clean, so the rank whose first result differs from its replay is
  the one named. A named rank's agent quarantines its node; all ranks drop the group
  and the job recovers on a spare from the last checked step (the step found bad is
  never snapshotted, so nothing newer is restorable).
- NaN/Inf and loss spikes: a loss (or gradient norm, when the script gives it) that is
  not finite on any rank, or a loss above the window's mean by `spike_sigma` standard
  deviations once the window is full, rolls every rank back to the last checked
  snapshot; the batch of the bad step is skipped from then on (`skip_batch`, the
  script's) and the step is run again on the next batch. `max_rollbacks` of them within
  the window asks the scheduler to pause the job.

Every rank takes the same decision from the same exchanged table, so no further
agreement is needed. The check needs a state that is replicated across data parallel
(no DTensor shards: FSDP shards differ by design); a sharded or single-replica job gets
the loss watch only.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from pitstop.trainer.mesh import Shape

log = logging.getLogger(__name__)

LOSS_WINDOW_KEY = "pitstop.loss_window"
SKIPPED_KEY = "pitstop.skipped_steps"
"""Snapshot metadata: the loss history a spike is judged against, and the steps whose
batch is skipped, so a rank that restores the snapshot decides as the others do."""

OK, NONFINITE, SPIKE, SDC, REPLAY, UNLOCATED = (
    "ok",
    "nonfinite",
    "spike",
    "sdc",
    "replay",
    "unlocated",
)


@dataclass(frozen=True)
class IntegrityPolicy:
    """The job's IntegrityPolicy as the rank reads it from its environment."""

    sdc_check: bool = True
    spike_watch: bool = True
    loss_window: int = 100
    spike_sigma: float = 5.0
    max_rollbacks: int = 3


@dataclass(frozen=True)
class Row:
    """What one rank contributes to a check."""

    digest: int = 0
    """xxh3_64 of its state (0: not compared)."""
    first: int = 0
    """In a replay: the digest the step had the first time (0 otherwise)."""
    loss: float = 0.0
    grad_norm: float = 0.0

    def encode(self) -> list[int]:
        pack = struct.Struct("<q")
        return [
            _signed(self.digest),
            _signed(self.first),
            pack.unpack(struct.pack("<d", self.loss))[0],
            pack.unpack(struct.pack("<d", self.grad_norm))[0],
        ]

    @classmethod
    def decode(cls, words: Sequence[int]) -> Row:
        def as_float(word: int) -> float:
            return float(struct.unpack("<d", struct.pack("<q", int(word)))[0])

        return cls(
            digest=int(words[0]) & (2**64 - 1),
            first=int(words[1]) & (2**64 - 1),
            loss=as_float(words[2]),
            grad_norm=as_float(words[3]),
        )


ROW_WORDS = 4


@dataclass(frozen=True)
class Verdict:
    """What the ranks do after a check."""

    kind: str
    ranks: tuple[int, ...] = ()
    """The ranks it names: the corrupt ones (sdc), those with a bad loss (nonfinite)."""
    expected: dict[int, int] = field(default_factory=dict)
    """For sdc: per named rank, the digest its replicas agreed on."""
    loss: float = 0.0
    """The job's loss at the step (the mean over ranks)."""
    detail: str = ""


def replica_groups(shape: Shape) -> list[list[int]]:
    """The ranks holding the same shard: one group per (pipeline, tensor) coordinate,
    its members across data parallel."""
    groups = []
    for pp_rank in range(shape.pp):
        for tp_rank in range(shape.tp):
            first = Shape(shape.dp, shape.pp, shape.tp, 0, pp_rank, tp_rank)
            groups.append([first.at(d).rank for d in range(shape.dp)])
    return groups


def judge(
    rows: Sequence[Row],
    groups: Iterable[Sequence[int]],
    window: Sequence[float],
    policy: IntegrityPolicy,
    *,
    replaying: bool = False,
) -> Verdict:
    """The verdict on one checked step from every rank's row (index = rank). `window`:
    the job's losses of the steps before (oldest first). `replaying`: this is the replay
    of a step whose replicas disagreed, each row carrying its first digest too."""
    loss = math.fsum(r.loss for r in rows) / max(len(rows), 1)
    bad = tuple(
        rank
        for rank, row in enumerate(rows)
        if not (math.isfinite(row.loss) and math.isfinite(row.grad_norm))
    )
    if bad:
        return Verdict(
            NONFINITE,
            bad,
            loss=loss,
            detail=f"loss or gradient norm not finite on ranks {list(bad)}",
        )
    if policy.spike_watch and len(window) >= policy.loss_window >= 2:
        mean = math.fsum(window) / len(window)
        deviation = math.sqrt(math.fsum((x - mean) ** 2 for x in window) / len(window))
        limit = mean + policy.spike_sigma * deviation
        if deviation > 0 and loss > limit:
            return Verdict(
                SPIKE,
                loss=loss,
                detail=(
                    f"loss {loss:.6g} above {limit:.6g}: the mean {mean:.6g} of the last "
                    f"{len(window)} steps + {policy.spike_sigma:g} x their deviation "
                    f"{deviation:.6g}"
                ),
            )
    if replaying:
        return _located_by_replay(rows, groups, loss)
    corrupt: list[int] = []
    expected: dict[int, int] = {}
    tied: list[list[int]] = []
    for members in groups:
        digests = [rows[r].digest for r in members if rows[r].digest]
        if len(digests) < 2 or len(set(digests)) == 1:
            continue
        counts = {d: digests.count(d) for d in set(digests)}
        majority, votes = max(counts.items(), key=lambda item: item[1])
        if votes * 2 > len(digests):
            odd = [r for r in members if rows[r].digest and rows[r].digest != majority]
            corrupt.extend(odd)
            expected.update(dict.fromkeys(odd, majority))
        else:
            tied.append(list(members))
    if tied:
        return Verdict(
            REPLAY,
            tuple(r for members in tied for r in members),
            loss=loss,
            detail=f"replicas {tied} disagree with no majority: replaying to tell which is wrong",
        )
    if corrupt:
        return Verdict(
            SDC,
            tuple(sorted(corrupt)),
            expected,
            loss,
            f"ranks {sorted(corrupt)} disagree with the majority of their replicas",
        )
    return Verdict(OK, loss=loss)


def _located_by_replay(
    rows: Sequence[Row], groups: Iterable[Sequence[int]], loss: float
) -> Verdict:
    """After a replay: the ranks whose first result differs from their replay, where
    the replicas' replays agree; unlocated otherwise."""
    corrupt: list[int] = []
    expected: dict[int, int] = {}
    for members in groups:
        replays = {rows[r].digest for r in members if rows[r].digest}
        if len(replays) > 1:
            return Verdict(
                UNLOCATED,
                tuple(members),
                loss=loss,
                detail=f"replicas {list(members)} disagree again on the replay",
            )
        for rank in members:
            row = rows[rank]
            if row.first and row.digest and row.first != row.digest:
                corrupt.append(rank)
                expected[rank] = row.digest
    if not corrupt:
        return Verdict(
            UNLOCATED,
            loss=loss,
            detail="the replay agrees with every rank's first result: no rank could be named",
        )
    return Verdict(
        SDC,
        tuple(sorted(corrupt)),
        expected,
        loss,
        f"ranks {sorted(corrupt)} computed a result their replay does not reproduce",
    )


def state_digest(tensors: Mapping[str, torch.Tensor]) -> int:
    """xxh3_64 over the bytes of every tensor but the RNG states, in name order; never 0
    (0 means "not compared")."""
    return Digester()(tensors)


class Digester:
    """`state_digest` for a training loop: the byte views of tensors that stay in place
    from step to step (parameters, optimizer state) are made once, so a step's digest
    costs the hashing, not 100+ tensor conversions (0.35 ms -> under 0.1 ms for the
    example's 125 tensors)."""

    def __init__(self) -> None:
        self._views: dict[str, tuple[tuple[int, int, torch.dtype], memoryview]] = {}
        self._order: tuple[list[str], list[str]] = ([], [])

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> int:
        names = list(tensors)
        if names != self._order[0]:
            self._order = (names, sorted(n for n in names if not n.startswith("rng.")))
        digest = xxhash.xxh3_64()
        views = self._views
        for name in self._order[1]:
            tensor = tensors[name]
            key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
            cached = views.get(name)
            if cached is not None and cached[0] == key and tensor.device.type == "cpu":
                digest.update(cached[1])
                continue
            view = _bytes_of(tensor)
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                views[name] = (key, view)  # the same memory next step: reuse the view
            digest.update(view)
        return digest.intdigest() or 1


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    flat = tensor.contiguous().reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def exchange(row: Row, world_size: int, device: torch.device) -> list[Row]:
    """Every rank's row (a collective: call it on every rank at the same step)."""
    mine = torch.tensor(row.encode(), dtype=torch.int64, device=device)
    if world_size == 1:
        return [row]
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, mine)
    return [Row.decode(t.tolist()) for t in gathered]


class LossWindow:
    """The job's loss at its last checked steps (at most `size`), by step: rolled back
    with the state, and carried in every snapshot so that a rank that restores one
    judges spikes as the others do."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._losses: deque[tuple[int, float]] = deque(maxlen=size)  # ascending steps

    def add(self, step: int, loss: float) -> None:
        self.rewind(step - 1)
        self._losses.append((step, loss))

    def values(self) -> list[float]:
        return [loss for _, loss in self._losses]

    def rewind(self, step: int) -> None:
        """Forget the losses of steps after `step` (the state went back to it)."""
        while self._losses and self._losses[-1][0] > step:
            self._losses.pop()

    def to_json(self) -> str:
        return json.dumps(list(self._losses))

    def load(self, text: str, step: int) -> None:
        """The window as a snapshot of `step` held it."""
        pairs = sorted((int(s), float(v)) for s, v in json.loads(text) if int(s) <= step)
        self._losses = deque(pairs[-self.size :], maxlen=self.size)


def skipped_from(text: str) -> set[int]:
    """Steps in a comma-separated list ("17,40"), or a snapshot's JSON list."""
    text = text.strip()
    if not text:
        return set()
    if text.startswith("["):
        return {int(s) for s in json.loads(text)}
    return {int(part) for part in text.split(",") if part.strip()}


def flip_a_bit(model: torch.nn.Module) -> str:
    """What a silently corrupting GPU does: one bit of the first floating parameter
    flipped (a mantissa bit of its first element). Returns the parameter's name."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if tensor.is_floating_point() and tensor.numel() and tensor.element_size() in ints:
            local: Any = getattr(tensor, "_local_tensor", tensor)
            with torch.no_grad():
                word = local.reshape(-1)[:1].view(ints[tensor.element_size()])
                word ^= 1 << (tensor.element_size() * 8 // 2 - 2)
            return name
    return ""


def poison(model: torch.nn.Module) -> None:
    """What a NaN gradient through the optimizer does: every parameter NaN."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                getattr(param, "_local_tensor", param).fill_(math.nan)


class SilentCorruption(RuntimeError):
    """A replica computed a wrong result: every rank drops the group and waits for the
    scheduler to move the corrupt rank's node out (a Reconfigure from the last checked
    step), as after a lost peer."""


def hang_here() -> None:
    """What a rank stuck outside any collective does (a deadlock in the data loader, a
    wait on a lock that never comes): block, for ever. Its stack names this function."""
    threading.Event().wait()


def _signed(value: int) -> int:
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value
