"""`Session`: what a training script holds to obey the pitstop agent.

    with Session.from_env() as session:
        state = session.restore(default=make_state)
        session.set_flops(model_flops_per_token=6 * parameters, peak_flops=989e12)  # MFU
        session.record_data(manifest_sha256, source="s3://bucket/manifest.json")  # record
        for step in session.steps(state, until=total_steps):
            with session.guard():              # a lost peer: roll back, not crash
                loss = train_step(state)       # collectives inside session.waiting()
                session.commit(state, loss=loss)

A step's reported time (what straggler detection compares across ranks) is its wall
time less the time spent in `session.waiting()`: in synchronous training every rank
leaves a collective together, so only the work before it tells a slow GPU apart. On a
simulated slow GPU (the agent's slow multiplier above 1) the session stretches that work
by the multiplier, as the slow GPU would, before each collective and at commit.

Off-cluster (no PITSTOP_AGENT_SOCKET) the session does nothing but run the loop and,
when RANK/WORLD_SIZE are set (torchrun), form the process group; with PITSTOP_CHECKPOINTD
and PITSTOP_JOB_ID it also snapshots and restores. On-cluster it attaches to the agent,
reports every step from a background thread, snapshots every PITSTOP_SNAPSHOT_EVERY
steps into the node's checkpointd (the copy is the only stall) and obeys commands at
step boundaries only (see commands.py for how all ranks pick the same boundary).

Training outlives its checkpoint daemon: whatever goes wrong on the snapshot path (the
daemon down, refusing, restarted, its memory removed) costs a log line and a count in
`snapshot_failures`, never the run, and the next snapshot tries again. A restore whose
daemon is gone pulls the state from another node that holds it (the catalog's holders,
the buddy; see SnapshotWriter.restore).

Recovery, both paths bitwise identical because both continue from the same snapshot:
- restart: the scheduler starts a new generation with PITSTOP_RESTORE_STEP; `restore`
  loads that step from checkpointd.
- in-process: a collective fails because a peer died (`guard` catches it; the gloo/NCCL
  timeout bounds the wait), or a Reconfigure is agreed at a boundary. The rank drops its
  process group, waits (bounded) for its Reconfigure, rolls back to the restore step
  from its local snapshot when it is ahead or its step was cut short, re-forms the group
  at the new rendezvous address, acknowledges and goes on. No Reconfigure in time: it
  raises PeerLostError, exits non-zero and is restarted from the committed step.
- standby (PITSTOP_STANDBY=1): a process that already imported torch and the script
  blocks in `restore` until the agent hands it a lost rank, loads that rank's shard
  and joins the new group.
"""

from __future__ import annotations

import ctypes
import faulthandler
import inspect
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
import torch

from pitstop.rankside.rankclient import FORK_SERVER_PID_ENV, RankControlClient
from pitstop.rankside.restoring import RestoredState, ShardUnavailable
from pitstop.rankside.writer import SnapshotResult, SnapshotWriter
from pitstop.trainer import group
from pitstop.trainer.boundary import at_boundary
from pitstop.trainer.commands import Inbox, StepReporter
from pitstop.trainer.config import RankConfig
from pitstop.trainer.integrity import Checker, SilentCorruption
from pitstop.trainer.mesh import Shape, build_mesh
from pitstop.trainer.recovery import Recovery
from pitstop.trainer.reshard import reshard
from pitstop.trainer.runrecord import RunRecorder, checked_text
from pitstop.trainer.state import (
    DTENSOR_KEY,
    SHAPE_KEY,
    Capturer,
    StateFormatError,
    TrainState,
    apply,
    capture,
    local_tensor,
)
from pitstop.v1 import rank_pb2

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

SHAPES_KEPT = 256
"""Snapshotted steps whose shape a session remembers (a restore goes back a few)."""

Builder = Callable[[], TrainState] | Callable[["DeviceMesh"], TrainState]
"""What builds a rank's state from scratch: with no argument, or on the job's mesh."""


def _takes_mesh(builder: Builder) -> bool:
    try:
        return bool(inspect.signature(builder).parameters)
    except (TypeError, ValueError):  # a builtin or C callable: called without the mesh
        return False


