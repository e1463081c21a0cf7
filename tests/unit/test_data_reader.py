"""Reading samples (pitstop.data.reader, pitstop.data.replica): the right tokens from
every format and place, a shard cache that keeps its limit and never reads a partial
copy, prefetch of a replica's own shards only, and the same tokens per step at any dp."""

from __future__ import annotations

import hashlib
import io
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from kit.megatron import write_megatron
from pitstop.data import (
    CacheFullError,
    Cursor,
    Manifest,
    ReplicaBatches,
    SampleOrder,
    SampleReader,
    ShardCache,
    Windows,
    is_local,
)

CONTEXT = 7  # windows of 8 tokens
SPAN = CONTEXT + 1


class CountedFS(MemoryFileSystem):
    """An in-memory filesystem that records every file opened for reading, and can
    break the next copy midway (half the bytes, then a lost connection)."""

    protocol = "counted"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    opened: ClassVar[list[str]] = []
    break_next_read: ClassVar[bool] = False
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return super()._strip_protocol(str(path).removeprefix("counted://"))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" not in mode:
            return super()._open(path, mode, **kwargs)
        stripped = self._strip_protocol(path)
        with CountedFS.lock:
            CountedFS.opened.append(stripped)
            broken, CountedFS.break_next_read = CountedFS.break_next_read, False
        if broken:
            return _DyingFile(bytes(self.store[stripped].getbuffer()))
        return super()._open(path, mode, **kwargs)


class _DyingFile(io.BytesIO):
    """Gives half its bytes, then fails as a dropped connection would."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data[: len(data) // 2])
        self._served = False

    def read(self, size: int | None = -1) -> bytes:
        if self._served:
            raise ConnectionResetError("connection reset by peer")
        self._served = True
        return super().read(size)


@pytest.fixture
def counted() -> Iterator[type[CountedFS]]:
    fsspec.register_implementation("counted", CountedFS, clobber=True)
    CountedFS.store.clear()
    CountedFS.opened.clear()
    CountedFS.break_next_read = False
    yield CountedFS
    CountedFS.store.clear()


def shard_tokens(shard: int, windows: int) -> np.ndarray[Any, Any]:
    """Shard `shard`'s tokens: shard*1000 + position, so each token says where it is."""
    return (shard * 1000 + np.arange(windows * SPAN + 3)).astype(np.uint16)  # +3: a tail


def expected_rows(samples: list[int], windows_per_shard: int) -> np.ndarray[Any, Any]:
    rows = []
    for sample in samples:
        shard, window = divmod(sample, windows_per_shard)
        rows.append(shard * 1000 + window * SPAN + np.arange(SPAN))
    return np.array(rows, dtype=np.int64)


def remote_manifest(counted: type[CountedFS], shards: int, windows_per_shard: int) -> Manifest:
    filesystem = counted()
    for shard in range(shards):
        filesystem.pipe(f"/corpus/{shard}.bin", shard_tokens(shard, windows_per_shard).tobytes())
    manifest = Manifest.build([f"counted://corpus/{s}.bin" for s in range(shards)], "nanogpt")
    counted.opened.clear()  # building it read every shard; count only what reading does
    return manifest


def cached_files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.is_file())


def test_every_format_gives_the_same_windows_as_inputs_and_shifted_targets(
    tmp_path: Path,
) -> None:
    urls: dict[str, list[str]] = {"nanogpt": [], "npy": [], "megatron": []}
    for shard in range(3):
        tokens = shard_tokens(shard, 4)
        tokens.tofile(tmp_path / f"{shard}.bin")
        urls["nanogpt"].append(str(tmp_path / f"{shard}.bin"))
        np.save(tmp_path / f"{shard}.npy", tokens.astype(np.int32))
        urls["npy"].append(f"file://{tmp_path / f'{shard}.npy'}")
        write_megatron(tmp_path / f"m{shard}", [tokens[:5].tolist(), tokens[5:].tolist()])
        urls["megatron"].append(str(tmp_path / f"m{shard}"))
    samples = [11, 0, 5, 4, 3, 8]
    rows = expected_rows(samples, 4)
    for format_name, shard_urls in urls.items():
        windows = Windows(Manifest.build(shard_urls, format_name), CONTEXT)
        assert windows.samples == 12
        with SampleReader(windows) as reader:
            x, y = reader.read(samples)
        assert x.dtype == y.dtype == torch.int64, format_name
        assert x.shape == y.shape == (6, CONTEXT), format_name
        assert x.tolist() == rows[:, :-1].tolist(), format_name
        assert y.tolist() == rows[:, 1:].tolist(), format_name


