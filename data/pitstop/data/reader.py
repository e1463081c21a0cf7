"""Reading samples: token windows out of local or remote shards, cached and prefetched.

A shard on local disk (a path or a ``file://`` URL) is memory-mapped where it lies, never
copied. Any other fsspec URL (``s3://``, ``gs://``, ``memory://``...) is first copied
whole into a local `ShardCache` and mapped from there, since a window read through the
network per sample would be far slower than one sequential copy. A ``parquet`` or
``hf`` shard, local or not, goes through the cache too: its "copy" is its token column
converted to a flat array of the manifest's dtype, which is then mapped as a raw shard is.

The cache holds at most `max_bytes`, counting the copies under way: room is reserved
before a copy starts, by evicting the least recently used shards that nobody is reading.
A shard being read is pinned and never evicted. A copy is written under a temporary
name, checked against the manifest's size and digest, flushed to disk and only then
renamed to its final name (the shard's content digest), so a half-copied or changed
shard is never read, not even by a process restarted after a crash. One process owns a
cache directory (give each rank its own).

`SampleReader.prefetch` copies shards ahead on background threads; a replica asks only
for the shards its own upcoming samples are in (see `pitstop.data.replica`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import fsspec
import numpy as np
import torch
import xxhash
from fsspec.implementations.local import LocalFileSystem

from pitstop.data.arrow import COLUMNAR_FORMATS, DEFAULT_COLUMN, token_bytes
from pitstop.data.shards import ShardInfo, Windows

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_PARTIAL = ".partial"
_COMPLETE = ".tokens"


class CacheFullError(RuntimeError):
    """The shards being read at once do not fit in the cache."""


def is_local(url: str) -> bool:
    """Whether `url` is a file on this machine (a path or ``file://``)."""
    filesystem, _ = fsspec.core.url_to_fs(url)
    return isinstance(filesystem, LocalFileSystem)


@dataclass
class _Entry:
    size: int
    path: Path
    pins: int = 0
    ready: bool = False


class ShardCache:
    """Local copies of remote shards under `directory`, `max_bytes` at most in all."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes {max_bytes!r}: must be an integer >= 1")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        # Least recently used first. Guarded by _changed, which wakes waiters whenever an
        # entry becomes ready, fails, or is unpinned.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0
        self._changed = threading.Condition()
        self._adopt()

    @property
    def used_bytes(self) -> int:
        """Bytes of the shards held and the copies under way."""
        with self._changed:
            return self._used

    def acquire(self, shard: ShardInfo) -> Path:
        """The local path of `shard`, copied first if it is not here, pinned until
        `release`. Waits for a copy another thread has under way. Raises CacheFullError
        when the pinned shards leave no room for it."""
        key = _key(shard)
        with self._changed:
            while True:
                entry = self._entries.get(key)
                if entry is not None and entry.ready:
                    entry.pins += 1
                    self._entries.move_to_end(key)
                    return entry.path
                if entry is None and self._make_room(shard.byte_size):
                    entry = self._reserve(key, shard.byte_size, pins=1)
                    break
                if entry is None and not self._copying():
                    raise self._full(shard)
                # Our shard or the room for it is being copied: wait for that copy.
                self._changed.wait()
        self._copy(shard, entry)
        return entry.path

    def release(self, shard: ShardInfo) -> None:
        """Unpin `shard` (once per `acquire`)."""
        with self._changed:
            entry = self._entries[_key(shard)]
            if entry.pins < 1:
                raise ValueError(f"shard {shard.url}: released more often than acquired")
            entry.pins -= 1
            self._changed.notify_all()

    def fetch(self, shard: ShardInfo) -> bool:
        """Copy `shard` here ahead of its use, unpinned. False, copying nothing, when the
        shards in use leave no room now (a prefetch must never fail a read)."""
        key = _key(shard)
        with self._changed:
            if key in self._entries:
                return True
            if not self._make_room(shard.byte_size):
                return False
            entry = self._reserve(key, shard.byte_size, pins=0)
        self._copy(shard, entry)
        return True

    def _make_room(self, size: int) -> bool:
        """Evict least recently used unpinned shards until `size` more bytes fit."""
        if size > self.max_bytes:
            raise ValueError(
                f"max_bytes {self.max_bytes}: a shard of {size} bytes cannot fit; raise "
                f"max_bytes to at least {size} or split the shard"
            )
        for key in list(self._entries):
            if self._used + size <= self.max_bytes:
                break
            entry = self._entries[key]
            if entry.ready and entry.pins == 0:
                del self._entries[key]
                self._used -= entry.size
                entry.path.unlink(missing_ok=True)
        return self._used + size <= self.max_bytes

    def _reserve(self, key: str, size: int, pins: int) -> _Entry:
        entry = _Entry(size, self.directory / f"{key}{_COMPLETE}", pins=pins)
        self._entries[key] = entry
        self._used += size
        return entry

    def _copying(self) -> bool:
        return any(not entry.ready for entry in self._entries.values())

    def _full(self, shard: ShardInfo) -> CacheFullError:
        pinned = sum(entry.size for entry in self._entries.values() if entry.pins)
        return CacheFullError(
            f"max_bytes {self.max_bytes}: shards in use hold {pinned} bytes, so shard "
            f"{shard.url} ({shard.byte_size} bytes) does not fit; raise max_bytes to at least "
            f"{pinned + shard.byte_size} (the shards one microbatch spans must fit together)"
        )

    def _copy(self, shard: ShardInfo, entry: _Entry) -> None:
        """Copy `shard` to `entry.path` through a temporary file; on failure give the
        reservation back and raise."""
        partial = entry.path.with_name(f"{entry.path.name}.{threading.get_ident()}{_PARTIAL}")
        try:
            _download(shard, partial)
            os.replace(partial, entry.path)
        except BaseException:
            partial.unlink(missing_ok=True)
            with self._changed:
                del self._entries[_key(shard)]
                self._used -= entry.size
                self._changed.notify_all()
            raise
        with self._changed:
            entry.ready = True
            self._changed.notify_all()

    def _adopt(self) -> None:
        """Take over the complete copies a previous process left (oldest first, so they
        are evicted first) and delete its partial ones."""
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(_PARTIAL):
                path.unlink(missing_ok=True)
            elif path.name.endswith(_COMPLETE) and path.is_file():
                found.append((path.stat().st_mtime_ns, path))
        for _, path in sorted(found):
            size = path.stat().st_size
            if self._make_room_quietly(size):
                entry = self._reserve(path.name.removesuffix(_COMPLETE), size, pins=0)
                entry.ready = True
            else:
                path.unlink(missing_ok=True)

    def _make_room_quietly(self, size: int) -> bool:
        return size <= self.max_bytes and self._make_room(size)


class SampleReader:
    """Samples of `windows` as (x, y) token tensors. Remote shards go through `cache`
    (required when any shard is remote); `prefetch_workers` threads copy ahead."""

    def __init__(
        self,
        windows: Windows,
        cache: ShardCache | None = None,
        *,
        prefetch_workers: int = 2,
        max_open: int = 64,
    ) -> None:
        self.windows = windows
        self.cache = cache
        shards = windows.manifest.shards
        # Mapped where they lie: local shards of the flat formats. The rest are cached.
        self._local = [
            is_local(shard.url) and shard.format not in COLUMNAR_FORMATS for shard in shards
        ]
        remote = [shard for shard, local in zip(shards, self._local, strict=True) if not local]
        if remote and cache is None:
            first = remote[0]
            if first.format in COLUMNAR_FORMATS:
                why = f"a {first.format} shard, converted to a flat token file before it is read"
            else:
                why = "not on local disk"
            raise ValueError(
                f"cache None: shard {first.url} is {why}; pass a ShardCache to copy it into"
            )
        if remote and cache is not None:
            largest = max(remote, key=lambda shard: shard.byte_size)
            if largest.byte_size > cache.max_bytes:
                raise ValueError(
                    f"cache max_bytes {cache.max_bytes}: shard {largest.url} has "
                    f"{largest.byte_size} bytes; raise max_bytes to at least "
                    f"{largest.byte_size} or split the shard"
                )
        self._max_open = max_open
        self._maps: OrderedDict[int, np.memmap[Any, Any]] = OrderedDict()
        self._maps_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=prefetch_workers, thread_name_prefix="pitstop-data-prefetch"
        )
        self._pending: dict[int, concurrent.futures.Future[None]] = {}
        self._pending_lock = threading.Lock()

    def read(self, samples: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 tensors of shape [len(samples), context]: each sample's window,
        its first `context` tokens and its last `context`."""
        span = self.windows.span
        rows = np.empty((len(samples), span), dtype=np.int64)
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for row, sample in enumerate(samples):
            shard, window = self.windows.locate(sample)
            by_shard.setdefault(shard, []).append((row, window))
        for shard, wanted in by_shard.items():
            with self._open(shard) as tokens:
                for row, window in wanted:
                    rows[row] = tokens[window * span : (window + 1) * span]
        x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
        return x, y

    def shards_of(self, samples: Iterable[int]) -> list[int]:
        """The indices of the shards `samples` are in, ascending."""
        return sorted({self.windows.locate(sample)[0] for sample in samples})

    def prefetch(self, shards: Iterable[int]) -> None:
        """Start copying the remote ones of `shards` into the cache, in the given order,
        unless already there or under way. Returns at once."""
        for shard in shards:
            if self._local[shard]:
                continue
            with self._pending_lock:
                if shard in self._pending:
                    continue
                future = self._pool.submit(self._prefetch_one, shard)
                self._pending[shard] = future
            future.add_done_callback(functools.partial(self._forget, shard))

    def wait_for_prefetch(self, timeout: float | None = None) -> bool:
        """Wait until the prefetches started so far are done; False on timeout."""
        with self._pending_lock:
            futures = list(self._pending.values())
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def close(self) -> None:
        """Stop prefetching (queued copies are dropped, running ones finish)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._maps_lock:
            self._maps.clear()

    def __enter__(self) -> SampleReader:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _prefetch_one(self, index: int) -> None:
        assert self.cache is not None  # a remote shard means a cache (checked in __init__)
        shard = self.windows.manifest.shards[index]
        try:
            if not self.cache.fetch(shard):
                logger.debug(
                    "prefetch of %s skipped: the cache is full of shards in use", shard.url
                )
        except Exception:
            # The read that needs the shard copies it again and raises what it meets.
            logger.warning("prefetch of shard %s failed", shard.url, exc_info=True)

    def _forget(self, shard: int, _: concurrent.futures.Future[None]) -> None:
        with self._pending_lock:
            self._pending.pop(shard, None)

    @contextmanager
    def _open(self, index: int) -> Iterator[np.memmap[Any, Any]]:
        """Shard `index`'s tokens; a cached shard stays pinned while the block runs."""
        shard = self.windows.manifest.shards[index]
        if not self._local[index]:
            assert self.cache is not None
            path = self.cache.acquire(shard)
            try:
                yield _map(shard, path)
            finally:
                self.cache.release(shard)
            return
        with self._maps_lock:
            tokens = self._maps.get(index)
            if tokens is None:
                _, path_name = fsspec.core.url_to_fs(shard.url)
                tokens = _map(shard, Path(path_name))
                self._maps[index] = tokens
                # Each map holds a file descriptor: keep only the recently used ones.
                while len(self._maps) > self._max_open:
                    self._maps.popitem(last=False)
            self._maps.move_to_end(index)
        yield tokens


def _map(shard: ShardInfo, path: Path) -> np.memmap[Any, Any]:
    return np.memmap(
        path, dtype=np.dtype(shard.dtype), mode="r", offset=shard.offset, shape=(shard.tokens,)
    )


def _key(shard: ShardInfo) -> str:
    return shard.digest.partition(":")[2] or shard.digest


def _download(shard: ShardInfo, destination: Path) -> None:
    """Copy `shard` to `destination` (a columnar shard: its tokens, as a flat array),
    checking size and digest, flushed to disk."""
    hasher = xxhash.xxh3_128()
    written = 0
    with open(destination, "wb") as target:
        for chunk in _chunks(shard):
            hasher.update(chunk)
            target.write(chunk)
            written += len(chunk)
        target.flush()
        os.fsync(target.fileno())
    digest = f"xxh3_128:{hasher.hexdigest()}"
    if (written, digest) != (shard.byte_size, shard.digest):
        raise ValueError(
            f"shard {shard.url}: read {written} bytes with digest {digest}, the manifest says "
            f"{shard.byte_size} bytes with {shard.digest}; the shard changed since the "
            f"manifest was built: rebuild it with Manifest.build"
        )


def _chunks(shard: ShardInfo) -> Iterator[bytes]:
    """The bytes the cache keeps of `shard`: the file's, or a columnar shard's tokens."""
    if shard.format in COLUMNAR_FORMATS:
        # The digest check in _download catches a wrong column, as it does a changed file.
        yield from token_bytes(shard.url, shard.format, shard.column or DEFAULT_COLUMN)
        return
    with fsspec.open(shard.url, "rb") as source:
        while chunk := source.read(_CHUNK):
            yield chunk
