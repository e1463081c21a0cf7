"""Token shard datasets: the files a corpus is in, described once, cut into samples.

A dataset is an ordered list of shard files, each one flat stream of token ids, in one
of the formats users already have:

- ``nanogpt``: a headerless binary of tokens, as nanoGPT's prepare.py writes `train.bin`
  with np.memmap (uint16 by default; uint32 for vocabularies over 65,535).
- ``npy``: a 1-D NumPy array of any integer dtype; the tokens start after its header.
- ``megatron``: a Megatron-LM indexed dataset, `<prefix>.bin` with its `<prefix>.idx`
  (MMapIndexedDataset, index version 1). The sequences lie back to back in the .bin, and
  their concatenation (sum of the index's sizes) is the token stream; document
  boundaries are not used.
- ``parquet``: a Parquet file whose column (``input_ids`` by default) holds a list of
  token ids per row; the rows, concatenated, are the stream.
- ``hf``: a dataset as Hugging Face's ``Dataset.save_to_disk`` writes it. The directory's
  Arrow files (listed in its state.json) are its shards, in order, each read as a
  ``parquet`` file is. See `pitstop.data.arrow` for both.

A `Manifest` lists the shards in order, each with its byte size, dtype, token count and
a content digest (xxh3-128 of the token file's bytes; for ``parquet`` and ``hf``, of the
tokens as a flat array), and has one digest for the experiment record. That digest names
the data, not where it lies: it leaves the URLs (and the column name) out, so a corpus
copied from disk to object storage keeps its digest.

`Windows` cuts the streams into samples. Sample i is a window of context + 1 tokens (the
input and, shifted by one, the target). Windows are laid at stride context + 1 within
each shard (nanoGPT's shape, without its random offsets), so they never overlap and the
last token of a window is a target only; a shard's tail of fewer than context + 1 tokens
and windows across shard boundaries are not used. Samples are numbered shard by shard:
global sample i is found by bisecting the cumulative window counts.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from typing import Any

import fsspec
import numpy as np
import xxhash

from pitstop.data.arrow import (
    COLUMNAR_FORMATS,
    DEFAULT_COLUMN,
    describe_columnar,
    hf_data_files,
)

FORMATS = ("nanogpt", "npy", "megatron", *COLUMNAR_FORMATS)
# Where a shard lies, not what it holds: left out of the manifest's digest.
_PLACE = ("url", "column")

# Megatron-LM's MMapIndexedDataset index (megatron/core/datasets/indexed_dataset.py).
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_DTYPES: dict[int, str] = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
_HEADER = struct.Struct("<9sQBQQ")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ShardInfo:
    """One shard: where it is, how to read it, and what it holds.

    `dtype` is a NumPy dtype string with its byte order (``"<u2"``). `offset` is the byte
    where the tokens start in the file at `url` (an .npy header's length, else 0).
    `digest` is ``"xxh3_128:<hex>"`` of the file's bytes (for Megatron, of the .bin).

    A ``parquet`` or ``hf`` shard is converted to a flat token array before it is read:
    its `byte_size` and `digest` are that array's (tokens times the dtype's size), its
    `offset` 0, and `column` names the column its tokens are in (None for the others)."""

    url: str
    format: str
    dtype: str
    offset: int
    tokens: int
    byte_size: int
    digest: str
    column: str | None = None


@dataclass(frozen=True)
class MegatronIndex:
    """A Megatron .idx file's contents."""

    dtype: str
    sizes: np.ndarray[Any, np.dtype[np.int32]]
    pointers: np.ndarray[Any, np.dtype[np.int64]]
    document_index: np.ndarray[Any, np.dtype[np.int64]]


def read_megatron_index(url: str) -> MegatronIndex:
    """Parse the Megatron index at `url` (local path or fsspec URL). Raises ValueError on
    anything but a version-1 MMapIndexedDataset index."""
    with fsspec.open(url, "rb") as file:
        raw: bytes = file.read()
    if len(raw) < _HEADER.size or raw[:9] != MEGATRON_MAGIC:
        raise ValueError(
            f"Megatron index {url}: does not start with {MEGATRON_MAGIC!r}; pass the .idx "
            f"of an MMapIndexedDataset (Megatron-LM's preprocess_data.py writes one)"
        )
    _, version, code, sequences, documents = _HEADER.unpack_from(raw)
    if version != MEGATRON_VERSION:
        raise ValueError(
            f"Megatron index {url}: version {version}; only version {MEGATRON_VERSION} is read"
        )
    if code not in MEGATRON_DTYPES:
        raise ValueError(
            f"Megatron index {url}: dtype code {code}; known codes are "
            f"{sorted(MEGATRON_DTYPES)}; the file is not an MMapIndexedDataset index"
        )
    position = _HEADER.size
    needed = position + 4 * sequences + 8 * sequences + 8 * documents
    if len(raw) < needed:
        raise ValueError(
            f"Megatron index {url}: {len(raw)} bytes, its header promises {needed} "
            f"({sequences} sequences, {documents} documents); the file is truncated"
        )
    sizes = np.frombuffer(raw, dtype="<i4", count=sequences, offset=position)
    position += 4 * sequences
    pointers = np.frombuffer(raw, dtype="<i8", count=sequences, offset=position)
    position += 8 * sequences
    document_index = np.frombuffer(raw, dtype="<i8", count=documents, offset=position)
    return MegatronIndex(MEGATRON_DTYPES[code], sizes, pointers, document_index)


