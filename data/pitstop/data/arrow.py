"""The Hugging Face formats: token id lists in a Parquet file or in a saved dataset.

Both hold a tokenized corpus as a column whose every row is a list of token ids
(``input_ids`` by default, as a tokenizer's ``map`` writes it). The rows, concatenated in
order, are the shard's token stream, as a Megatron dataset's sequences are.

- ``parquet``: one ``.parquet`` file (a Hugging Face Hub dataset's ``data/*.parquet``,
  or ``Dataset.to_parquet``). One file is one shard.
- ``hf``: a directory as ``datasets.Dataset.save_to_disk`` writes it: ``state.json``,
  whose ``_data_files`` lists ``{"filename": ...}`` Arrow IPC stream files in order,
  beside ``dataset_info.json``. Each listed file is one shard, in that order: save_to_disk
  already cuts a large dataset into files of at most 500 MB, so a shard stays small
  enough to cache and prefetch whole, a rank converts only the files its samples are in,
  and the dataset reads as any other list of shards (windows never cross from one file
  into the next). The `datasets` library is not needed: pyarrow reads the files.

A column is read record batch by record batch, never whole, through fsspec, so any
fsspec URL works. Its token dtype is the list's integer value type (``list<int32>`` ->
``<i4``); floats, strings, nulls and columns that are not lists are refused. A shard's
byte size and digest describe its tokens, not the file: the bytes of the token stream
as a flat little-endian array, and xxh3-128 of those bytes. So the digest follows the
tokens wherever they lie, and it is what the reader's cache checks the flat copy it
writes against (see `pitstop.data.reader`).

pyarrow is imported only when one of these formats is used (``pip install
'pitstop[data]'``), so the other formats need none of it.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
import numpy as np
import xxhash

COLUMNAR_FORMATS = ("parquet", "hf")
DEFAULT_COLUMN = "input_ids"
STATE_FILE = "state.json"
_ROWS_PER_BATCH = 1024
_FIX = "name the token column with column="


def hf_data_files(url: str) -> list[str]:
    """The URLs of the Arrow files of the save_to_disk directory `url`, in the order its
    state.json lists them."""
    directory = url.rstrip("/")
    filesystem, path = fsspec.core.url_to_fs(directory)
    state_path = posixpath.join(path, STATE_FILE)
    if not filesystem.isfile(state_path):
        if filesystem.isfile(posixpath.join(path, "dataset_dict.json")):
            raise ValueError(
                f"hf dataset {url}: a DatasetDict (dataset_dict.json), not one dataset; pass "
                f"one split's directory, e.g. {directory}/train"
            )
        raise ValueError(
            f"hf dataset {url}: no {STATE_FILE}; pass a directory written by "
            f"datasets.Dataset.save_to_disk"
        )
    with filesystem.open(state_path, "rb") as file:
        try:
            state = json.loads(file.read())
        except ValueError as error:
            raise ValueError(
                f"hf dataset {url}: {STATE_FILE} is not JSON ({error}); save the dataset "
                f"again with save_to_disk"
            ) from None
    entries = state.get("_data_files") if isinstance(state, dict) else None
    names = [entry.get("filename") if isinstance(entry, dict) else None for entry in entries or []]
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(
            f"hf dataset {url}: {STATE_FILE}'s _data_files is {entries!r}, not a list of "
            f'{{"filename": ...}} entries; save the dataset again with save_to_disk'
        )
    return [f"{directory}/{name}" for name in names]


def describe_columnar(url: str, format: str, column: str) -> tuple[np.dtype[Any], int, str]:
    """(token dtype, token count, ``"xxh3_128:<hex>"`` of the tokens' bytes) of the
    `column` of the Parquet or Arrow stream file at `url`; reads it through once."""
    hasher = xxhash.xxh3_128()
    tokens = 0
    with _token_arrays(url, format, column) as (dtype, arrays):
        for array in arrays:
            hasher.update(array.tobytes())
            tokens += len(array)
    return dtype, tokens, f"xxh3_128:{hasher.hexdigest()}"


def token_bytes(url: str, format: str, column: str) -> Iterator[bytes]:
    """The tokens of `column` as one flat little-endian array, in chunks of bytes."""
    with _token_arrays(url, format, column) as (_, arrays):
        for array in arrays:
            yield array.tobytes()


@contextmanager
def _token_arrays(
    url: str, format: str, column: str
) -> Iterator[tuple[np.dtype[Any], Iterator[np.ndarray[Any, Any]]]]:
    """`column`'s token dtype and its tokens, one array per record batch, in order."""
    with fsspec.open(url, "rb") as file:
        schema, batches = _parquet(url, file, column) if format == "parquet" else _stream(url, file)
        dtype = _column_dtype(url, schema, column)
        yield dtype, (_tokens(url, column, dtype, batch) for batch in batches)


def _parquet(url: str, file: Any, column: str) -> tuple[Any, Iterator[Any]]:
    pyarrow = _pyarrow()
    try:
        parquet = pyarrow.parquet.ParquetFile(file)
    except pyarrow.ArrowInvalid as error:
        raise ValueError(
            f"parquet shard {url}: not a Parquet file ({error}); write it with "
            f"Dataset.to_parquet or pyarrow.parquet.write_table"
        ) from None

    def batches() -> Iterator[Any]:
        # The one column, some rows at a time: the file is never read whole.
        yield from parquet.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[column])

    return parquet.schema_arrow, batches()


