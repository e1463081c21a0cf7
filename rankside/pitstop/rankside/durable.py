"""The durable store, through fsspec (file:// by default; s3:// and others when their
fsspec packages are installed).

    <root>/<job>/step-<step>/rank-<rank>-<checksum>.safetensors   shards, written first
    <root>/<job>/step-<step>/manifest-<node>.json                  written last, atomically

A node's manifest lists the ranks it flushed at that step with their files, sizes and
checksums. Only a manifest whose every shard is present at its full size is offered
(checksums are verified when a shard is read), so a flush killed before its manifest is
never restored. A file a manifest names is never rewritten: shard names carry their
checksum. Everything here blocks; the daemon calls it from worker threads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pitstop.rankside.shards import CHECKSUM_ALGORITHM, ShardId

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "pitstop-checkpoint/1"
IO_CHUNK_BYTES = 16 << 20
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SAFE = re.compile(r"^[A-Za-z0-9_.@=+-]+$")


@dataclass(frozen=True)
class DurableShard:
    """One rank's shard to flush: its bytes and checksum."""

    rank: int
    data: memoryview
    checksum: str


@dataclass(frozen=True)
class DurableEntry:
    """One rank's shard in a complete manifest."""

    shard: ShardId
    generation: int
    path: str
    size: int
    checksum: str
    node_id: str


