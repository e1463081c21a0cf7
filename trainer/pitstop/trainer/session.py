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

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
import torch

import pitstop.trainer.group as group
from pitstop.rankside.rankclient import RankControlClient
from pitstop.rankside.writer import SnapshotResult, SnapshotWriter
from pitstop.trainer.attach import attach, connect
from pitstop.trainer.boundary import at_boundary
from pitstop.trainer.checks import Checker
from pitstop.trainer.clock import StepClock
from pitstop.trainer.commands import Inbox
from pitstop.trainer.config import RankConfig
from pitstop.trainer.context import RankContext, Shared
from pitstop.trainer.integrity import SilentCorruption
from pitstop.trainer.loading import Builder, Loader
from pitstop.trainer.mesh import Shape
from pitstop.trainer.recovery import Recovery
from pitstop.trainer.runrecord import RunRecorder, checked_text
from pitstop.trainer.snapshots import Snapshots
from pitstop.trainer.state import TrainState
from pitstop.v1 import rank_pb2

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


class Session:
    """One rank's link to the agent, its checkpoint daemon and its process group.

    What the rank is now (its number, world, generation, device, shape, links) lives in
    `context` (context.py); the attributes of the same names below read and write it.
    The work is done by its parts: `clock` (step time), `checks` (integrity),
    `loader` (build and load the state), `snapshots`, `recovery` (Reconfigure,
    standby) and, at each step boundary, boundary.py."""

    config = Shared[RankConfig]()
    rank = Shared[int]()
    world_size = Shared[int]()
    generation = Shared[int]()
    device = Shared[torch.device]()
    control = Shared[RankControlClient | None]()
    writer = Shared[SnapshotWriter | None]()
    inbox = Shared[Inbox | None]()
    shape = Shared[Shape]()
    """dp x pp x tp and this rank's coordinates; a Reconfigure brings the new ones."""
    stopped = Shared[bool]()
    """A Stop (or a Reconfigure without this rank) ended the loop early."""

    def __init__(
        self,
        config: RankConfig,
        control: RankControlClient | None = None,
        writer: SnapshotWriter | None = None,
        *,
        model_flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
    ) -> None:
        self.context = RankContext(config, control, writer)
        self.restore_step = config.restore_step
        self.clock = StepClock(self.context)
        self.checks = Checker(
            self.context,
            config.integrity,
            config.skip_steps,
            waiting=self.clock.waiting,
            load=self.load,
        )
        """The checks for silent data corruption and bad losses (see checks.py)."""
        self.loader = Loader(self.context, self.checks.restored)
        self.snapshots = Snapshots(self.context, self.checks)
        self.recovery = Recovery(self.context, self.loader, self.snapshots, self.checks)
        """In-place recoveries; `recovery.recoveries` records each one's timings."""
        self._aborted: BaseException | None = None
        self.finished = False
        """The loop ran to `until`."""
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
        config, control, checkpointd = attach(RankConfig.from_env())
        session = cls(config, control, model_flops_per_token=flops[0], peak_flops=flops[1])
        try:
            connect(session.context, checkpointd)
        except BaseException:
            session.close()
            raise
        return session

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
        return self.context.is_chief

    def start_commands(self) -> None:
        """Start reading commands and reporting steps (on-cluster only)."""
        self.context.start_commands()

    @property
    def mesh(self) -> DeviceMesh:
        """The job's ("dp", "pp", "tp") DeviceMesh on this generation's process group,
        built on first use in each generation. Building it creates its sub-groups, which
        every rank must do at the same point: in the state builder (see `restore`) or
        right after `from_env`."""
        return self.context.mesh()

    @property
    def rebuilds(self) -> bool:
        """Whether the state is built on the mesh, and so rebuilt after every in-place
        recovery (the builder passed to `restore` takes the mesh)."""
        return self.loader.rebuilds

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
        self.loader.default = default
        if self.config.standby:
            return self.recovery.adopt()
        state = self.build()
        if self.restore_step:
            self.load(state, self.restore_step)
        return state

    def build(self) -> TrainState:
        """A fresh state from the builder given to `restore` (on the mesh, if it takes it)."""
        return self.loader.build()

    def load(self, state: TrainState, step: int, written: Shape | None = None) -> None:
        """Put the snapshot of `step` into `state` in place (step 0: a fresh `default()`).
        `written`: the shape this rank snapshotted `step` in, when that is not its shape
        now (a survivor of a shrink): the snapshot is its old rank's. Sharded state taken
        on another data-parallel size is resharded from the old ranks' snapshots (see
        `pitstop.trainer.reshard`)."""
        self.loader.load(state, step, written)

    def shape_at(self, step: int) -> Shape | None:
        """The shape this process snapshotted `step` in, when it did."""
        return self.snapshots.shape_at(step)

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
                self.clock.pending = None
                self.recovery.after_peer_loss(state, aborted)
            elif self.clock.pending is not None:
                raise RuntimeError(
                    f"step {self.clock.pending} ended without session.commit(state); "
                    "commit once per step"
                )
            if self.stopped:
                return
            if until is not None and state.step >= until:
                self.finished = True
                return
            if at_boundary(self.context, self.recovery, state):
                continue  # the state or the group changed: decide again, all together
            if self.is_chief and self.control is not None and self._run_record.due(self.generation):
                self._run_record.report(self.control, self.generation, state.step)
            self.checks.before_step(state)
            self.clock.start(state.step + 1)
            yield state.step + 1

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap the step's body: a collective that fails because a peer is lost ends
        the step, and the next boundary recovers (Reconfigure) instead of the process
        dying. Other errors pass through. A collective that an abandon cannot end (see
        `group.collectives`) gets twice the last step's time, at least a second, before
        the process exits so the scheduler recovers the rank."""
        try:
            with group.collectives(grace=2 * self.clock.last_wall):
                yield
        except Exception as exc:
            if self.inbox is None or not group.is_peer_loss(exc):
                raise
            group.abandon()  # peers still waiting on this rank hear of it now
            log.warning("rank %d: step lost a peer: %s", self.rank, exc)
            self._aborted = exc

    def waiting(self) -> AbstractContextManager[None]:
        """Wrap a collective (or any wait on other ranks): its time is not this rank's
        work, so it is left out of the step time that straggler detection compares."""
        return self.clock.waiting()

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
        step = self.clock.pending
        if step is None:
            raise RuntimeError("commit() outside a step: call it once per step of steps()")
        seconds = self.clock.finish()
        state.step = step
        fault = self.control.take_rank_fault() if self.control is not None else 0
        if fault:
            self.snapshots.wait_copied()  # a fault may write into the state
            loss = self.checks.carry_out(fault, state, loss)
        every = self.config.snapshot_every
        if self.writer is not None and every > 0 and step % every == 0:
            captured = self.snapshots.capture(state)
            try:
                good = self.checks.check(state, *captured, float(loss), _number(grad_norm))
            except SilentCorruption as exc:
                self._aborted = exc  # the next boundary waits for the recovery
                return
            if not good:
                return  # rolled back: the loop runs the step again
            if self.snapshot(state, captured):
                self.checks.verified = step  # a rollback can go back to it
        reporter = self.context.reporter
        if reporter is not None:
            # `seconds` was taken before the snapshot, so its stall is in no step's time
            # and the step is not reported as a checkpoint step: it counts in straggler
            # statistics (with a snapshot every step, excluding them would exclude all).
            flops = (tokens * self.model_flops_per_token, self.peak_flops)
            restored = self.loader.take_restored()
            reporter.put(step, seconds, loss, tokens, flops, restored, grad_norm)

    @property
    def last_snapshot(self) -> SnapshotResult | None:
        """The last snapshot saved."""
        return self.snapshots.last

    @property
    def snapshot_failures(self) -> int:
        """Snapshots due that were not saved: skipped, refused, failed, or lost in their
        seal. Each is logged; none stops training."""
        return self.snapshots.failures

    def snapshot(
        self,
        state: TrainState,
        captured: tuple[Mapping[str, torch.Tensor], dict[str, str]] | None = None,
    ) -> bool:
        """Snapshot `state` now (`captured`: its capture, when taken already); False
        when it was not saved. Whatever went wrong is logged and counted in
        `snapshot_failures`; the next snapshot tries again."""
        return self.snapshots.take(state, captured)

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
        self.context.stop(state, command)

    def close(self) -> None:
        """Finish reports and the last seal, end the streams, drop the group."""
        self.context.close()

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
