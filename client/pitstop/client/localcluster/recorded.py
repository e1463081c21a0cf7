"""What `LocalCluster` reads of its record: its fields, read and written through to the
`ClusterState` it holds (`Recorded`), and whether a cluster recorded in (or tagged with)
a state dir still runs (`refuse_running`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast, overload

from pitstop.client.localcluster.errors import ClusterAlreadyRunning
from pitstop.client.localcluster.processes import tagged_processes
from pitstop.client.localcluster.statefile import ClusterProcess, ClusterState

T = TypeVar("T")


class HoldsRecord(Protocol):
    record: ClusterState


class Recorded(Generic[T]):
    """An attribute of the holder's `record` of the same name, as the holder's own."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, holder: None, owner: type | None = None) -> Recorded[T]: ...

    @overload
    def __get__(self, holder: HoldsRecord, owner: type | None = None) -> T: ...

    def __get__(self, holder: HoldsRecord | None, owner: type | None = None) -> Any:
        if holder is None:
            return self
        return cast(T, getattr(holder.record, self.name))

    def __set__(self, holder: HoldsRecord, value: T) -> None:
        setattr(holder.record, self.name, value)


def refuse_running(root: Path, earlier: ClusterState | None) -> None:
    """ClusterAlreadyRunning when a daemon of the cluster `earlier` (recorded in `root`),
    or one tagged with `root`, still runs."""
    running = [] if earlier is None else earlier.running()
    known = {p.pid for p in running}
    running += [
        ClusterProcess.from_tagged(t, root / "logs")
        for t in tagged_processes(root)
        if t.is_daemon() and t.pid not in known
    ]
    if running:
        first = next((p for p in running if p.kind == "scheduler"), running[0])
        raise ClusterAlreadyRunning(
            f"a cluster is already running in {root} ({first.name} pid {first.pid}); "
            f"run pitstop cluster down --state-dir {root} first"
        )
