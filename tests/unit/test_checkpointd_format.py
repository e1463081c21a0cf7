"""The shard layout (pitstop.rankside.format): safetensors-readable, aligned, checked."""

from __future__ import annotations

import ctypes
import json
import math
import struct
from pathlib import Path

import pytest
import safetensors
from hypothesis import example, given
from hypothesis import strategies as st

from kit.fuzzing import FUZZ_TIMEOUT, fuzz_settings
from pitstop.rankside.format import (
    DTYPE_SIZES,
    ShardFormatError,
    TensorSpec,
    plan_shard,
    plan_tensors,
    read_layout,
    write_header,
)

SPECS = [
    TensorSpec("model.weight", "F32", (3, 5)),
    TensorSpec("model.bias", "BF16", (5,)),
    TensorSpec("optim.step", "I64", ()),
    TensorSpec("rng.torch", "U8", (13,)),
    TensorSpec("flags", "BOOL", (3,)),
    TensorSpec("empty", "F16", (0, 4)),
]
METADATA = {"pitstop.step": "7", "cursor": "epoch=1,batch=42"}


def build(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """A shard whose tensor bytes are a recognisable pattern (each byte: its offset)."""
    layout = plan_shard(specs, metadata)
    buffer = bytearray(layout.size)
    write_header(layout, memoryview(buffer))
    for offset in range(layout.data_start, layout.size):
        buffer[offset] = offset % 251
    return bytes(buffer)


def test_safetensors_reads_a_shard() -> None:
    shard = build(SPECS, METADATA)
    layout = read_layout(shard)
    loaded = dict(safetensors.deserialize(shard))
    assert set(loaded) == {spec.name for spec in SPECS}
    for spec in SPECS:
        begin, end = layout.span(layout.entry(spec.name))
        assert loaded[spec.name]["dtype"] == spec.dtype
        assert tuple(loaded[spec.name]["shape"]) == spec.shape
        assert bytes(loaded[spec.name]["data"]) == shard[begin:end]


def test_safetensors_reads_a_shard_file_with_its_metadata(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    path = tmp_path / "shard.safetensors"
    path.write_bytes(build(SPECS, METADATA))
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == METADATA
        weight = file.get_tensor("model.weight")
        assert weight.dtype == torch.float32
        assert tuple(weight.shape) == (3, 5)
        assert file.get_tensor("model.bias").dtype == torch.bfloat16


def _safetensors_serialize(tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """safetensors' own writer, over raw bytes (its API changed in 0.7)."""
    if not hasattr(safetensors, "TensorSpec"):
        raw = {n: {"dtype": d, "shape": s, "data": b} for n, (d, s, b) in tensors.items()}
        return bytes(safetensors.serialize(raw, metadata={"k": "v"}))
    buffers = {
        name: ctypes.create_string_buffer(data, len(data)) for name, (_, _, data) in tensors.items()
    }
    specs = {
        name: safetensors.TensorSpec(
            dtype=dtype, shape=shape, data_ptr=ctypes.addressof(buffers[name]), data_len=len(data)
        )
        for name, (dtype, shape, data) in tensors.items()
    }
    return bytes(safetensors.serialize(specs, metadata={"k": "v"}))


def test_a_safetensors_file_reads_as_a_shard() -> None:
    new_api = hasattr(safetensors, "TensorSpec")
    data = _safetensors_serialize(
        {
            "a": ("float32" if new_api else "F32", [2, 2], bytes(range(16))),
            "b": ("int8" if new_api else "I8", [3], b"\x01\x02\x03"),
        }
    )
    layout = read_layout(data)
    assert layout.metadata == {"k": "v"}
    assert layout.entry("a").shape == (2, 2)
    assert layout.entry("b").dtype == "I8"
    begin, end = layout.span(layout.entry("a"))
    assert data[begin:end] == bytes(range(16))


def test_layout_is_aligned_and_gapless() -> None:
    layout = plan_shard(SPECS, METADATA)
    assert layout.data_start % 8 == 0
    offset = 0
    for entry in layout.entries:
        assert entry.begin == offset
        assert (layout.data_start + entry.begin) % DTYPE_SIZES[entry.dtype] == 0
        offset = entry.end
    assert layout.size == layout.data_start + offset


def test_round_trip_keeps_entries_and_metadata() -> None:
    shard = build(SPECS, METADATA)
    planned, parsed = plan_shard(SPECS, METADATA), read_layout(shard)
    assert parsed.entries == planned.entries
    assert parsed.metadata == METADATA
    assert parsed.size == len(shard)


@pytest.mark.parametrize(
    "metadata", [{}, METADATA, {"pitstop.step": "8", "user.note": 'quote " and \u00e9'}]
)
def test_one_tensor_plan_serves_every_step_s_metadata(metadata: dict[str, str]) -> None:
    """A loop plans its tensors once; each step's shard is the one safetensors would
    write for that step's metadata."""
    plan = plan_tensors(SPECS)
    layout = plan.shard(metadata)
    assert layout.header == plan_shard(SPECS, metadata).header
    doc = {"__metadata__": metadata} if metadata else {}
    doc |= {
        e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        for e in layout.entries
    }
    assert layout.header.rstrip(b" ") == json.dumps(doc, separators=(",", ":")).encode()
    buffer = bytearray(layout.size)
    write_header(layout, memoryview(buffer))
    parsed = read_layout(bytes(buffer))
    assert parsed.entries == layout.entries
    assert parsed.metadata == metadata
    assert dict(safetensors.deserialize(bytes(buffer))).keys() == {s.name for s in SPECS}


def test_a_shard_in_a_larger_slot_reads_with_its_size() -> None:
    shard = build(SPECS, METADATA)
    slot = shard + b"\xff" * 100
    assert read_layout(slot, len(shard)).size == len(shard)
    with pytest.raises(ShardFormatError, match="tensors end at byte"):
        read_layout(slot)


def _header(doc: object) -> bytes:
    raw = json.dumps(doc).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 10**9) + b"{}", "does not fit"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 3) + b"{x}", "not JSON"),
        (_header({"__metadata__": {"a": 1}}), "must map str to str"),
        (_header({"t": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}), "F99"),
        (_header({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}), "do not fit"),
        (_header({"t": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}), "shape"),
        (_header({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}), "data_offsets"),
        (_header({"t": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}) + b"ab", "starts"),
        (_header({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}) + b"ab", "end"),
        (_header({"t": 5}), "not an object"),
        # Found by the slot fuzzer: a dtype that is not a str (a list cannot be hashed).
        (_header({"w": {"shape": [], "dtype": [], "data_offsets": [0, 0]}}), "dtype"),
        (_header({"w": {"shape": [], "dtype": {}, "data_offsets": [0, 0]}}), "dtype"),
    ],
)
def test_invalid_shards_are_refused(shard: bytes, message: str) -> None:
    with pytest.raises(ShardFormatError, match=message):
        read_layout(shard)