def test_local_shards_are_mapped_where_they_lie_not_copied(tmp_path: Path) -> None:
    shard_tokens(0, 5).tofile(tmp_path / "0.bin")
    assert is_local(str(tmp_path / "0.bin"))
    assert is_local(f"file://{tmp_path / '0.bin'}")
    assert not is_local("memory://corpus/0.bin")
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    manifest = Manifest.build([f"file://{tmp_path / '0.bin'}"], "nanogpt")
    with SampleReader(Windows(manifest, CONTEXT), cache) as reader:
        x, _ = reader.read([4, 0])
    assert x[0, 0] == 4 * SPAN
    assert cached_files(tmp_path / "cache") == []
    assert cache.used_bytes == 0


def test_remote_shards_are_copied_once_and_the_least_recently_used_evicted(
    tmp_path: Path, counted: type[CountedFS]
) -> None:
    manifest = remote_manifest(counted, shards=4, windows_per_shard=2)
    size = manifest.shards[0].byte_size
    cache = ShardCache(tmp_path / "cache", max_bytes=2 * size)
    with SampleReader(Windows(manifest, CONTEXT), cache) as reader:
        for sample in (0, 2, 1, 4):  # shards 0, 1, 0, 2: shard 1 is the least recent
            x, _ = reader.read([sample])
            assert x.tolist() == expected_rows([sample], 2)[:, :-1].tolist()
            assert sum(p.stat().st_size for p in cached_files(tmp_path / "cache")) <= 2 * size
            assert cache.used_bytes <= 2 * size
        assert counted.opened == ["/corpus/0.bin", "/corpus/1.bin", "/corpus/2.bin"]
        reader.read([0])  # still here
        reader.read([3])  # evicted: copied again
    assert counted.opened[3:] == ["/corpus/1.bin"]
    assert len(cached_files(tmp_path / "cache")) == 2


def test_a_shard_larger_than_the_cache_is_refused_up_front(
    tmp_path: Path, counted: type[CountedFS]
) -> None:
    manifest = remote_manifest(counted, shards=2, windows_per_shard=3)
    size = manifest.shards[0].byte_size
    cache = ShardCache(tmp_path / "cache", max_bytes=size - 1)
    with pytest.raises(ValueError, match=f"cache max_bytes {size - 1}: shard .* has {size} bytes"):
        SampleReader(Windows(manifest, CONTEXT), cache)
    with pytest.raises(ValueError, match=f"raise max_bytes to at least {size}"):
        cache.acquire(manifest.shards[0])
    with pytest.raises(ValueError, match=r"cache None: shard counted://corpus/0\.bin is not on"):
        SampleReader(Windows(manifest, CONTEXT))
    with pytest.raises(ValueError, match="max_bytes 0: must be an integer >= 1"):
        ShardCache(tmp_path / "other", max_bytes=0)


def test_a_shard_in_use_is_never_evicted(tmp_path: Path, counted: type[CountedFS]) -> None:
    manifest = remote_manifest(counted, shards=2, windows_per_shard=2)
    first, second = manifest.shards
    cache = ShardCache(tmp_path / "cache", max_bytes=first.byte_size)
    path = cache.acquire(first)
    with pytest.raises(CacheFullError, match=r"raise max_bytes to at least \d+"):
        cache.acquire(second)
    assert path.read_bytes() == shard_tokens(0, 2).tobytes()
    cache.release(first)
    assert cache.acquire(second).read_bytes() == shard_tokens(1, 2).tobytes()
    assert not path.exists()
    cache.release(second)


def test_a_copy_that_dies_midway_is_never_used(tmp_path: Path, counted: type[CountedFS]) -> None:
    manifest = remote_manifest(counted, shards=1, windows_per_shard=4)
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    with SampleReader(Windows(manifest, CONTEXT), cache) as reader:
        counted.break_next_read = True
        with pytest.raises(ConnectionResetError):
            reader.read([3])
        assert cached_files(tmp_path / "cache") == []
        assert cache.used_bytes == 0
        x, _ = reader.read([3])
    assert x.tolist() == expected_rows([3], 4)[:, :-1].tolist()
    assert counted.opened == ["/corpus/0.bin", "/corpus/0.bin"]


def test_a_shard_that_changed_since_the_manifest_is_refused(
    tmp_path: Path, counted: type[CountedFS]
) -> None:
    manifest = remote_manifest(counted, shards=1, windows_per_shard=4)
    counted().pipe("/corpus/0.bin", shard_tokens(5, 4).tobytes())  # same size, new tokens
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    with (
        SampleReader(Windows(manifest, CONTEXT), cache) as reader,
        pytest.raises(ValueError, match="the shard changed since the manifest was built"),
    ):
        reader.read([0])
    assert cached_files(tmp_path / "cache") == []


