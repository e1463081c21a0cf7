"""A rank's state built from the script's builder and loaded from snapshots: straight
into the live tensors when the shape is the one it was taken on, resharded from the old
ranks' snapshots when the data-parallel size changed (a shrink; see reshard.py)."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import grpc
import torch

from pitstop.rankside.restoring import RestoredState, ShardUnavailable
from pitstop.trainer.context import RankContext
from pitstop.trainer.mesh import Shape
from pitstop.trainer.reshard import reshard
from pitstop.trainer.state import (
    DTENSOR_KEY,
    SHAPE_KEY,
    StateFormatError,
    TrainState,
    apply,
    capture,
    local_tensor,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

Builder = Callable[[], TrainState] | Callable[["DeviceMesh"], TrainState]
"""What builds a rank's state from scratch: with no argument, or on the job's mesh."""


def takes_mesh(builder: Builder) -> bool:
    """Whether `builder` takes the mesh (an argument)."""
    try:
        return bool(inspect.signature(builder).parameters)
    except (TypeError, ValueError):  # a builtin or C callable: called without the mesh
        return False


class Loader:
    """Builds the state from the builder given to `Session.restore` and loads steps into
    it. `restored(step, metadata)` hears of every load (the checks' `restored`)."""

    def __init__(
        self, context: RankContext, restored: Callable[[int, Mapping[str, str]], None]
    ) -> None:
        self._context = context
        self._restored_hook = restored
        self.default: Builder | None = None
        self._restored: tuple[float, str] | None = None  # when and whence, for the next step

    def take_restored(self) -> tuple[float, str] | None:
        """When and whence the state was last loaded, once: for the next step's report."""
        restored, self._restored = self._restored, None
        return restored

    @property
    def rebuilds(self) -> bool:
        """Whether the state is built on the mesh (see `Session.rebuilds`)."""
        return self.default is not None and takes_mesh(self.default)

    def build(self) -> TrainState:
        """A fresh state from the builder given to `restore` (on the mesh, if it takes it)."""
        if self.default is None:
            raise RuntimeError("call session.restore(default=...) before the loop")
        if takes_mesh(self.default):
            return self.default(self._context.mesh())  # type: ignore[call-arg]
        return self.default()  # type: ignore[call-arg]

    def load(self, state: TrainState, step: int, written: Shape | None = None) -> None:
        """Put the snapshot of `step` into `state` in place (see `Session.load`)."""
        context = self._context
        if context.writer is not None:
            context.writer.wait_copied()  # the last snapshot's copy reads these tensors
        if step == 0:
            apply(state, *capture(self.build()))
            self._restored_hook(0, {})
            return
        if context.writer is None:
            raise RuntimeError(
                f"rank {context.rank} must restore step {step} but knows no checkpoint daemon; "
                "set PITSTOP_CHECKPOINTD and PITSTOP_JOB_ID"
            )
        if written is None:
            # Straight into the live tensors (a DTensor's local shard), not via a copy.
            into = {f"model.{k}": local_tensor(v) for k, v in state.model.state_dict().items()}
            restored = self._restore(step, context.rank, into)
        else:
            restored = self._restore(step, written.rank, None)
        tensors, metadata = restored.tensors, restored.metadata
        if DTENSOR_KEY in metadata:
            taken = Shape.from_json(metadata[SHAPE_KEY]) if SHAPE_KEY in metadata else None
            if taken is not None and taken.sizes != context.shape.sizes:
                tensors, metadata = self._resharded(state, step, restored, taken, written)
        apply(state, tensors, metadata)
        self._restored_hook(step, metadata)
        log.info("rank %d restored step %d from %s", context.rank, step, restored.source)
        self._restored = (time.time(), restored.source)  # told with the next step

    def _restore(self, step: int, rank: int, into: dict[str, torch.Tensor] | None) -> RestoredState:
        context = self._context
        assert context.writer is not None
        try:
            return context.writer.restore(step, into=into, rank=rank)
        except grpc.RpcError as exc:
            raise RuntimeError(
                f"rank {context.rank}: restoring step {step} of job {context.config.job_id} "
                f"(rank {rank}'s snapshot) failed: {exc.code().name} {exc.details()}"
            ) from exc
        except ShardUnavailable as exc:
            raise RuntimeError(str(exc)) from exc

    def _resharded(
        self,
        state: TrainState,
        step: int,
        first: RestoredState,
        taken: Shape,
        written: Shape | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Step `step`, snapshotted on `taken`'s mesh, cut to this rank's shards now:
        read from every old rank at this rank's (pp, tp) coordinates. What is not
        sharded comes from `written`'s rank (this rank's old self), else from the old
        rank at this rank's coordinates."""
        shape = self._context.shape
        if (taken.pp, taken.tp) != (shape.pp, shape.tp):
            raise StateFormatError(
                f"step {step} was snapshotted on a dp x pp x tp = {taken.sizes} mesh and "
                f"rank {self._context.rank} is on {shape.sizes}: only dp may change (a shrink); "
                f"restore with pp = {taken.pp} and tp = {taken.tp}"
            )
        here = Shape(taken.dp, taken.pp, taken.tp, 0, shape.pp_rank, shape.tp_rank)
        ranks = [here.at(d).rank for d in range(taken.dp)]
        own = written.rank if written is not None else ranks[min(shape.dp_rank, taken.dp - 1)]
        read = {taken.rank: first}
        for rank in dict.fromkeys([*ranks, own]):
            if rank not in read:
                read[rank] = self._restore(step, rank, None)
        mine = read[own]
        resharded = reshard(
            state,
            (mine.tensors, mine.metadata),
            [(read[r].tensors, read[r].metadata) for r in ranks],
        )
        log.info(
            "rank %d: step %d resharded from dp=%d (ranks %s) to dp=%d",
            self._context.rank,
            step,
            taken.dp,
            ranks,
            shape.dp,
        )
        return resharded
