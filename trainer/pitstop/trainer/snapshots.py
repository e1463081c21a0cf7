"""A rank's snapshots into its node's checkpoint daemon: captured, tagged with the
checks' metadata and the mesh shape they were taken on, written through the rank's
SnapshotWriter. Training outlives the daemon: a snapshot that is not saved costs a log
line and a count (`failures`), never the run, and the next one tries again."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping

import grpc
import torch

from pitstop.rankside.writer import SnapshotResult
from pitstop.trainer.checks import Checker
from pitstop.trainer.context import RankContext
from pitstop.trainer.mesh import Shape
from pitstop.trainer.state import SHAPE_KEY, Capturer, TrainState

log = logging.getLogger(__name__)

SHAPES_KEPT = 256
"""Snapshotted steps whose shape a session remembers (a restore goes back a few)."""


class Snapshots:
    """Takes one rank's snapshots and keeps count of those not saved."""

    def __init__(self, context: RankContext, checks: Checker) -> None:
        self._context = context
        self._checks = checks
        self.capture = Capturer()
        """The state's tensors and metadata, as a snapshot takes them."""
        self.last: SnapshotResult | None = None
        """The last snapshot saved."""
        self._shapes: dict[int, Shape] = {}
        self._shape_json: tuple[Shape | None, str] = (None, "")
        self._failed = 0
        self._failing_since = 0  # failures in a row, for the log
        self._waiting: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        """Optimizers whose step waits for the copy."""

    @property
    def failures(self) -> int:
        """Snapshots due that were not saved (see `Session.snapshot_failures`)."""
        writer = self._context.writer
        lost = writer.lost_seals if writer is not None else 0
        return self._failed + lost

    def shape_at(self, step: int) -> Shape | None:
        """The shape this process snapshotted `step` in, when it did."""
        return self._shapes.get(step)

    def take(
        self,
        state: TrainState,
        captured: tuple[Mapping[str, torch.Tensor], dict[str, str]] | None = None,
    ) -> bool:
        """Snapshot `state` now (see `Session.snapshot`); False when it was not saved."""
        context = self._context
        if context.writer is None:
            return False
        tensors, metadata = captured if captured is not None else self.capture(state)
        metadata.update(self._checks.metadata())
        if self._shape_json[0] is not context.shape:  # worked out once per generation
            self._shape_json = (context.shape, context.shape.to_json())
        metadata[SHAPE_KEY] = self._shape_json[1]
        self._shapes[state.step] = context.shape
        if len(self._shapes) > SHAPES_KEPT:  # the first kept is the oldest
            del self._shapes[next(iter(self._shapes))]
        behind = self.capture.behind if self._hooked(state.optimizer) else frozenset()
        try:
            # The parameters and the optimizer's state are copied while the next step's
            # forward and backward run; the optimizer's step waits for the copy.
            result = context.writer.snapshot(state.step, tensors, metadata, behind=behind)
        except Exception as exc:  # the daemon's trouble must never end the run
            if isinstance(exc, grpc.RpcError):
                return self._not_saved(state.step, f"{exc.code().name} {exc.details()}")
            return self._not_saved(state.step, f"{type(exc).__name__}: {exc}")
        if result.skipped:
            return self._not_saved(state.step, f"skipped: {result.skipped}")
        if self._failing_since:
            log.info(
                "rank %d: snapshots work again at step %d after %d failed in a row",
                context.rank,
                state.step,
                self._failing_since,
            )
            self._failing_since = 0
        self.last = result
        return True

    def _hooked(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether `optimizer.step()` waits for the last snapshot's copy (a pre-hook,
        registered once per optimizer: a rebuilt state brings a new one)."""
        if optimizer is None:
            return False
        if optimizer not in self._waiting:
            optimizer.register_step_pre_hook(self.wait_copied)
            self._waiting.add(optimizer)
        return True

    def wait_copied(self, *_: object) -> None:
        """Block until the last snapshot's copy is done: the state may change from then
        on (the optimizer's step, a load into it, a fault injected into it)."""
        writer = self._context.writer
        if writer is not None:
            writer.wait_copied()

    def _not_saved(self, step: int, why: str) -> bool:
        self._failed += 1
        self._failing_since += 1
        # Every failure is counted; the log says the first of a run of them, then every
        # tenth and hundredth, so a daemon down for hours does not flood it.
        if self._failing_since in (1, 10) or self._failing_since % 100 == 0:
            log.warning(
                "rank %d: snapshot of step %d not saved (%d in a row, %d in all), "
                "training goes on: %s",
                self._context.rank,
                step,
                self._failing_since,
                self.failures,
                why,
            )
        return False