def describe_shard(
    url: str, format: str, dtype: str = "uint16", column: str = DEFAULT_COLUMN
) -> ShardInfo:
    """Read `url`'s header (or index) and bytes into a ShardInfo. `dtype` is used by the
    ``nanogpt`` format only; the others record their own. For ``megatron`` `url` is the
    .bin or the common prefix of the .bin and .idx. `column` is the token column of a
    ``parquet`` file or of an ``hf`` dataset's .arrow file (`Manifest.build` takes the
    dataset's directory and lists these)."""
    if format == "hf" and _is_directory(url):
        raise ValueError(
            f"hf shard {url}: a directory; a shard is one of a dataset's .arrow files, so "
            f"pass the directory to Manifest.build, which lists them from its state.json"
        )
    if format in COLUMNAR_FORMATS:
        token_dtype, tokens, digest = describe_columnar(url, format, column)
        size = tokens * token_dtype.itemsize
        return ShardInfo(url, format, token_dtype.str, 0, tokens, size, digest, column)
    if format == "nanogpt":
        token_dtype = _token_dtype(dtype, url)
        size = _byte_size(url)
        if size % token_dtype.itemsize:
            raise ValueError(
                f"shard {url}: {size} bytes is not a whole number of {token_dtype.name} "
                f"tokens; pass the dtype it was written with (nanoGPT: uint16, or uint32)"
            )
        return _shard(url, format, token_dtype, 0, size // token_dtype.itemsize, size)
    if format == "npy":
        token_dtype, offset, tokens = _npy_layout(url)
        return _shard(url, format, token_dtype, offset, tokens, _byte_size(url))
    if format == "megatron":
        prefix = url.removesuffix(".bin")
        index = read_megatron_index(prefix + ".idx")
        token_dtype = _token_dtype(index.dtype, prefix + ".idx")
        tokens = int(index.sizes.sum())
        # The stream is the .bin read front to back, so the sequences must lie there in
        # index order with nothing between them (Megatron's builder writes them so).
        starts = np.concatenate(([0], np.cumsum(index.sizes[:-1], dtype=np.int64)))
        if not np.array_equal(index.pointers, starts * token_dtype.itemsize):
            raise ValueError(
                f"Megatron index {prefix}.idx: its sequences are not stored back to back in "
                f"index order; rewrite the dataset with Megatron's IndexedDatasetBuilder"
            )
        size = _byte_size(prefix + ".bin")
        if size != tokens * token_dtype.itemsize:
            raise ValueError(
                f"Megatron dataset {prefix}: the .bin has {size} bytes, the .idx describes "
                f"{tokens} {token_dtype.name} tokens ({tokens * token_dtype.itemsize} bytes); "
                f"pass a .bin and .idx written together"
            )
        return _shard(prefix + ".bin", format, token_dtype, 0, tokens, size)
    raise ValueError(f"format {format!r}: must be one of {', '.join(FORMATS)}")


class Manifest:
    """The ordered shards of a dataset. `digest` names its contents for the record."""

    def __init__(self, shards: Sequence[ShardInfo]) -> None:
        if not shards:
            raise ValueError("shards []: a manifest needs at least one shard")
        self.shards: tuple[ShardInfo, ...] = tuple(shards)

    @classmethod
    def build(
        cls, urls: Sequence[str], format: str, dtype: str = "uint16", column: str = DEFAULT_COLUMN
    ) -> Manifest:
        """Describe every shard in `urls`, in that order (reads each file once). For
        ``hf`` each URL is a save_to_disk directory, and its Arrow files are its shards."""
        if format == "hf":
            urls = [file for url in urls for file in hf_data_files(url)]
        return cls([describe_shard(url, format, dtype, column) for url in urls])

    @property
    def digest(self) -> str:
        """sha256 (hex) of the shards' descriptions in order, URLs and columns left out."""
        described = [
            {key: value for key, value in asdict(shard).items() if key not in _PLACE}
            for shard in self.shards
        ]
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()

    @property
    def tokens(self) -> int:
        """Tokens in all shards."""
        return sum(shard.tokens for shard in self.shards)

    def to_json(self) -> str:
        """The manifest as JSON, with its digest for a person to compare."""
        # A column only where there is one, so the older formats' JSON is as it was.
        shards = [
            {key: value for key, value in asdict(shard).items() if value is not None}
            for shard in self.shards
        ]
        return json.dumps({"digest": self.digest, "shards": shards}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """A manifest from `to_json`'s text. Raises ValueError when its digest does not
        match its shards (edited by hand)."""
        loaded = json.loads(text)
        manifest = cls([ShardInfo(**shard) for shard in loaded["shards"]])
        if loaded.get("digest", manifest.digest) != manifest.digest:
            raise ValueError(
                f"manifest digest {loaded['digest']}: its shards digest to "
                f"{manifest.digest}; it was edited, rebuild it with Manifest.build"
            )
        return manifest


class Windows:
    """`manifest`'s tokens cut into samples of `context` + 1 tokens (see the module)."""

    def __init__(self, manifest: Manifest, context: int) -> None:
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context {context!r}: must be an integer >= 1 (tokens per input)")
        self.manifest = manifest
        self.context = context
        self.span = context + 1
        self.shard_windows = [shard.tokens // self.span for shard in manifest.shards]
        # ends[j]: the samples in shards 0..j, so shard j holds samples ends[j-1]..ends[j]-1.
        self._ends = list(accumulate(self.shard_windows))
        if self._ends[-1] == 0:
            longest = max(shard.tokens for shard in manifest.shards)
            raise ValueError(
                f"context {context}: no shard holds a window of {self.span} tokens (the "
                f"longest has {longest}); use a context below {longest} or more data"
            )

    @property
    def samples(self) -> int:
        """The number of samples (windows) in all shards."""
        return self._ends[-1]

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard index, window index in that shard) of global sample `sample`."""
        if isinstance(sample, bool) or not isinstance(sample, int):
            raise ValueError(f"sample {sample!r}: must be an integer")
        if not 0 <= sample < self.samples:
            raise ValueError(f"sample {sample}: must be in 0..{self.samples - 1}")
        shard = bisect.bisect_right(self._ends, sample)
        first = self._ends[shard - 1] if shard else 0
        return shard, sample - first


def _shard(
    url: str, format: str, dtype: np.dtype[Any], offset: int, tokens: int, size: int
) -> ShardInfo:
    return ShardInfo(url, format, dtype.str, offset, tokens, size, _content_digest(url))


def _token_dtype(name: str, where: str) -> np.dtype[Any]:
    try:
        dtype = np.dtype(name)
    except TypeError as error:
        raise ValueError(f"dtype {name!r} of {where}: not a NumPy dtype ({error})") from None
    if dtype.kind not in "ui":
        raise ValueError(
            f"dtype {name!r} of {where}: token ids must be integers; write the tokens "
            f"as uint16, uint32 or int32"
        )
    # Files written by numpy on any common machine are little-endian; say so explicitly
    # so that the manifest reads the same on a big-endian host.
    return dtype.newbyteorder("<") if dtype.byteorder in "=|" else dtype


def _npy_layout(url: str) -> tuple[np.dtype[Any], int, int]:
    """(dtype, byte offset of the data, element count) of the .npy at `url`."""
    with fsspec.open(url, "rb") as file:
        try:
            version = np.lib.format.read_magic(file)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(file)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(file)
            else:
                raise ValueError(f"format version {version}, only 1.0 and 2.0 are read")
        except ValueError as error:
            raise ValueError(
                f"npy shard {url}: not a readable .npy file ({error}); save the tokens with np.save"
            ) from None
        offset = file.tell()
    if len(shape) != 1:
        raise ValueError(
            f"npy shard {url}: shape {shape}; a token shard is 1-D, save arr.reshape(-1)"
        )
    del fortran  # a 1-D array is the same in either order
    return _token_dtype(dtype.str, url), offset, int(shape[0])


def _is_directory(url: str) -> bool:
    filesystem, path = fsspec.core.url_to_fs(url)
    return bool(filesystem.isdir(path))


def _byte_size(url: str) -> int:
    filesystem, path = fsspec.core.url_to_fs(url)
    return int(filesystem.size(path))


def _content_digest(url: str) -> str:
    hasher = xxhash.xxh3_128()
    with fsspec.open(url, "rb") as file:
        while chunk := file.read(_CHUNK):
            hasher.update(chunk)
    return f"xxh3_128:{hasher.hexdigest()}"
