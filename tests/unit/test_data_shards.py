"""Token shard datasets (pitstop.data.shards): the three formats read as written, the
manifest and its digest, and global sample -> (shard, window)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import fsspec
import numpy as np
import pytest
import xxhash

from kit.megatron import write_megatron
from pitstop.data import Manifest, Windows, describe_shard, read_megatron_index


def test_the_test_writer_writes_megatrons_layout_byte_for_byte(tmp_path: Path) -> None:
    write_megatron(tmp_path / "doc", [[1, 2, 3], [4, 5]])
    expected = (
        b"MMIDIDX\x00\x00"
        + b"\x01\x00\x00\x00\x00\x00\x00\x00"  # version 1
        + b"\x08"  # uint16
        + b"\x02\x00\x00\x00\x00\x00\x00\x00"  # 2 sequences
        + b"\x03\x00\x00\x00\x00\x00\x00\x00"  # 3 document index entries
        + b"\x03\x00\x00\x00\x02\x00\x00\x00"  # sizes 3, 2 (int32)
        + b"\x00" * 8
        + b"\x06\x00\x00\x00\x00\x00\x00\x00"  # pointers 0, 6 bytes (int64)
        + b"\x00" * 8
        + b"\x01\x00\x00\x00\x00\x00\x00\x00"
        + b"\x02\x00\x00\x00\x00\x00\x00\x00"  # document index 0, 1, 2
    )
    assert (tmp_path / "doc.idx").read_bytes() == expected
    assert (tmp_path / "doc.bin").read_bytes() == b"\x01\x00\x02\x00\x03\x00\x04\x00\x05\x00"


@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64", "uint8"])
def test_megatron_reads_back_what_was_written(tmp_path: Path, dtype: str) -> None:
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8, 9], []]
    write_megatron(tmp_path / "corpus_text_document", sequences, dtype)
    index = read_megatron_index(str(tmp_path / "corpus_text_document.idx"))
    assert index.dtype == dtype
    assert index.sizes.tolist() == [3, 2, 4, 0]
    itemsize = np.dtype(dtype).itemsize
    assert index.pointers.tolist() == [0, 3 * itemsize, 5 * itemsize, 9 * itemsize]
    assert index.document_index.tolist() == [0, 1, 2, 3, 4]
    # By prefix, as Megatron names datasets, or by the .bin.
    for url in (tmp_path / "corpus_text_document", tmp_path / "corpus_text_document.bin"):
        shard = describe_shard(str(url), "megatron")
        assert shard.url == str(tmp_path / "corpus_text_document.bin")
        assert (shard.tokens, shard.offset, shard.byte_size) == (9, 0, 9 * itemsize)
        assert shard.dtype == np.dtype(dtype).newbyteorder("<").str


def write_idx(path: Path, magic: bytes, version: int, code: int, sizes: list[int]) -> None:
    pointers = np.concatenate(([0], np.cumsum(sizes[:-1]))).astype("<i8") * 2
    header = magic + struct.pack("<QBQQ", version, code, len(sizes), len(sizes) + 1)
    body = np.asarray(sizes, "<i4").tobytes() + pointers.tobytes()
    path.write_bytes(header + body + np.arange(len(sizes) + 1, dtype="<i8").tobytes())


@pytest.mark.parametrize(
    ("magic", "version", "code", "message"),
    [
        (b"TNTIDX\x00\x00\x00", 1, 8, "does not start with b'MMIDIDX"),
        (b"MMIDIDX\x00\x00", 2, 8, "version 2; only version 1"),
        (b"MMIDIDX\x00\x00", 1, 9, "dtype code 9; known codes"),
        (b"MMIDIDX\x00\x00", 1, 6, "dtype 'float64' of .*token ids must be integers"),
        (b"MMIDIDX\x00\x00", 1, 7, "dtype 'float32' of .*token ids must be integers"),
    ],
)
def test_a_bad_megatron_index_is_refused(
    tmp_path: Path, magic: bytes, version: int, code: int, message: str
) -> None:
    write_idx(tmp_path / "d.idx", magic, version, code, [2, 2])
    (tmp_path / "d.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(ValueError, match=message):
        describe_shard(str(tmp_path / "d"), "megatron")


def test_megatron_truncated_reordered_or_mismatched_is_refused(tmp_path: Path) -> None:
    write_megatron(tmp_path / "d", [[1, 2], [3, 4, 5]])
    whole = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(whole[:-8])
    with pytest.raises(ValueError, match="the file is truncated"):
        describe_shard(str(tmp_path / "d"), "megatron")
    # Pointers swapped: the second sequence first in the .bin.
    sizes_at = 9 + 25
    swapped = bytearray(whole)
    pointers_at = sizes_at + 8
    swapped[pointers_at : pointers_at + 16] = struct.pack("<qq", 6, 0)
    (tmp_path / "d.idx").write_bytes(bytes(swapped))
    with pytest.raises(ValueError, match="not stored back to back in index order"):
        describe_shard(str(tmp_path / "d"), "megatron")
    (tmp_path / "d.idx").write_bytes(whole)
    (tmp_path / "d.bin").write_bytes(b"\x00" * 12)
    with pytest.raises(ValueError, match=r"the \.bin has 12 bytes, the \.idx describes 5"):
        describe_shard(str(tmp_path / "d"), "megatron")


def test_nanogpt_bin_as_prepare_py_writes_it(tmp_path: Path) -> None:
    tokens = np.array([50256, 11, 0, 65535, 7], dtype=np.uint16)
    written = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="w+", shape=tokens.shape)
    written[:] = tokens
    written.flush()
    del written
    shard = describe_shard(str(tmp_path / "train.bin"), "nanogpt")
    assert (shard.format, shard.dtype, shard.offset, shard.tokens, shard.byte_size) == (
        "nanogpt",
        "<u2",
        0,
        5,
        10,
    )
    contents = (tmp_path / "train.bin").read_bytes()
    assert shard.digest == f"xxh3_128:{xxhash.xxh3_128(contents).hexdigest()}"
    with pytest.raises(ValueError, match=r"10 bytes is not a whole number of uint32 tokens"):
        describe_shard(str(tmp_path / "train.bin"), "nanogpt", dtype="uint32")
    with pytest.raises(ValueError, match=r"dtype 'float16' .*token ids must be integers"):
        describe_shard(str(tmp_path / "train.bin"), "nanogpt", dtype="float16")
    with pytest.raises(ValueError, match=r"dtype 'tokens' .*not a NumPy dtype"):
        describe_shard(str(tmp_path / "train.bin"), "nanogpt", dtype="tokens")


@pytest.mark.parametrize("dtype", ["<i4", ">u2", "|u1", "<i8"])
def test_npy_records_its_dtype_and_where_its_tokens_start(tmp_path: Path, dtype: str) -> None:
    tokens = np.arange(40, dtype=dtype)
    np.save(tmp_path / "s.npy", tokens)
    shard = describe_shard(str(tmp_path / "s.npy"), "npy")
    raw = (tmp_path / "s.npy").read_bytes()
    assert (shard.tokens, shard.byte_size) == (40, len(raw))
    assert np.frombuffer(raw, dtype=shard.dtype, offset=shard.offset).tolist() == list(range(40))


def test_npy_that_is_not_a_token_array_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "grid.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(ValueError, match=r"shape \(4, 4\); a token shard is 1-D"):
        describe_shard(str(tmp_path / "grid.npy"), "npy")
    np.save(tmp_path / "f.npy", np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match="token ids must be integers"):
        describe_shard(str(tmp_path / "f.npy"), "npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match=r"not a readable \.npy file"):
        describe_shard(str(tmp_path / "junk.npy"), "npy")
    with pytest.raises(
        ValueError, match="format 'tfrecord': must be one of nanogpt, npy, megatron, parquet, hf"
    ):
        describe_shard(str(tmp_path / "f.npy"), "tfrecord")


def test_the_manifest_digest_names_the_contents_not_the_place(tmp_path: Path) -> None:
    for name, start in (("a.npy", 0), ("b.npy", 100)):
        np.save(tmp_path / name, np.arange(start, start + 50, dtype=np.uint16))
    local = Manifest.build([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")], "npy")
    memory = fsspec.filesystem("memory")
    for name in ("a.npy", "b.npy"):
        memory.pipe(f"/manifest-test/{name}", (tmp_path / name).read_bytes())
    remote = Manifest.build(["memory://manifest-test/a.npy", "memory://manifest-test/b.npy"], "npy")
    assert remote.digest == local.digest
    assert len(local.digest) == 64
    assert local.tokens == 100
    swapped = Manifest.build([str(tmp_path / "b.npy"), str(tmp_path / "a.npy")], "npy")
    assert swapped.digest != local.digest
    np.save(tmp_path / "b.npy", np.arange(100, 150, dtype=np.uint16)[::-1].copy())
    changed = Manifest.build([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")], "npy")
    assert changed.digest != local.digest


def test_the_manifest_round_trips_through_json_and_refuses_an_edit(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(30, dtype=np.int32))
    manifest = Manifest.build([str(tmp_path / "a.npy")], "npy")
    loaded = Manifest.from_json(manifest.to_json())
    assert loaded.shards == manifest.shards
    assert loaded.digest == manifest.digest
    edited = manifest.to_json().replace('"tokens": 30', '"tokens": 31')
    with pytest.raises(ValueError, match=r"it was edited, rebuild it with Manifest\.build"):
        Manifest.from_json(edited)
    with pytest.raises(ValueError, match=r"shards \[\]: a manifest needs at least one shard"):
        Manifest([])


def manifest_of(tmp_path: Path, token_counts: Sequence[int]) -> Manifest:
    urls = []
    for number, count in enumerate(token_counts):
        path = tmp_path / f"shard{number}.bin"
        np.arange(count, dtype=np.uint16).tofile(path)
        urls.append(str(path))
    return Manifest.build(urls, "nanogpt")


def test_windows_are_context_plus_one_at_that_stride_and_tails_are_dropped(
    tmp_path: Path,
) -> None:
    # context 4: windows of 5 tokens. 12 tokens -> 2 windows (2 dropped), 4 -> none,
    # 15 -> 3, 0 -> none, 5 -> 1.
    windows = Windows(manifest_of(tmp_path, [12, 4, 15, 0, 5]), context=4)
    assert windows.shard_windows == [2, 0, 3, 0, 1]
    assert windows.samples == 6
    located = [windows.locate(sample) for sample in range(6)]
    assert located == [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2), (4, 0)]


@pytest.mark.parametrize(
    ("context", "sample", "message"),
    [
        (0, 0, "context 0: must be an integer >= 1"),
        (12, 0, r"context 12: no shard holds a window of 13 tokens \(the longest has 12\)"),
        (4, 2, r"sample 2: must be in 0\.\.1"),
        (4, -1, r"sample -1: must be in 0\.\.1"),
    ],
)
def test_bad_windows_are_refused(tmp_path: Path, context: int, sample: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Windows(manifest_of(tmp_path, [12]), context=context).locate(sample)
