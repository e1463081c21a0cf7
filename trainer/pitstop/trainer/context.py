"""Where a rank stands: its number, its world, its generation, its device and mesh
shape, and its links to the agent (control, inbox, reporter) and to the node's
checkpoint daemon (writer).

The session holds one `RankContext`; the parts that act for it at a step boundary
(boundary.py, recovery.py) and the checks (checks.py) take it instead of the session,
so none of them imports session.py. A recovery moves the context on (a new generation,
rank, world, shape); the session's attributes of the same names read and write it
(`Shared`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch

import pitstop.trainer.group as group
from pitstop.rankside.rankclient import RankControlClient
from pitstop.rankside.writer import SnapshotWriter
from pitstop.trainer.commands import Inbox, StepReporter
from pitstop.trainer.config import RankConfig
from pitstop.trainer.mesh import Shape, build_mesh
from pitstop.trainer.state import TrainState
from pitstop.v1 import rank_pb2

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class RankContext:
    """One rank's standing and links; see the module's docstring."""

    config: RankConfig
    control: RankControlClient | None = None
    writer: SnapshotWriter | None = None
    rank: int = field(init=False)
    world_size: int = field(init=False)
    generation: int = field(init=False)
    shape: Shape = field(init=False)
    """dp x pp x tp and this rank's coordinates; a Reconfigure brings the new ones."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    inbox: Inbox | None = None
    reporter: StepReporter | None = None
    stopped: bool = False
    """A Stop (or a Reconfigure without this rank) ended the loop early."""
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _mesh_generation: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        self.rank, self.world_size = self.config.rank, self.config.world_size
        self.generation = self.config.generation
        self.shape = self.config.shape

    @property
    def is_chief(self) -> bool:
        """Rank 0: the rank whose view of commands decides when they are forced."""
        return self.rank == 0

    def start_commands(self) -> None:
        """Start reading commands and reporting steps (on-cluster only)."""
        assert self.control is not None
        self.inbox = Inbox(self.control)
        self.reporter = StepReporter(self.control.report_step)

    def mesh(self) -> DeviceMesh:
        """The job's mesh on this generation's process group (see `Session.mesh`)."""
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
            if self.reporter is not None:
                self.reporter.close()
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


class Shared(Generic[T]):
    """An attribute of an object with a `context` (the Session) that lives in that
    RankContext under the same name: reading and writing it reads and writes there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Shared[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.context, self._name)

    def __set__(self, obj: Any, value: T) -> None:
        setattr(obj.context, self._name, value)
