"""A torchdata node over a replica's microbatches, its state the global data cursor.

`ReplicaNode` yields `Microbatch` after microbatch, step after step, so it can be the
root of a `torchdata.nodes.Loader`, whose `state_dict()`/`load_state_dict()` then save
and restore the cursor. Its state is the cursor's plain ints plus two: the position in
the replica's share of the step (0 at a step boundary) and the dp it was taken at. A
state taken at a step boundary resumes at any dp; one taken mid-step only at its own dp,
since another dp splits the step differently.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from pitstop.data.cursor import Cursor
from pitstop.data.replica import Microbatch, ReplicaBatches


class ReplicaNode(BaseNode[Microbatch]):  # type: ignore[misc]  # torchdata is untyped
    """`batches`' microbatches from global step `start_step` until `end_step` (never,
    when None). `reset(None)` goes back to `start_step`."""

    def __init__(
        self, batches: ReplicaBatches, start_step: int = 0, end_step: int | None = None
    ) -> None:
        super().__init__()
        self.batches = batches
        self.start_step = start_step
        self.end_step = end_step
        self.cursor = Cursor(batches.order, start_step)
        self._position = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Go to `initial_state` (from `get_state`/`state_dict`) or to `start_step`."""
        super().reset(initial_state)
        if initial_state is None:
            self.cursor.step = self.start_step
            self._position = 0
            return
        position = initial_state.get("position", 0)
        saved_dp = initial_state.get("dp", self.batches.dp)
        if position and saved_dp != self.batches.dp:
            raise ValueError(
                f"data state position {position}: taken mid-step at dp {saved_dp}, loaded at "
                f"dp {self.batches.dp}; a dp change resumes only from a state taken at a "
                f"step boundary (position 0)"
            )
        if not 0 <= position < len(self.batches.share):
            raise ValueError(
                f"data state position {position!r}: must be in 0..{len(self.batches.share) - 1}"
            )
        self.cursor.load_state_dict(initial_state)
        self._position = position

    def next(self) -> Microbatch:
        """The next microbatch; StopIteration at `end_step`."""
        if self.end_step is not None and self.cursor.step >= self.end_step:
            raise StopIteration
        microbatch = self.batches.microbatch(self.cursor.step, self._position)
        self._position += 1
        if microbatch.last:
            self.cursor.advance()
            self._position = 0
        return microbatch

    def get_state(self) -> dict[str, int]:
        """The cursor's state, the position in the step and the dp."""
        return {**self.cursor.state_dict(), "position": self._position, "dp": self.batches.dp}