def _stream(url: str, file: Any) -> tuple[Any, Iterator[Any]]:
    pyarrow = _pyarrow()
    try:
        reader = pyarrow.ipc.open_stream(file)
    except pyarrow.ArrowInvalid as error:
        raise ValueError(
            f"hf shard {url}: not an Arrow IPC stream ({error}); pass a directory "
            f"datasets.Dataset.save_to_disk wrote"
        ) from None
    return reader.schema, iter(reader)


def _tokens(url: str, column: str, dtype: np.dtype[Any], batch: Any) -> np.ndarray[Any, Any]:
    values = batch.column(batch.schema.get_field_index(column))
    if values.null_count:
        raise ValueError(
            f"column {column!r} of {url}: {values.null_count} rows are null; drop or fill "
            f"them before saving (a row of no tokens is an empty list)"
        )
    flat = values.flatten()
    if flat.null_count:
        raise ValueError(
            f"column {column!r} of {url}: {flat.null_count} token ids are null; token "
            f"lists may not hold nulls, tokenize again"
        )
    return np.asarray(flat.to_numpy(zero_copy_only=False), dtype=dtype)


def _column_dtype(url: str, schema: Any, column: str) -> np.dtype[Any]:
    """The NumPy dtype of `column`'s token ids; ValueError saying what is wrong."""
    pyarrow = _pyarrow()
    types = pyarrow.types
    if schema.get_field_index(column) < 0:
        raise ValueError(
            f"column {column!r}: not in {url} (its columns: {', '.join(schema.names)}); {_FIX}"
        )
    kind = schema.field(column).type
    if types.is_string(kind) or types.is_large_string(kind):
        raise ValueError(
            f"column {column!r} of {url}: is a string column, not token ids; tokenize first "
            f"or {_FIX}"
        )
    if not (types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind)):
        raise ValueError(
            f"column {column!r} of {url}: is a column of {kind}, not a list of token ids per "
            f"row; {_FIX}"
        )
    value = kind.value_type
    if not types.is_integer(value):
        raise ValueError(
            f"column {column!r} of {url}: holds lists of {value}, not integer token ids; save the "
            f"token ids as integers (int32, or uint16 below 65,536) or {_FIX}"
        )
    dtype: np.dtype[Any] = np.dtype(value.to_pandas_dtype())
    return dtype.newbyteorder("<")


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            "pyarrow is not installed: the parquet and hf formats need it; install "
            "pitstop's data extra (pip install 'pitstop[data]')"
        ) from None
    return pyarrow