class DurableStore:
    """The durable checkpoints of one store URL, as written by node `node_id`."""

    def __init__(self, url: str, node_id: str) -> None:
        self.url = url
        self.node_id = node_id
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self._manifest_name = f"manifest-{_safe_name(node_id, 'node_id')}.json"

    def free_bytes(self) -> int | None:
        """Bytes free on the filesystem the store writes to, for a store on a local
        filesystem (its root or the nearest folder above it that exists); None for any
        other store (an object store has no "full")."""
        if not isinstance(self.fs, LocalFileSystem):
            return None
        path = Path(self.root)
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return None

    def write_checkpoint(
        self,
        job_id: str,
        step: int,
        generation: int,
        shards: Sequence[DurableShard],
        before_manifest: Callable[[], None] | None = None,
    ) -> list[DurableEntry]:
        """Write `shards` of (job, step), then this node's manifest for that step (merged
        with the one already there). Returns the manifest's entries."""
        step_dir = self._step_dir(job_id, step)
        self.fs.makedirs(step_dir, exist_ok=True)
        manifest_path = f"{step_dir}/{self._manifest_name}"
        ranks = self._read_manifest(manifest_path) or {}
        for shard in shards:
            file_name = f"rank-{shard.rank:06d}-{shard.checksum}.safetensors"
            if ranks.get(str(shard.rank), {}).get("file") == file_name:
                continue
            self._write_file(f"{step_dir}/{file_name}", shard.data)
            ranks[str(shard.rank)] = {
                "file": file_name,
                "size": len(shard.data),
                "checksum": shard.checksum,
            }
        if before_manifest is not None:
            before_manifest()
        manifest = {
            "format": MANIFEST_FORMAT,
            "job_id": job_id,
            "step": step,
            "generation": generation,
            "node_id": self.node_id,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0]))),
        }
        temporary = f"{manifest_path}.tmp"
        self.fs.pipe_file(temporary, json.dumps(manifest, indent=1).encode())
        self.fs.mv(temporary, manifest_path)
        return self._entries(job_id, step, manifest_path, manifest, sizes=None)

    def entries(self, job_id: str) -> list[DurableEntry]:
        """Every shard of `job_id` offered for restore: those of complete manifests."""
        job_dir = f"{self.root}/{_safe_name(job_id, 'job_id')}"
        if not self.fs.isdir(job_dir):
            return []
        found: list[DurableEntry] = []
        for item in self.fs.ls(job_dir, detail=False):
            match = _STEP_DIR.match(str(item).rstrip("/").rsplit("/", 1)[-1])
            if match is None:
                continue
            step_dir = f"{job_dir}/{match.group(0)}"
            files = self.fs.ls(step_dir, detail=True)
            sizes = {str(f["name"]).rsplit("/", 1)[-1]: int(f.get("size") or 0) for f in files}
            for name in sizes:
                if name.startswith("manifest-") and name.endswith(".json"):
                    path = f"{step_dir}/{name}"
                    manifest = self._read_manifest_doc(path)
                    if manifest is not None and manifest.get("step") == int(match.group(1)):
                        found += self._entries(job_id, manifest["step"], path, manifest, sizes)
        return sorted(found, key=lambda e: (e.shard, e.node_id))

    def job_ids(self) -> list[str]:
        """Jobs with anything in the store."""
        if not self.fs.isdir(self.root):
            return []
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, False))

    def find(self, job_id: str, rank: int, step: int = 0) -> DurableEntry | None:
        """The entry of (job, rank) at `step`, or the newest one for step 0."""
        matches = [e for e in self.entries(job_id) if e.shard.rank == rank]
        if step:
            matches = [e for e in matches if e.shard.step == step]
        return max(matches, key=lambda e: e.shard.step, default=None)

    def read_into(self, entry: DurableEntry, buffer: memoryview) -> None:
        """Read the shard of `entry` into the first entry.size bytes of `buffer`."""
        with self.fs.open(entry.path, "rb") as file:
            offset = 0
            while offset < entry.size:
                got = file.readinto(buffer[offset : min(entry.size, offset + IO_CHUNK_BYTES)])
                if not got:
                    raise OSError(f"{entry.path}: ends at byte {offset} of {entry.size}")
                offset += got

    def prune(self, job_id: str, keep: int) -> list[ShardId]:
        """Drop this node's durable checkpoints of `job_id` beyond the newest `keep`:
        manifest first, so a half-pruned step is never offered. The shards dropped."""
        mine = sorted(
            {e.shard.step for e in self.entries(job_id) if e.node_id == self.node_id},
            reverse=True,
        )
        dropped: list[ShardId] = []
        for step in mine[keep:]:
            step_dir = self._step_dir(job_id, step)
            manifest = self._read_manifest(f"{step_dir}/{self._manifest_name}") or {}
            self.fs.rm(f"{step_dir}/{self._manifest_name}")
            for rank, info in manifest.items():
                self.fs.rm(f"{step_dir}/{info['file']}")
                dropped.append(ShardId(job_id, int(rank), step))
            if self.fs.isdir(step_dir) and not self.fs.ls(step_dir, detail=False):
                self.fs.rmdir(step_dir)
        return dropped

    def _write_file(self, path: str, data: memoryview) -> None:
        try:
            with self.fs.open(path, "wb") as file:
                for offset in range(0, len(data), IO_CHUNK_BYTES):
                    file.write(data[offset : offset + IO_CHUNK_BYTES])
                file.flush()
                fileno = getattr(file, "fileno", None)
                if fileno is not None:
                    os.fsync(fileno())
        except BaseException:
            # No manifest names it, so nothing would restore it; a full disk's partial
            # file would only keep the disk full.
            with contextlib.suppress(OSError):
                self.fs.rm_file(path)
            raise

    def _step_dir(self, job_id: str, step: int) -> str:
        return f"{self.root}/{_safe_name(job_id, 'job_id')}/step-{step:012d}"

    def _read_manifest(self, path: str) -> dict[str, dict[str, Any]] | None:
        doc = self._read_manifest_doc(path) if self.fs.exists(path) else None
        return None if doc is None else dict(doc["ranks"])

    def _read_manifest_doc(self, path: str) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.fs.cat_file(path))
        except (OSError, ValueError) as exc:
            log.warning("durable manifest %s is unreadable, ignored: %s", path, exc)
            return None
        if (
            not isinstance(doc, dict)
            or doc.get("format") != MANIFEST_FORMAT
            or not isinstance(doc.get("ranks"), dict)
            or not isinstance(doc.get("step"), int)
        ):
            log.warning("durable manifest %s is not a %s manifest, ignored", path, MANIFEST_FORMAT)
            return None
        return doc

    def _entries(
        self,
        job_id: str,
        step: int,
        manifest_path: str,
        manifest: dict[str, Any],
        sizes: dict[str, int] | None,
    ) -> list[DurableEntry]:
        step_dir = manifest_path.rsplit("/", 1)[0]
        entries = []
        try:
            for rank, info in manifest["ranks"].items():
                if sizes is not None and sizes.get(info["file"]) != info["size"]:
                    log.warning("durable step %s of %s lacks %s: not offered", step, job_id, info)
                    return []
                entries.append(
                    DurableEntry(
                        ShardId(job_id, int(rank), step),
                        int(manifest.get("generation", 0)),
                        f"{step_dir}/{info['file']}",
                        int(info["size"]),
                        str(info["checksum"]),
                        str(manifest.get("node_id", "")),
                    )
                )
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("durable manifest %s is malformed (%r): not offered", manifest_path, exc)
            return []
        return entries


def valid_name(value: str) -> bool:
    """Whether `value` can name a directory of the store (a job id, a node id)."""
    return bool(_SAFE.match(value)) and value not in (".", "..")


def _safe_name(value: str, what: str) -> str:
    if not valid_name(value):
        raise ValueError(f"{what} {value!r}: use letters, digits and _.@=+- only")
    return value