class Session:
    """One rank's link to the agent, its checkpoint daemon and its process group."""

    def __init__(
        self,
        config: RankConfig,
        control: RankControlClient | None = None,
        writer: SnapshotWriter | None = None,
        *,
        model_flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
    ) -> None:
        self.config = config
        self.rank, self.world_size = config.rank, config.world_size
        self.generation = config.generation
        self.restore_step = config.restore_step
        self.device = torch.device("cpu")
        self.control = control
        self.writer = writer
        self.inbox: Inbox | None = None
        self._reporter: StepReporter | None = None
        self.recovery = Recovery(self)
        """In-place recoveries; `recovery.recoveries` records each one's timings."""
        self.checks = Checker(self, config.integrity, config.skip_steps)
        """The checks for silent data corruption and bad losses (see integrity.py)."""
        self.shape = config.shape
        """dp x pp x tp and this rank's coordinates; a Reconfigure brings the new ones."""
        self._mesh: DeviceMesh | None = None
        self._mesh_generation = -1
        self._default: Builder | None = None
        self._pending_step: int | None = None
        self._started = 0.0
        self._mark = 0.0  # end of the last waiting() or the step's start
        self._waited = 0.0  # seconds of this step spent in waiting()
        self._last_wall = 0.0  # seconds the last committed step took, waits included
        self._aborted: BaseException | None = None
        self.finished = False
        """The loop ran to `until`."""
        self.stopped = False
        """A Stop (or a Reconfigure without this rank) ended the loop early."""
        self.last_snapshot: SnapshotResult | None = None
        self._capture = Capturer()
        self._snapshot_shapes: dict[int, Shape] = {}
        self._shape_json: tuple[Shape | None, str] = (None, "")
        self._failed_snapshots = 0
        self._failing_since = 0  # failures in a row, for the log
        self._restored: tuple[float, str] | None = None  # when and whence, for the next step
        self.model_flops_per_token = 0.0
        """Model FLOPs per token (forward and backward), reported with every step; 0: not
        stated. With `peak_flops`, the scheduler exports the job's MFU."""
        self.peak_flops = 0.0
        """Peak FLOP/s of this rank's accelerator at the training precision; 0: unknown."""
        self.set_flops(model_flops_per_token=model_flops_per_token, peak_flops=peak_flops)
        self._run_record = RunRecorder(look_now=config.rank == 0 and control is not None)

    @classmethod
    def from_env(cls, *, model_flops_per_token: float = 0.0, peak_flops: float = 0.0) -> Session:
        """The session for this process: attached to the agent when PITSTOP_AGENT_SOCKET
        is set, a do-nothing session otherwise. `model_flops_per_token` and `peak_flops`:
        see `set_flops` (both optional)."""
        flops = _checked_flops(model_flops_per_token, peak_flops)  # before attaching
        config = RankConfig.from_env()
        if config.agent_socket:
            _die_with_the_agent()
            # The agent's fallback when py-spy cannot attach: every thread's stack into
            # this rank's log on SIGUSR1 (pitstop.agent.stacks).
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        control: RankControlClient | None = None
        checkpointd = config.checkpointd
        if config.agent_socket and config.standby:
            control = RankControlClient(config.agent_socket, config.job_id, 0)
        elif config.agent_socket:
            control = RankControlClient(config.agent_socket, config.job_id, config.rank)
            try:
                attached = control.attach(config.generation)
            except grpc.RpcError as exc:
                control.close()
                raise RuntimeError(
                    f"rank {config.rank} cannot attach to the agent at {config.agent_socket}: "
                    f"{exc.code().name}; is the pitstop agent running on this node?"
                ) from exc
            checkpointd = checkpointd or attached.checkpointd_address
            if attached.restore_step:
                config = replace(config, restore_step=int(attached.restore_step))
        session = cls(config, control, model_flops_per_token=flops[0], peak_flops=flops[1])
        try:
            session._connect(checkpointd)
        except BaseException:
            session.close()
            raise
        return session

    def _connect(self, checkpointd: str) -> None:
        """Open the snapshot writer, start the command reader, form the group."""
        config = self.config
        if checkpointd and config.job_id and not config.standby:
            self.writer = SnapshotWriter(
                checkpointd,
                config.job_id,
                config.rank,
                generation=config.generation,
                copy_threads=config.copy_threads or None,
                catalog_address=config.scheduler,
            )
        elif checkpointd and not config.job_id:
            log.warning("PITSTOP_CHECKPOINTD is set but PITSTOP_JOB_ID is not: no snapshots")
        if self.control is not None and not config.standby:
            self.start_commands()
        if config.distributed:
            self.device = group.device_for(config.local_rank)
            group.form(
                config.rank,
                config.world_size,
                config.timeout,
                device=self.device,
                wait=timedelta(seconds=config.reconfigure_timeout),
                generation=config.generation,
            )
        elif not config.standby:
            self.device = group.device_for(0)

    def set_flops(self, *, model_flops_per_token: float, peak_flops: float = 0.0) -> None:
        """State what the job's MFU is computed from, reported with every later step:
        the model's FLOPs per token of training (forward and backward: about 6 x its
        parameters, plus attention), and the peak FLOP/s of this rank's accelerator at the
        training precision (e.g. 989e12 for an H100 SXM in dense BF16). 0 means not
        stated. Call it once the model is built, where its size is known."""
        self.model_flops_per_token, self.peak_flops = _checked_flops(
            model_flops_per_token, peak_flops
        )

    def record_data(self, digest: str, source: str = "") -> None:
        """State the version of the data this run reads, for the job's record (`pitstop
        job record`, `pitstop job diff`): `digest`, e.g. the SHA-256 of the dataset's
        manifest or of the config that generates it, and `source`, what it is a digest
        of (a path, a URL). Call it before the loop: rank 0 reports it with the code and
        environment of each generation as the generation's first step begins. At most
        4096 characters each; a later call replaces the earlier."""
        self._run_record.data_digest = checked_text("digest", digest)
        self._run_record.data_source = checked_text("source", source)

    @property
    def is_chief(self) -> bool:
        """Rank 0: the rank whose view of commands decides when they are forced."""
        return self.rank == 0

    def start_commands(self) -> None:
        """Start reading commands and reporting steps (on-cluster only)."""
        assert self.control is not None
        self.inbox = Inbox(self.control)
        self._reporter = StepReporter(self.control.report_step)

    @property
    def mesh(self) -> DeviceMesh:
        """The job's ("dp", "pp", "tp") DeviceMesh on this generation's process group,
        built on first use in each generation. Building it creates its sub-groups, which
        every rank must do at the same point: in the state builder (see `restore`) or
        right after `from_env`."""
        if self._mesh is None or self._mesh_generation != self.generation:
            if not torch.distributed.is_initialized():
                raise RuntimeError(
                    f"rank {self.rank}: no process group to build a mesh on; start the ranks "
                    "through the pitstop agent or torchrun (WORLD_SIZE set)"
                )
            with group.adding_connections():  # its sub-groups' connections: abandoned too
                self._mesh = build_mesh(self.shape, self.device)
            self._mesh_generation = self.generation
        return self._mesh

    @property
    def rebuilds(self) -> bool:
        """Whether the state is built on the mesh, and so rebuilt after every in-place
        recovery (the builder passed to `restore` takes the mesh)."""
        return self._default is not None and _takes_mesh(self._default)

    def restore(self, default: Builder) -> TrainState:
        """`default()`, restored to the restore step when there is one. A standby process
        first waits here to be handed a rank. `default` must build the same state from
        scratch every time (seed what it draws from).

        A builder that takes an argument is given `session.mesh` and is the script's
        parallelize step (tensor parallel, pipeline stages, FSDP2 on the mesh's sub-meshes).
        After every in-place recovery the session calls it again on the new generation's
        mesh and moves the state into what it built, in place in the TrainState the loop
        holds: use `state.model`, `state.optimizer` and `state.objects` in the step, not
        names bound before the loop."""
        self._default = default
        if self.config.standby:
            return self.recovery.adopt()
        state = self.build()
        if self.restore_step:
            self.load(state, self.restore_step)
        return state

    def build(self) -> TrainState:
        """A fresh state from the builder given to `restore` (on the mesh, if it takes it)."""
        if self._default is None:
            raise RuntimeError("call session.restore(default=...) before the loop")
        if _takes_mesh(self._default):
            return self._default(self.mesh)  # type: ignore[call-arg]
        return self._default()  # type: ignore[call-arg]

    def load(self, state: TrainState, step: int, written: Shape | None = None) -> None:
        """Put the snapshot of `step` into `state` in place (step 0: a fresh `default()`).
        `written`: the shape this rank snapshotted `step` in, when that is not its shape
        now (a survivor of a shrink): the snapshot is its old rank's. Sharded state taken
        on another data-parallel size is resharded from the old ranks' snapshots (see
        `pitstop.trainer.reshard`)."""
        if step == 0:
            apply(state, *capture(self.build()))
            self.checks.restored(0, {})
            return
        if self.writer is None:
            raise RuntimeError(
                f"rank {self.rank} must restore step {step} but knows no checkpoint daemon; "
                "set PITSTOP_CHECKPOINTD and PITSTOP_JOB_ID"
            )
        if written is None:
            # Straight into the live tensors (a DTensor's local shard), not via a copy.
            into = {f"model.{k}": local_tensor(v) for k, v in state.model.state_dict().items()}
            restored = self._restore(step, self.rank, into)
        else:
            restored = self._restore(step, written.rank, None)
        tensors, metadata = restored.tensors, restored.metadata
        if DTENSOR_KEY in metadata:
            taken = Shape.from_json(metadata[SHAPE_KEY]) if SHAPE_KEY in metadata else None
            if taken is not None and taken.sizes != self.shape.sizes:
                tensors, metadata = self._resharded(state, step, restored, taken, written)
        apply(state, tensors, metadata)
        self.checks.restored(step, metadata)
        log.info("rank %d restored step %d from %s", self.rank, step, restored.source)
        self._restored = (time.time(), restored.source)  # told with the next step

    def _restore(self, step: int, rank: int, into: dict[str, torch.Tensor] | None) -> RestoredState:
        assert self.writer is not None
        try:
            return self.writer.restore(step, into=into, rank=rank)
        except grpc.RpcError as exc:
            raise RuntimeError(
                f"rank {self.rank}: restoring step {step} of job {self.config.job_id} (rank "
                f"{rank}'s snapshot) failed: {exc.code().name} {exc.details()}"
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
        shape = self.shape
        if (taken.pp, taken.tp) != (shape.pp, shape.tp):
            raise StateFormatError(
                f"step {step} was snapshotted on a dp x pp x tp = {taken.sizes} mesh and "
                f"rank {self.rank} is on {shape.sizes}: only dp may change (a shrink); "
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
            self.rank,
            step,
            taken.dp,
            ranks,
            shape.dp,
        )
        return resharded

    def shape_at(self, step: int) -> Shape | None:
        """The shape this process snapshotted `step` in, when it did."""
        return self._snapshot_shapes.get(step)

    def steps(
        self,
        state: TrainState,
        until: int | None = None,
        *,
        skip_batch: Callable[[TrainState], object] | None = None,
    ) -> Iterator[int]:
        """The steps to run, from `state.step + 1` up to `until` (None: no end). Commands
        are obeyed between steps, and only there. `skip_batch(state)`: move the state's
        data position past one batch; given, a step rolled back for a NaN/Inf loss or a
        spike skips its batch when it runs again (without it, the batch is retried)."""
        self.checks.skip_batch = skip_batch
        while True:
            if self._aborted is not None:
                aborted, self._aborted = self._aborted, None
                self._pending_step = None
                self.recovery.after_peer_loss(state, aborted)
            elif self._pending_step is not None:
                raise RuntimeError(
                    f"step {self._pending_step} ended without session.commit(state); "
                    "commit once per step"
                )
            if self.stopped:
                return
            if until is not None and state.step >= until:
                self.finished = True
                return
            if at_boundary(self, state):
                continue  # the state or the group changed: decide again, all together
            if self.is_chief and self.control is not None and self._run_record.due(self.generation):
                self._run_record.report(self.control, self.generation, state.step)
            self.checks.before_step(state)
            self._pending_step = state.step + 1
            self._started = self._mark = time.perf_counter()
            self._waited = 0.0
            yield self._pending_step

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap the step's body: a collective that fails because a peer is lost ends
        the step, and the next boundary recovers (Reconfigure) instead of the process
        dying. Other errors pass through. A collective that an abandon cannot end (see
        `group.collectives`) gets twice the last step's time, at least a second, before
        the process exits so the scheduler recovers the rank."""
        try:
            with group.collectives(grace=2 * self._last_wall):
                yield
        except Exception as exc:
            if self.inbox is None or not group.is_peer_loss(exc):
                raise
            group.abandon()  # peers still waiting on this rank hear of it now
            log.warning("rank %d: step lost a peer: %s", self.rank, exc)
            self._aborted = exc

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Wrap a collective (or any wait on other ranks): its time is not this rank's
        work, so it is left out of the step time that straggler detection compares."""
        self._simulate_slow_gpu()
        began = time.perf_counter()
        try:
            yield
        finally:
            self._mark = time.perf_counter()
            self._waited += self._mark - began

    def _simulate_slow_gpu(self) -> None:
        """On a simulated slow GPU, stretch the work since the last mark by the
        multiplier: the rank reaches its next collective as late as the slow GPU would."""
        multiplier = self.control.slow_multiplier if self.control is not None else 1.0
        if multiplier > 1.0 and self._pending_step is not None:
            time.sleep((multiplier - 1.0) * (time.perf_counter() - self._mark))

    def commit(
        self,
        state: TrainState,
        loss: float | torch.Tensor = 0.0,
        tokens: int = 0,
        grad_norm: float | torch.Tensor | None = None,
    ) -> None:
        """The step is done: count it, check and snapshot it when due, report it to the
        agent. `grad_norm`: the step's gradient norm, when the script has it (a NaN/Inf
        one rolls the step back as a NaN loss does). A step the checks find bad is
        rolled back here (the loop runs it again) or, for a corrupt replica, ends in a
        recovery as a lost peer does; neither is snapshotted or reported."""
        step = self._pending_step
        if step is None:
            raise RuntimeError("commit() outside a step: call it once per step of steps()")
        self._simulate_slow_gpu()
        self._pending_step = None
        state.step = step
        self._last_wall = time.perf_counter() - self._started
        seconds = self._last_wall - self._waited
        fault = self.control.take_rank_fault() if self.control is not None else 0
        if fault:
            loss = self.checks.carry_out(fault, state, loss)
        every = self.config.snapshot_every
        if self.writer is not None and every > 0 and step % every == 0:
            captured = self._capture(state)
            try:
                good = self.checks.check(state, *captured, float(loss), _number(grad_norm))
            except SilentCorruption as exc:
                self._aborted = exc  # the next boundary waits for the recovery
                return
            if not good:
                return  # rolled back: the loop runs the step again
            if self.snapshot(state, captured):
                self.checks.verified = step  # a rollback can go back to it
        if self._reporter is not None:
            # `seconds` was taken before the snapshot, so its stall is in no step's time
            # and the step is not reported as a checkpoint step: it counts in straggler
            # statistics (with a snapshot every step, excluding them would exclude all).
            flops = (tokens * self.model_flops_per_token, self.peak_flops)
            restored, self._restored = self._restored, None
            self._reporter.put(step, seconds, loss, tokens, flops, restored, grad_norm)

    @property
    def snapshot_failures(self) -> int:
        """Snapshots due that were not saved: skipped, refused, failed, or lost in their
        seal. Each is logged; none stops training."""
        lost = self.writer.lost_seals if self.writer is not None else 0
        return self._failed_snapshots + lost

    def snapshot(
        self,
        state: TrainState,
        captured: tuple[Mapping[str, torch.Tensor], dict[str, str]] | None = None,
    ) -> bool:
        """Snapshot `state` now (`captured`: its capture, when taken already); False
        when it was not saved. Whatever went wrong is logged and counted in
        `snapshot_failures`; the next snapshot tries again."""
        if self.writer is None:
            return False
        tensors, metadata = captured if captured is not None else self._capture(state)
        metadata.update(self.checks.metadata())
        if self._shape_json[0] is not self.shape:  # worked out once per generation
            self._shape_json = (self.shape, self.shape.to_json())
        metadata[SHAPE_KEY] = self._shape_json[1]
        self._snapshot_shapes[state.step] = self.shape
        if len(self._snapshot_shapes) > SHAPES_KEPT:  # the first kept is the oldest
            del self._snapshot_shapes[next(iter(self._snapshot_shapes))]
        try:
            result = self.writer.snapshot(state.step, tensors, metadata)
            if self.device.type == "cuda":
                # The copies run on a side stream; the next optimizer step must not
                # overwrite the tensors before they land in pinned memory (the move into
                # the slot and the seal go on in the background, as on the CPU).
                self.writer.wait_copied()
        except Exception as exc:  # the daemon's trouble must never end the run
            if isinstance(exc, grpc.RpcError):
                return self._snapshot_failed(state.step, f"{exc.code().name} {exc.details()}")
            return self._snapshot_failed(state.step, f"{type(exc).__name__}: {exc}")
        if result.skipped:
            return self._snapshot_failed(state.step, f"skipped: {result.skipped}")
        if self._failing_since:
            log.info(
                "rank %d: snapshots work again at step %d after %d failed in a row",
                self.rank,
                state.step,
                self._failing_since,
            )
            self._failing_since = 0
        self.last_snapshot = result
        return True

    def _snapshot_failed(self, step: int, why: str) -> bool:
        self._failed_snapshots += 1
        self._failing_since += 1
        # Every failure is counted; the log says the first of a run of them, then every
        # tenth and hundredth, so a daemon down for hours does not flood it.
        if self._failing_since in (1, 10) or self._failing_since % 100 == 0:
            log.warning(
                "rank %d: snapshot of step %d not saved (%d in a row, %d in all), "
                "training goes on: %s",
                self.rank,
                step,
                self._failing_since,
                self.snapshot_failures,
                why,
            )
        return False

    def report_result(self, result: Mapping[str, str]) -> None:
        """Report this rank's final result to the agent (no-op off-cluster)."""
        if self.control is None:
            return
        try:
            self.control.report_result(result)
        except grpc.RpcError as exc:
            log.warning("result not reported to the agent: %s", exc.code().name)

    def stop(self, state: TrainState, command: rank_pb2.RankCommand | None = None) -> None:
        """End the loop at this boundary (acknowledging `command`), the last snapshot sealed."""
        if self.writer is not None:
            self.writer.settle()  # the last snapshot sealed before we go (or logged lost)
        if command is not None and self.inbox is not None:
            self.inbox.acknowledge(command, ok=True, step=state.step)
        log.info("rank %d stopping after step %d", self.rank, state.step)
        self.stopped = True

    def close(self) -> None:
        """Finish reports and the last seal, end the streams, drop the group."""
        try:
            if self._reporter is not None:
                self._reporter.close()
            if self.inbox is not None:
                self.inbox.close()
            if self.control is not None:
                self.control.close()
            if self.inbox is not None:
                self.inbox.join()
            if self.writer is not None:
                self.writer.close()  # a last seal that fails is logged there
        finally:
            group.drop()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _number(value: float | torch.Tensor | None) -> float | None:
    return None if value is None else float(value)


def _checked_flops(model_flops_per_token: float, peak_flops: float) -> tuple[float, float]:
    """The two FLOPs figures as floats; a negative, infinite or non-numeric one is refused
    with its name, its value and what to give instead."""
    checked = []
    for name, value in (
        ("model_flops_per_token", model_flops_per_token),
        ("peak_flops", peak_flops),
    ):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ValueError(
                f"Session {name}={value!r}: give a finite number of FLOPs, 0 or more "
                "(0: not stated), e.g. model_flops_per_token=6 * parameters, "
                "peak_flops=989e12"
            )
        checked.append(number)
    return checked[0], checked[1]


_PR_SET_PDEATHSIG = 1


def _die_with_the_agent() -> None:
    """SIGKILL this rank when the agent that started it dies: a rank whose agent is gone
    can neither report nor be reconfigured or stopped, the scheduler treats its node as
    lost, and it must not train on in a generation that no longer exists. Exits at once
    if the agent is already gone. A rank forked by the agent's fork server
    (pitstop.agent.forkserver) has that server as its parent, which kills it when the
    agent's connection closes and whose death kills it too."""
    agent = os.environ.get("PITSTOP_AGENT_PID", "")
    if sys.platform != "linux" or not agent.isdigit():
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = os.getppid()
    forked_by = os.environ.get(FORK_SERVER_PID_ENV, "")
    if parent != int(agent) and not (forked_by.isdigit() and parent == int(forked_by)):
        raise SystemExit(f"the pitstop agent (pid {agent}) that started this rank is gone")
