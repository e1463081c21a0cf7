"""The rank's side of a Reconfigure: drop the group, roll back, re-form, acknowledge.

A survivor keeps its process and its state in memory. It rolls back only when it must:
when it stands past the restore step (it committed steps a lost peer never did) or when
its last step was cut short (a collective failed mid-step, so the live state may be
half updated). The rollback reads the survivor's own snapshot, which checkpointd serves
from this node's memory. A standby process takes a lost rank: it loads that rank's
shard (from the buddy's memory, or durable storage, as checkpointd finds it).

A rank finds itself in the new rank map by its node and GPU (the agent made one GPU
visible to it), else by its node and local rank; without a node id (started by hand)
it keeps its rank number. Absent from the map, it acknowledges and stops cleanly.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import fields
from datetime import timedelta
from typing import TYPE_CHECKING

import pitstop.trainer.group as group
from pitstop.rankside.writer import SnapshotWriter
from pitstop.trainer.checks import Checker
from pitstop.trainer.commands import RECONFIGURE, STOP
from pitstop.trainer.context import RankContext
from pitstop.trainer.loading import Loader
from pitstop.trainer.mesh import Shape
from pitstop.trainer.snapshots import Snapshots
from pitstop.trainer.state import TrainState, apply, capture
from pitstop.v1 import agent_pb2, common_pb2, rank_pb2

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)


class PeerLostError(RuntimeError):
    """A collective failed (a peer is gone) and no Reconfigure came to recover in place;
    the process exits non-zero and the scheduler restarts it from the committed step."""


class Recovery:
    """Carries out Reconfigure and standby adoption for one session: moves its
    RankContext to the new generation, loading the state with its Loader."""

    def __init__(
        self, context: RankContext, loader: Loader, snapshots: Snapshots, checks: Checker
    ) -> None:
        self._context = context
        self._loader = loader
        self._snapshots = snapshots
        self._checks = checks
        self.recoveries: list[dict[str, float]] = []
        """Per recovery: generation, restore step, and seconds spent restoring and
        re-forming, for the goodput account and the logs."""

    def after_peer_loss(self, state: TrainState, error: BaseException) -> None:
        """A collective failed: drop the group and wait for the Reconfigure that
        recovers, or raise PeerLostError when none comes in time."""
        context = self._context
        group.abandon()  # peers still waiting on this rank hear of it now
        group.drop()
        inbox = context.inbox
        if inbox is None:
            raise PeerLostError(f"rank {context.rank} lost a peer off-cluster") from error
        timeout = context.config.reconfigure_timeout
        deadline = time.monotonic() + timeout
        log.warning(
            "rank %d lost a peer; waiting up to %.0fs for a Reconfigure", context.rank, timeout
        )
        while True:
            pending = inbox.wait_for((RECONFIGURE, STOP), max(0.0, deadline - time.monotonic()))
            if pending is None:
                raise PeerLostError(
                    f"rank {context.rank} lost a peer at step {state.step} and no Reconfigure "
                    f"came within {timeout:.0f}s ({inbox.broken or 'none sent'}); exiting so "
                    "the scheduler restarts it from the committed step"
                ) from error
            if pending.kind == STOP:
                context.stop(state, pending.command)
                return
            if self.reconfigure(state, pending.command, cut_short=True):
                return

    def reconfigure(
        self, state: TrainState, command: rank_pb2.RankCommand, cut_short: bool
    ) -> bool:
        """Carry out `command`'s Reconfigure; False when it is stale (not newer than this
        rank's generation) and was only acknowledged."""
        context, new = self._context, command.reconfigure
        inbox = context.inbox
        assert inbox is not None
        if new.generation <= context.generation:
            inbox.acknowledge(command, ok=True, step=state.step)
            log.info(
                "rank %d: stale Reconfigure to generation %d ignored", context.rank, new.generation
            )
            return False
        started = time.perf_counter()
        group.drop()
        rank = self._rank_in(new.rank_map)
        if rank is None:
            log.info(
                "rank %d is not in generation %d: leaving the job", context.rank, new.generation
            )
            context.stop(state, command)
            return True
        try:
            self._join(state, new, rank, must_restore=cut_short)
        except group.Superseded:
            # A newer generation was decided while this one formed (a second failure
            # mid-recovery): its peers will never all come. Join the newest instead.
            held = inbox.drain(RECONFIGURE)
            newest = max(held, key=lambda c: c.reconfigure.generation)
            for stale in held:
                if stale is not newest:
                    inbox.acknowledge(stale, ok=True, step=state.step)
            superseded_by = newest.reconfigure.generation
            inbox.acknowledge(
                command,
                ok=False,
                step=state.step,
                error=f"superseded by generation {superseded_by}",
            )
            log.warning(
                "rank %d: generation %d superseded by %d while forming",
                context.rank,
                new.generation,
                superseded_by,
            )
            return self.reconfigure(state, newest, cut_short=True)
        except Exception as exc:
            inbox.acknowledge(
                command, ok=False, step=state.step, error=f"{type(exc).__name__}: {exc}"
            )
            raise
        inbox.acknowledge(command, ok=True, step=state.step)
        self._record(new, started)
        return True

    def adopt(self) -> TrainState:
        """Standby: wait for a rank, become it, load its state and join its group."""
        context = self._context
        control = context.control
        if control is None:
            raise RuntimeError(
                "PITSTOP_STANDBY=1 needs PITSTOP_AGENT_SOCKET: the agent hands out ranks"
            )
        _import_what_building_a_state_imports()
        log.info("standby for job %s: waiting for a rank", context.config.job_id)
        assignment = control.standby()
        started = time.perf_counter()
        new = assignment.reconfigure
        control.rank = context.rank = assignment.rank
        os.environ["CUDA_VISIBLE_DEVICES"] = str(assignment.gpu_index)  # CUDA not yet touched
        context.device = group.device_for(0)
        address = context.config.checkpointd
        try:
            attached = control.attach(new.generation)
            address = address or attached.checkpointd_address
        except Exception as exc:  # grpc.RpcError: the rank still runs, without attach
            log.warning("rank %d: attach after adoption failed: %s", assignment.rank, exc)
        if address and context.config.job_id:
            context.writer = SnapshotWriter(
                address,
                context.config.job_id,
                assignment.rank,
                copy_threads=context.config.copy_threads or None,
                catalog_address=context.config.scheduler,
            )
        context.start_commands()
        # A state built on the mesh is built once the new group has formed.
        state = None if self._loader.rebuilds else self._loader.build()
        state = self._join(state, new, assignment.rank, must_restore=new.restore_step > 0)
        self._record(new, started)
        return state

    def _join(
        self, state: TrainState | None, new: agent_pb2.Reconfigure, rank: int, must_restore: bool
    ) -> TrainState:
        """Move to generation `new` as `rank`: restore if needed, re-form the group. A
        state built on the mesh is rebuilt on the new one after the group forms (`state`
        None: a standby's, built there), and the state moved into it. Returns the state."""
        context = self._context
        context.generation = int(new.generation)
        self._checks.skipped.update(new.skipped_steps)  # as the scheduler recorded them
        if context.control is not None:
            context.control.generation = context.generation
        if context.writer is not None:
            context.writer.generation = context.generation
            context.writer.rank = rank
        restore = must_restore or state is None or state.step != new.restore_step
        written = self._snapshots.shape_at(int(new.restore_step))
        if state is not None and restore and not self._loader.rebuilds:
            self._loader.load(state, int(new.restore_step))
        if rank != context.rank and context.control is not None:
            context.control.rank = rank
            if context.inbox is not None:
                context.inbox.watch(rank)
        context.rank = rank
        context.world_size = new.rank_map.world_size or len(new.rank_map.ranks)
        context.shape = Shape.from_rank_map(new.rank_map, rank)
        host, _, port = new.rendezvous_address.rpartition(":")
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(context.world_size), MASTER_ADDR=host, MASTER_PORT=port
        )
        os.environ.update(context.shape.env())
        self._form(new)
        # Building is collective (sub-groups, tensor-parallel weights distributed from
        # the TP group's first rank): every rank builds exactly once here. Restoring step
        # 0 is what was just built (loading it would build again on some ranks only).
        if not self._loader.rebuilds:
            assert state is not None
            return state
        fresh = self._loader.build()  # the script's parallelize step, on the new mesh
        # A shrink: the restore step was snapshotted on the old mesh, as another rank.
        reshaped = written is not None and written.sizes != context.shape.sizes
        if (restore or reshaped) and new.restore_step > 0:
            self._loader.load(fresh, int(new.restore_step), written if reshaped else None)
        elif not restore:  # a survivor at the restore step: its own shards, from memory
            assert state is not None
            apply(fresh, *capture(state))
        if state is None:
            return fresh
        for name in (f.name for f in fields(TrainState)):
            setattr(state, name, getattr(fresh, name))
        return state

    def _form(self, new: agent_pb2.Reconfigure) -> None:
        context = self._context
        group.form(
            context.rank,
            context.world_size,
            context.config.timeout,
            rendezvous_address=new.rendezvous_address,
            device=context.device,
            wait=timedelta(seconds=context.config.reconfigure_timeout),
            superseded=self._superseded_by(new.generation),
            generation=context.generation,
        )

    def _superseded_by(self, generation: int) -> Callable[[], bool] | None:
        inbox = self._context.inbox
        if inbox is None:
            return None
        return lambda: inbox.newest_generation() > generation

    def _rank_in(self, rank_map: common_pb2.RankMap) -> int | None:
        config, context = self._context.config, self._context
        if not config.node_id:
            return context.rank if any(a.rank == context.rank for a in rank_map.ranks) else None
        for assignment in rank_map.ranks:
            if assignment.node_id != config.node_id:
                continue
            if config.gpu_index is not None and assignment.gpu_index == config.gpu_index:
                return int(assignment.rank)
            if config.gpu_index is None and assignment.local_rank == config.local_rank:
                return int(assignment.rank)
        return None

    def _record(self, new: agent_pb2.Reconfigure, started: float) -> None:
        seconds = time.perf_counter() - started
        self.recoveries.append(
            {"generation": new.generation, "restore_step": new.restore_step, "seconds": seconds}
        )
        log.info(
            "rank %d joined generation %d at step %d in %.3fs",
            self._context.rank,
            new.generation,
            new.restore_step,
            seconds,
        )


def _import_what_building_a_state_imports() -> None:
    """torch imports its compiler (dynamo) the first time an optimizer is built: 2.3 s of
    CPU that a standby pays now, while it waits, instead of after it is handed a rank."""
    import torch._dynamo  # noqa: F401
