"""One session's checks for the failures that do not crash (see integrity.py for what
they find and how): run at each snapshot step, before the snapshot, so a step found bad
is never snapshotted; a bad step is rolled back, a corrupt replica ends in a recovery."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from pitstop.trainer.context import RankContext
from pitstop.trainer.integrity import (
    LOSS_WINDOW_KEY,
    NONFINITE,
    OK,
    REPLAY,
    SDC,
    SKIPPED_KEY,
    SPIKE,
    UNLOCATED,
    Digester,
    IntegrityPolicy,
    LossWindow,
    Row,
    SilentCorruption,
    Verdict,
    exchange,
    flip_a_bit,
    hang_here,
    judge,
    poison,
    replica_groups,
    skipped_from,
)
from pitstop.trainer.mesh import Shape
from pitstop.trainer.state import DTENSOR_KEY, TrainState
from pitstop.v1 import agent_pb2, rank_pb2

log = logging.getLogger(__name__)

_FINDING_KINDS = {
    NONFINITE: agent_pb2.FINDING_KIND_NONFINITE,
    SPIKE: agent_pb2.FINDING_KIND_SPIKE,
    SDC: agent_pb2.FINDING_KIND_SDC,
    UNLOCATED: agent_pb2.FINDING_KIND_SDC_UNLOCATED,
}


class Checker:
    """One session's checks: run at each snapshot step, before the snapshot, so a step
    found bad is never snapshotted."""

    def __init__(
        self,
        context: RankContext,
        policy: IntegrityPolicy,
        skipped: Iterable[int],
        *,
        waiting: Callable[[], AbstractContextManager[None]],
        load: Callable[[TrainState, int], None],
    ) -> None:
        self._context = context
        self._waiting = waiting
        """Wraps the exchange: the session's `waiting` (the step clock's)."""
        self._load = load
        """Puts a snapshotted step into the state: how a rollback goes back."""
        self.policy = policy
        self.skipped = set(skipped)
        """Steps whose batch is skipped: each time such a step is about to run, the
        script's `skip_batch` moves its data past one batch first."""
        self.skip_batch: Callable[[TrainState], object] | None = None
        self.window = LossWindow(policy.loss_window)
        self.verified = 0
        """The newest step checked good and snapshotted: where a rollback goes."""
        self._replay: tuple[int, int] | None = None  # (step, its first digest)
        self._rollbacks: list[int] = []  # steps that rolled back, for the pause
        self._digest = Digester()
        self._groups: tuple[Shape | None, list[list[int]]] = (None, [])
        self._said_why_not = False

    def restored(self, step: int, metadata: Mapping[str, str]) -> None:
        """The state went back to (or was loaded at) `step`."""
        self.verified = step
        self._replay = None
        if step == 0:
            self.window.rewind(0)
        elif LOSS_WINDOW_KEY in metadata:
            self.window.load(metadata[LOSS_WINDOW_KEY], step)
        else:
            self.window.rewind(step)
        if SKIPPED_KEY in metadata:
            self.skipped |= skipped_from(metadata[SKIPPED_KEY])

    def metadata(self) -> dict[str, str]:
        """What every snapshot carries for the checks."""
        return {
            LOSS_WINDOW_KEY: self.window.to_json(),
            SKIPPED_KEY: json.dumps(sorted(self.skipped)),
        }

    def before_step(self, state: TrainState) -> None:
        """Skip the batch of the step about to run when it is one to skip."""
        step = state.step + 1
        if step in self.skipped and self.skip_batch is not None:
            self.skip_batch(state)
            log.info("rank %d: step %d skips its batch", self._context.rank, step)

    def carry_out(self, fault: int, state: TrainState, loss: Any) -> Any:
        """Do what an injected rank fault stands for; returns the step's loss."""
        rank = self._context.rank
        if fault == rank_pb2.RANK_FAULT_SDC:
            name = flip_a_bit(state.model)
            log.warning(
                "rank %d: injected SDC: one bit of %s flipped at step %d", rank, name, state.step
            )
        elif fault == rank_pb2.RANK_FAULT_NAN:
            poison(state.model)
            log.warning("rank %d: injected NaN at step %d", rank, state.step)
            return math.nan
        elif fault == rank_pb2.RANK_FAULT_HANG:
            log.warning("rank %d: injected hang at step %d", rank, state.step)
            hang_here()
        return loss

    def check(
        self,
        state: TrainState,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str],
        loss: float,
        grad_norm: float | None,
    ) -> bool:
        """Judge step `state.step` with every other rank; True when it is good (snapshot
        it). A bad step is rolled back (False) or, for a corrupt replica, raises
        SilentCorruption."""
        context, step = self._context, state.step
        digest = self._digest(tensors) if self._compares(metadata) else 0
        replaying = self._replay is not None and self._replay[0] == step
        first = self._replay[1] if self._replay is not None and replaying else 0
        norm = 0.0 if grad_norm is None else float(grad_norm)
        with self._waiting():
            rows = exchange(
                Row(digest, first, float(loss), norm), context.world_size, context.device
            )
        if self._groups[0] is not context.shape:  # worked out once per generation
            self._groups = (context.shape, replica_groups(context.shape))
        groups = self._groups[1]
        verdict = judge(rows, groups, self.window.values(), self.policy, replaying=replaying)
        if verdict.kind == OK:
            self.window.add(step, verdict.loss)
            return True  # `verified` moves once the snapshot is saved (Session.commit)
        log.warning("rank %d: step %d: %s: %s", context.rank, step, verdict.kind, verdict.detail)
        self._replay = None
        if verdict.kind == SDC:
            if context.rank in verdict.ranks:
                self._report(
                    verdict,
                    step,
                    digest=f"{first or digest:016x}",
                    expected=f"{verdict.expected.get(context.rank, 0):016x}",
                    ranks=next((g for g in groups if context.rank in g), []),
                )
            raise SilentCorruption(f"step {step}: {verdict.detail}")
        if verdict.kind == REPLAY:
            self._roll_back(state)  # which forgets any replay: this one starts after it
            self._replay = (step, digest)
            return False
        skipped = 0
        pause = False
        if verdict.kind in (NONFINITE, SPIKE):
            if self.skip_batch is not None:
                self.skipped.add(step)
                skipped = step
            recent = step - self.policy.loss_window
            self._rollbacks = [s for s in self._rollbacks if s > recent] + [step]
            pause = len(self._rollbacks) >= self.policy.max_rollbacks
        else:  # UNLOCATED: nobody to move out; a person decides
            pause = True
        self._roll_back(state)
        if context.is_chief:
            self._report(verdict, step, skipped=skipped, pause=pause, ranks=verdict.ranks)
        return False

    def _compares(self, metadata: Mapping[str, str]) -> bool:
        context = self._context
        why = ""
        if not self.policy.sdc_check:
            return False
        if context.shape.dp < 2:
            why = "one data-parallel replica: nothing to compare"
        elif DTENSOR_KEY in metadata:
            why = "the state is sharded (DTensor): replicas do not hold the same bytes"
        if why and not self._said_why_not:
            log.warning("rank %d: no SDC check by replica agreement: %s", context.rank, why)
            self._said_why_not = True
        return not why

    def _roll_back(self, state: TrainState) -> None:
        step = self.verified
        self._load(state, step)  # which calls `restored`
        log.warning("rank %d: rolled back to step %d", self._context.rank, step)

    def _report(
        self,
        verdict: Verdict,
        step: int,
        *,
        skipped: int = 0,
        pause: bool = False,
        digest: str = "",
        expected: str = "",
        ranks: Iterable[int] = (),
    ) -> None:
        control = self._context.control
        if control is None:
            return
        finding = agent_pb2.IntegrityFinding(
            kind=_FINDING_KINDS[verdict.kind],
            step=step,
            rolled_back_to=self.verified,
            skipped_step=skipped,
            digest=digest,
            expected_digest=expected,
            ranks=list(ranks),
            detail=verdict.detail,
            pause=pause,
        )
        try:
            control.report_finding(finding)
        except Exception as exc:  # grpc.RpcError: the finding is logged; training goes on
            log.warning(
                "rank %d: the finding was not reported to the agent: %s", self._context.rank, exc
            )
