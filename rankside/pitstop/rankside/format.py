"""The shard layout: the safetensors format, so any safetensors reader loads a shard.

    [8 bytes: N, little-endian u64][N bytes: JSON header, space-padded][raw tensor bytes]

The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the start of the raw bytes) plus "__metadata__": {str: str}. The
padding makes the raw bytes start 8-byte aligned; tensors are laid out largest element
first, so each starts aligned to its own element size with no gaps between them (the
safetensors reader rejects gaps). `plan_tensors` lays the tensors out once for a
training loop, and `TensorPlan.shard` adds each step's metadata to it. Nothing is ever
pickled. Pure: no torch, no I/O.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "C64": 8,
}
"""Element size in bytes of every safetensors dtype a shard may hold."""

METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000
"""The safetensors reader's own limit on the JSON header."""
_LENGTH = struct.Struct("<Q")
_ALIGN = 8


class ShardFormatError(ValueError):
    """Bytes that are not a valid shard, or tensors that cannot be laid out."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to lay out: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit: [begin, end) relative to the data start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ShardLayout:
    """A shard's header and where every tensor goes; `size` is the whole shard's bytes."""

    header: bytes
    entries: tuple[TensorEntry, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        """Offset of the first tensor byte in the shard."""
        return _LENGTH.size + len(self.header)

    @property
    def size(self) -> int:
        """Total bytes of the shard."""
        return self.data_start + (self.entries[-1].end if self.entries else 0)

    def span(self, entry: TensorEntry) -> tuple[int, int]:
        """Absolute [begin, end) of `entry` in the shard."""
        return self.data_start + entry.begin, self.data_start + entry.end

    def entry(self, name: str) -> TensorEntry:
        """The entry called `name`; KeyError if none."""
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(name)


@dataclass(frozen=True)
class TensorPlan:
    """Where every tensor of a shard goes, apart from the metadata: computed once for a
    training loop's tensors (their names, dtypes and shapes do not change from step to
    step) and turned into each step's layout by `shard`, which only encodes the
    metadata."""

    entries: tuple[TensorEntry, ...]
    entries_json: str
    """The header's tensor entries as JSON members, without the enclosing braces."""

    def shard(self, metadata: Mapping[str, str]) -> ShardLayout:
        """The layout of a shard of these tensors and `metadata`: the same bytes as
        `plan_shard` gives."""
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ShardFormatError(f"metadata {key!r}: keys and values must be str")
        members = [self.entries_json] if self.entries_json else []
        if metadata:
            members.insert(0, f'"{METADATA_KEY}":{_compact(dict(metadata))}')
        header = ("{" + ",".join(members) + "}").encode()
        header += b" " * (-(len(header) + _LENGTH.size) % _ALIGN)
        if len(header) > MAX_HEADER_BYTES:
            raise ShardFormatError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
        return ShardLayout(header, self.entries, dict(metadata))


def plan_tensors(tensors: Iterable[TensorSpec]) -> TensorPlan:
    """Lay out `tensors`: largest element first, then by name, with no gaps."""
    specs = list(tensors)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ShardFormatError("tensor names must be unique; a name appears twice")
    for spec in specs:
        _check_spec(spec.name, spec.dtype, spec.shape)
    entries: list[TensorEntry] = []
    offset = 0
    for spec in sorted(specs, key=lambda s: (-DTYPE_SIZES[s.dtype], s.name)):
        entries.append(TensorEntry(spec.name, spec.dtype, spec.shape, offset, offset + spec.nbytes))
        offset += spec.nbytes
    doc = {
        entry.name: {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
        }
        for entry in entries
    }
    return TensorPlan(tuple(entries), _compact(doc)[1:-1])


def plan_shard(tensors: Iterable[TensorSpec], metadata: Mapping[str, str]) -> ShardLayout:
    """Lay out `tensors` and `metadata` as one shard."""
    return plan_tensors(tensors).shard(metadata)


def write_header(layout: ShardLayout, buffer: memoryview) -> None:
    """Write the length prefix and the header of `layout` at the start of `buffer`."""
    _LENGTH.pack_into(buffer, 0, len(layout.header))
    buffer[_LENGTH.size : layout.data_start] = layout.header


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def read_layout(buffer: bytes | memoryview, size: int | None = None) -> ShardLayout:
    """Parse and check the header of the shard in the first `size` bytes of `buffer`
    (all of it by default): every tensor in bounds, contiguous, its bytes matching its
    dtype and shape."""
    size = len(buffer) if size is None else size
    if size < _LENGTH.size or size > len(buffer):
        raise ShardFormatError(f"shard of {size} bytes is too short for a header")
    (length,) = _LENGTH.unpack_from(buffer, 0)
    if length > MAX_HEADER_BYTES or _LENGTH.size + length > size:
        raise ShardFormatError(f"header length {length} does not fit a {size}-byte shard")
    header = bytes(buffer[_LENGTH.size : _LENGTH.size + length])
    try:
        doc = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardFormatError(f"header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ShardFormatError("header is not a JSON object")
    metadata = doc.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ShardFormatError("__metadata__ must map str to str")
    entries = sorted(
        (_plain_entry(name, info) or _entry(name, info) for name, info in doc.items()),
        key=lambda e: e.begin,
    )
    offset = 0
    for entry in entries:
        if entry.begin != offset:
            raise ShardFormatError(f"tensor {entry.name!r} starts at {entry.begin}, not {offset}")
        offset = entry.end
    layout = ShardLayout(header, tuple(entries), metadata)
    if layout.size != size:
        raise ShardFormatError(f"tensors end at byte {layout.size}, the shard has {size}")
    return layout


def _plain_entry(name: str, info: object) -> TensorEntry | None:
    """The entry, when nothing about it is unusual; None sends it to `_entry`, which
    says what is wrong. A daemon checks every sealed shard's header: this path keeps
    that to about a microsecond per tensor."""
    if type(info) is not dict or not name or name == METADATA_KEY:
        return None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or type(shape) is not list or type(offsets) is not list:
        return None
    element = DTYPE_SIZES.get(dtype)
    if element is None:
        return None
    if len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
        return None
    count = 1
    for dimension in shape:
        if type(dimension) is not int or dimension < 0:
            return None
        count *= dimension
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != element * count:
        return None
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _entry(name: str, info: object) -> TensorEntry:
    if not isinstance(info, dict):
        raise ShardFormatError(f"tensor {name!r}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        raise ShardFormatError(f"tensor {name!r}: shape {shape!r} is not a list of ints")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise ShardFormatError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    _check_spec(name, dtype, tuple(shape))
    assert isinstance(dtype, str)
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != DTYPE_SIZES[dtype] * math.prod(shape):
        raise ShardFormatError(f"tensor {name!r}: data_offsets {offsets} do not fit its shape")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_spec(name: object, dtype: object, shape: tuple[int, ...]) -> None:
    if not isinstance(name, str) or not name or name == METADATA_KEY:
        raise ShardFormatError(f"tensor name {name!r}: use a non-empty str, not {METADATA_KEY}")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list is unhashable
        known = ", ".join(DTYPE_SIZES)
        raise ShardFormatError(f"tensor {name!r}: dtype {dtype!r} is not one of {known}")
    if any(d < 0 for d in shape):
        raise ShardFormatError(f"tensor {name!r}: shape {list(shape)} has a negative dimension")
