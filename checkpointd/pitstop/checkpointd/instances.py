"""Whose a shared-memory segment is, and whether its owner still lives.

Names say whose a segment is: `<node prefix><instance>-<n>`. The node prefix comes from
the node id (`segment_prefix`); the instance is a random id each daemon run (each
SlotPool) draws, so two daemons with the same node id on one host (two local clusters)
never share a name. Each instance holds a marker, `<node prefix><instance>.owner` (its
pid inside, for people), with an exclusive flock for as long as it runs: the kernel
drops the lock when the process dies, however it dies, and a reused pid fools nothing.

A cleanup (`remove_stale_segments`: at a daemon's start, and `pitstop-checkpointd
cleanup`) removes an instance's segments only when it can take that lock itself, or the
marker is gone: the segments of a live instance are never removed, whoever runs the
cleanup. The marker is created before the instance's first segment and removed after
its last. Names of any other shape under a node's prefix (from a pitstop before
instance ids) are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

from pitstop.rankside.shm import SHM_DIR as SHM_DIR

SEGMENT_PREFIX = "pitstop-ckpt-"
MARKER_SUFFIX = ".owner"
_INSTANCE_HEX = 12
_OWNED = re.compile(rf"([0-9a-f]{{{_INSTANCE_HEX}}})(?:-\d+|{re.escape(MARKER_SUFFIX)})")
"""What follows the node prefix in the name of a segment or a marker: the instance id."""


def segment_prefix(node_id: str) -> str:
    """The name prefix of every segment of every daemon instance of `node_id`."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)[:48]
    digest = hashlib.sha256(node_id.encode()).hexdigest()[:8]
    return f"{SEGMENT_PREFIX}{safe}-{digest}-"


def remove_stale_segments(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments under `prefix` (a node's, see `segment_prefix`) of every
    daemon instance that is gone, and their markers; the segments of live instances
    stay. Returns the names of the segments removed."""
    owned: dict[str, list[Path]] = {}
    with contextlib.suppress(FileNotFoundError):
        for path in shm_dir.iterdir():
            if path.name.startswith(prefix):
                match = _OWNED.fullmatch(path.name[len(prefix) :])
                if match:
                    owned.setdefault(match[1], []).append(path)
    removed = []
    for instance, paths in owned.items():
        marker = shm_dir / f"{prefix}{instance}{MARKER_SUFFIX}"
        with _lock_if_gone(marker) as gone:
            if not gone:
                continue
            for path in paths:
                if path != marker:
                    path.unlink(missing_ok=True)
                    removed.append(path.name)
            marker.unlink(missing_ok=True)
    return sorted(removed)


@contextlib.contextmanager
def _lock_if_gone(marker: Path) -> Iterator[bool]:
    """Whether the instance of `marker` is gone; while True, its lock is held here, so
    that no new instance can claim the name meanwhile (see InstanceMarker.claim)."""
    try:
        fd = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        yield True  # its segments outlived their marker: the instance is gone
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        gone = True
    except BlockingIOError:
        gone = False  # a live process holds it
    try:
        yield gone
    finally:
        os.close(fd)


class InstanceMarker:
    """The flock'ed file that tells a cleanup this daemon instance is alive."""

    def __init__(self, path: Path, instance: str, fd: int) -> None:
        self.path = path
        self.instance = instance
        self._fd: int | None = fd

    @classmethod
    def claim(cls, prefix: str, shm_dir: Path) -> InstanceMarker:
        """A new instance id under `prefix`, its marker created and locked."""
        while True:
            instance = secrets.token_hex(_INSTANCE_HEX // 2)
            path = shm_dir / f"{prefix}{instance}{MARKER_SUFFIX}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink == 0:
                # A cleanup took the lock between our create and our flock, and removed
                # the marker as a dead instance's: draw another id.
                os.close(fd)
                continue
            os.write(fd, f"pid {os.getpid()}\n".encode())
            return cls(path, instance, fd)

    def release(self) -> None:
        """Remove the marker and drop the lock: the instance has no segments left."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