@pytest.mark.parametrize(
    ("specs", "metadata", "message"),
    [
        ([TensorSpec("a", "F32", (1,)), TensorSpec("a", "F32", (1,))], {}, "unique"),
        ([TensorSpec("", "F32", (1,))], {}, "non-empty"),
        ([TensorSpec("__metadata__", "F32", (1,))], {}, "non-empty"),
        ([TensorSpec("a", "float", (1,))], {}, "dtype 'float'"),
        ([TensorSpec("a", "F32", (-1,))], {}, "negative"),
        ([TensorSpec("a", "F32", (1,))], {"step": 3}, "must be str"),
    ],
)
def test_bad_tensors_cannot_be_planned(
    specs: list[TensorSpec], metadata: dict[str, str], message: str
) -> None:
    with pytest.raises(ShardFormatError, match=message):
        plan_shard(specs, metadata)


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)
_specs = st.dictionaries(
    _names.filter(lambda n: n != "__metadata__"),
    st.tuples(st.sampled_from(sorted(DTYPE_SIZES)), st.lists(st.integers(0, 5), max_size=3)),
    max_size=6,
)


@given(specs=_specs, metadata=st.dictionaries(_names, st.text(max_size=10), max_size=3))
def test_any_layout_round_trips_through_safetensors(
    specs: dict[str, tuple[str, list[int]]], metadata: dict[str, str]
) -> None:
    planned = [TensorSpec(name, dtype, tuple(shape)) for name, (dtype, shape) in specs.items()]
    shard = build(planned, metadata)
    layout = read_layout(shard)
    assert {e.name: (e.dtype, e.shape) for e in layout.entries} == {
        s.name: (s.dtype, s.shape) for s in planned
    }
    assert layout.data_start % 8 == 0
    assert all((layout.data_start + e.begin) % DTYPE_SIZES[e.dtype] == 0 for e in layout.entries)
    loaded = dict(safetensors.deserialize(shard))
    for spec in planned:
        assert len(loaded[spec.name]["data"]) == DTYPE_SIZES[spec.dtype] * math.prod(spec.shape)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=10,
)
_infos = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(sorted(DTYPE_SIZES)) | _json,
        "shape": st.lists(st.integers(-2, 2**40), max_size=3) | _json,
        "data_offsets": st.lists(st.integers(-4, 2**40), min_size=2, max_size=2) | _json,
    },
)
_docs = st.dictionaries(
    st.sampled_from(["w", "b", "__metadata__", ""]) | st.text(max_size=4),
    _infos | _json,
    max_size=4,
)


@FUZZ_TIMEOUT
@fuzz_settings(300)
@given(doc=_docs, length=st.none() | st.integers(0, 2**64 - 1), tail=st.binary(max_size=64))
@example(doc={"w": {"shape": [], "dtype": [], "data_offsets": [0, 0]}}, length=None, tail=b"")
@example(
    doc={"w": {"shape": [True], "dtype": "U8", "data_offsets": [0, 1]}}, length=None, tail=b"x"
)
@example(doc={"__metadata__": [["a", "b"]]}, length=None, tail=b"")
def test_any_header_is_read_or_refused_as_a_format_error(
    doc: dict[str, object], length: int | None, tail: bytes
) -> None:
    """The bytes of a slot are the rank's to write: whatever they hold, reading them
    gives a layout or a ShardFormatError, never another exception (which the daemon
    could only answer as INTERNAL)."""
    raw = json.dumps(doc).encode()
    shard = struct.pack("<Q", len(raw) if length is None else length) + raw + tail
    try:
        layout = read_layout(shard)
    except ShardFormatError:
        return
    assert layout.size == len(shard)
