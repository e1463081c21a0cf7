"""One data-parallel replica's microbatches, step after step, with its shards fetched ahead.

`ReplicaBatches` joins the order (which samples: `SampleOrder`) to the reader (their
tokens: `SampleReader`) for replica `replica` of `dp`. At the start of each step it asks
the reader to prefetch the shards of its own microbatches of that step and the next
`prefetch_steps` steps, and of no other replica's: a rank copies only what it will read.
After a dp change, build a new ReplicaBatches on the same reader and order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pitstop.data.order import SampleOrder
from pitstop.data.reader import SampleReader


@dataclass(frozen=True)
class Microbatch:
    """One microbatch of a replica's share of global step `step`.

    `index`: its place among the step's M microbatches (0..M-1), the same at any dp.
    `samples`: its sample ids. `x`, `y`: int64 [microbatch_size, context] inputs and
    targets. `last`: whether it is the replica's last microbatch of the step (take the
    optimizer step after it)."""

    step: int
    index: int
    samples: tuple[int, ...]
    x: torch.Tensor
    y: torch.Tensor
    last: bool


class ReplicaBatches:
    """Replica `replica` of `dp`'s microbatches of any step, read through `reader`."""

    def __init__(
        self,
        order: SampleOrder,
        reader: SampleReader,
        dp: int,
        replica: int,
        prefetch_steps: int = 2,
    ) -> None:
        if order.samples != reader.windows.samples:
            raise ValueError(
                f"order samples {order.samples}: the reader's shards hold "
                f"{reader.windows.samples} windows of {reader.windows.span} tokens; build the "
                f"order with samples=windows.samples"
            )
        if isinstance(prefetch_steps, bool) or prefetch_steps < 0:
            raise ValueError(f"prefetch_steps {prefetch_steps!r}: must be an integer >= 0")
        self.order = order
        self.reader = reader
        self.dp = dp
        self.replica = replica
        self.prefetch_steps = prefetch_steps
        # Validates dp and replica, and is the same list at every step.
        self.share = order.replica_microbatches(dp, replica)

    def samples(self, step: int) -> list[int]:
        """The sample ids this replica reads at `step`, microbatch after microbatch."""
        return [
            sample
            for microbatch in self.share
            for sample in self.order.microbatch_samples(step, microbatch)
        ]

    def prefetch(self, step: int) -> None:
        """Start copying the shards of this replica's samples of steps `step` to
        `step` + prefetch_steps, nearest first."""
        wanted: list[int] = []
        for ahead in range(step, step + self.prefetch_steps + 1):
            wanted.extend(s for s in self.reader.shards_of(self.samples(ahead)) if s not in wanted)
        self.reader.prefetch(wanted)

    def microbatch(self, step: int, position: int) -> Microbatch:
        """The `position`-th microbatch of this replica's share of `step` (0-based). At
        position 0 the step's and the next steps' shards are prefetched."""
        if not 0 <= position < len(self.share):
            raise ValueError(
                f"position {position}: replica {self.replica} of dp {self.dp} has "
                f"{len(self.share)} microbatches per step (0..{len(self.share) - 1})"
            )
        if position == 0:
            self.prefetch(step)
        index = self.share[position]
        samples = self.order.microbatch_samples(step, index)
        x, y = self.reader.read(samples)
        return Microbatch(step, index, tuple(samples), x, y, position == len(self.share) - 1)

    def microbatches(self, step: int) -> Iterator[Microbatch]:
        """This replica's microbatches of `step`, in order."""
        for position in range(len(self.share)):
            yield self.microbatch(step, position)
