"""The data cursor: the next global step to train, the only data state a snapshot needs.

A replica's loader position (how far into its own shard it has read) is exact only at
the dp it was saved at. The cursor is global instead: the next step s, from which the
epoch (s // steps_per_epoch) and the place in it follow (`SampleOrder`). Any dp resumes
from it, since which samples a step consumes does not depend on dp.

Its state dict is plain ints, so it rides in every snapshot's metadata. It also records
the three numbers that fix what a step means (samples, global_batch, seed): a resume
under a different dataset size, batch or seed would silently read other samples, so
`load_state_dict` refuses it. microbatch_size is not among them: changing it regroups a
step's samples for gradient accumulation but keeps the step's samples and their order.
"""

from __future__ import annotations

from pitstop.data.order import SampleOrder

# The fields of the state dict that must match the order it is loaded into.
_SCHEDULE_FIELDS = ("samples", "global_batch", "seed")


class Cursor:
    """The next global step to consume under `order`, starting at `step` (default 0)."""

    def __init__(self, order: SampleOrder, step: int = 0) -> None:
        self.order = order
        self._step = 0
        self.step = step

    @property
    def step(self) -> int:
        """The next global step to train (steps count from 0)."""
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r}: must be an integer >= 0 (steps count from 0)")
        self._step = step

    @property
    def epoch(self) -> int:
        """The epoch the next step falls in."""
        return self._step // self.order.steps_per_epoch

    @property
    def step_in_epoch(self) -> int:
        """The next step's place in its epoch, 0..steps_per_epoch-1."""
        return self._step % self.order.steps_per_epoch

    def advance(self, steps: int = 1) -> None:
        """Move past `steps` steps (one trained, or a skipped bad batch)."""
        self.step = self._step + steps

    def state_dict(self) -> dict[str, int]:
        """Plain ints: the step, where it falls (epoch, step_in_epoch, for a person
        reading a snapshot) and the schedule that gives the step its meaning."""
        return {
            "step": self._step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "samples": self.order.samples,
            "global_batch": self.order.global_batch,
            "seed": self.order.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from `state` (a `state_dict`, taken at any dp). Raises ValueError when it
        was taken under another schedule or does not add up."""
        missing = [key for key in ("step", *_SCHEDULE_FIELDS) if key not in state]
        if missing:
            raise ValueError(
                f"cursor state {state!r}: lacks {', '.join(missing)}; pass a dict that "
                f"Cursor.state_dict returned"
            )
        for key in _SCHEDULE_FIELDS:
            if state[key] != getattr(self.order, key):
                raise ValueError(
                    f"cursor state {key} {state[key]!r}: this order has {key} "
                    f"{getattr(self.order, key)!r}, so its steps are other samples; resume "
                    f"with the {key} the cursor was saved under"
                )
        step = state["step"]
        expected = divmod(step, self.order.steps_per_epoch)
        recorded = (state.get("epoch", expected[0]), state.get("step_in_epoch", expected[1]))
        if recorded != expected:
            raise ValueError(
                f"cursor state epoch {recorded[0]!r}, step_in_epoch {recorded[1]!r}: step "
                f"{step} is epoch {expected[0]}, step_in_epoch {expected[1]}; the state was "
                f"edited or corrupted, take it from Cursor.state_dict"
            )
        self.step = step
