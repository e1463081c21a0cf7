"""A writer of Megatron-LM indexed datasets, for test fixtures (pitstop.data reads them;
nothing in pitstop writes them)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

MEGATRON_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def write_megatron(prefix: Path, sequences: Sequence[Sequence[int]], dtype: str = "uint16") -> None:
    """A Megatron-LM MMapIndexedDataset, as its IndexedDatasetBuilder writes one: the
    sequences back to back in <prefix>.bin, and <prefix>.idx: magic, version 1, dtype
    code, sequence and document counts, int32 sizes, int64 byte pointers, int64 document
    index (one sequence per document, with the leading 0)."""
    arrays = [np.asarray(sequence, dtype=dtype) for sequence in sequences]
    prefix.with_suffix(".bin").write_bytes(b"".join(a.tobytes() for a in arrays))
    sizes = np.array([len(a) for a in arrays], dtype="<i4")
    starts = np.concatenate(([0], np.cumsum(sizes[:-1])))
    pointers = starts.astype("<i8") * np.dtype(dtype).itemsize
    documents = np.arange(len(arrays) + 1, dtype="<i8")
    header = b"MMIDIDX\x00\x00" + struct.pack(
        "<QBQQ", 1, MEGATRON_CODES[dtype], len(arrays), len(documents)
    )
    index = header + sizes.tobytes() + pointers.tobytes() + documents.tobytes()
    prefix.with_suffix(".idx").write_bytes(index)