def test_a_restarted_process_keeps_complete_copies_and_drops_partial_ones(
    tmp_path: Path, counted: type[CountedFS]
) -> None:
    manifest = remote_manifest(counted, shards=2, windows_per_shard=2)
    first = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    with SampleReader(Windows(manifest, CONTEXT), first) as reader:
        reader.read([0])
    [complete] = cached_files(tmp_path / "cache")
    leftover = tmp_path / "cache" / "0123abcd.tokens.140.partial"
    leftover.write_bytes(b"half a shard")
    counted.opened.clear()
    second = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    assert not leftover.exists()
    assert second.used_bytes == complete.stat().st_size
    with SampleReader(Windows(manifest, CONTEXT), second) as reader:
        x, _ = reader.read([1])
    assert x.tolist() == expected_rows([1], 2)[:, :-1].tolist()
    assert counted.opened == []


@pytest.mark.parametrize(("dp", "replica"), [(3, 0), (3, 1), (4, 3), (1, 0)])
def test_prefetch_copies_only_the_shards_of_the_replicas_own_samples(
    tmp_path: Path, counted: type[CountedFS], dp: int, replica: int
) -> None:
    # One window per shard: each sample is its own shard, so shards name samples.
    manifest = remote_manifest(counted, shards=48, windows_per_shard=1)
    order = SampleOrder(samples=48, global_batch=12, microbatch_size=2, seed=3)
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    with SampleReader(Windows(manifest, CONTEXT), cache) as reader:
        batches = ReplicaBatches(order, reader, dp, replica, prefetch_steps=1)
        read = [microbatch.index for microbatch in batches.microbatches(0)]
        assert reader.wait_for_prefetch(timeout=30)
    assert read == order.replica_microbatches(dp, replica)
    own = {
        f"/corpus/{sample}.bin"
        for step in (0, 1)
        for m in order.replica_microbatches(dp, replica)
        for sample in order.microbatch_samples(step, m)
    }
    copies = Counter(counted.opened)
    assert set(copies) == own
    assert set(copies.values()) == {1}, "a shard was copied twice"


def run_tokens(manifest: Manifest, cache: ShardCache, plan: list[tuple[int, int]]) -> list[str]:
    """sha256 of each step's tokens (x then y, microbatches in index order) of a run that
    trains `steps` steps at each (dp, steps) of `plan`, every replica reading through its
    own ReplicaBatches, restarting from the saved cursor at every change."""
    windows = Windows(manifest, CONTEXT)
    digests: list[str] = []
    state: dict[str, int] | None = None
    for dp, steps in plan:
        order = SampleOrder(windows.samples, global_batch=8, microbatch_size=2, seed=21)
        cursor = Cursor(order)
        if state is not None:
            cursor.load_state_dict(state)
        with SampleReader(windows, cache) as reader:
            replicas = [ReplicaBatches(order, reader, dp, r) for r in range(dp)]
            for _ in range(steps):
                by_index = {mb.index: mb for r in replicas for mb in r.microbatches(cursor.step)}
                x = torch.cat([by_index[m].x for m in sorted(by_index)])
                y = torch.cat([by_index[m].y for m in sorted(by_index)])
                raw = x.numpy().tobytes() + y.numpy().tobytes()
                digests.append(hashlib.sha256(raw).hexdigest())
                cursor.advance()
        state = cursor.state_dict()
    return digests


def test_a_run_switching_dp_reads_the_same_tokens_every_step(
    tmp_path: Path, counted: type[CountedFS]
) -> None:
    manifest = remote_manifest(counted, shards=6, windows_per_shard=5)  # 30 samples
    cache = ShardCache(tmp_path / "cache", max_bytes=1 << 20)
    steady = run_tokens(manifest, cache, [(4, 12)])  # 3 steps per epoch: 4 epochs
    assert run_tokens(manifest, cache, [(4, 2), (3, 4), (2, 3), (4, 3)]) == steady
    order = SampleOrder(30, 8, 2, seed=21)
    for step in (0, 7, 11):
        rows = expected_rows(order.step_samples(step), 5)
        raw = rows[:, :-1].tobytes() + rows[:, 1:].tobytes()
        assert steady[step] == hashlib.sha256(raw).hexdigest()


def test_replica_batches_refuse_an_order_of_another_dataset(tmp_path: Path) -> None:
    shard_tokens(0, 5).tofile(tmp_path / "0.bin")
    windows = Windows(Manifest.build([str(tmp_path / "0.bin")], "nanogpt"), CONTEXT)
    with SampleReader(windows) as reader:
        with pytest.raises(ValueError, match="order samples 6: the reader's shards hold 5"):
            ReplicaBatches(SampleOrder(6, 2, 1), reader, 1, 0)
        with pytest.raises(ValueError, match=r"dp 3: must be in 1\.\.2"):
            ReplicaBatches(SampleOrder(5, 2, 1), reader, 3, 0)
        with pytest.raises(ValueError, match="position 1: replica 0 of dp 2 has 1 microbatches"):
            ReplicaBatches(SampleOrder(5, 2, 1), reader, 2, 0).microbatch(0, 1)
