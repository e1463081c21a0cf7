"""Copies between a rank's tensors and shared memory, for the writer.

CPU torch tensors go by memmove: a state under 32 MB in the calling thread, one call per
tensor (a thread pool's hand-offs would cost more than such a copy), a larger one in
16 MB chunks over a few threads (ctypes releases the GIL during the call, and one core
alone rarely reaches a socket's memory bandwidth: on 2 cores, 1 GB copies in about 70
ms this way against 90 ms in one thread). Other objects with the buffer protocol (numpy
arrays, bytes, array.array) go by one memoryview copy. CUDA tensors are copied into a
pinned host staging buffer on a side stream, a CUDA event marking their completion;
that path needs a GPU to run. torch is imported only when a torch tensor is at hand.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pitstop.rankside.format import ShardLayout, TensorSpec

if TYPE_CHECKING:
    import torch

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_COPY_CHUNK = 16 << 20
_PARALLEL_COPY_BYTES = 32 << 20
"""States at least this large are copied over the copier's threads."""
_BUFFER_DTYPES = {
    ("?", 1): "BOOL", ("B", 1): "U8", ("b", 1): "I8", ("c", 1): "U8",
    ("h", 2): "I16", ("H", 2): "U16", ("e", 2): "F16",
    ("i", 4): "I32", ("I", 4): "U32", ("f", 4): "F32", ("l", 4): "I32", ("L", 4): "U32",
    ("q", 8): "I64", ("Q", 8): "U64", ("d", 8): "F64", ("l", 8): "I64", ("L", 8): "U64",
    ("Zf", 8): "C64",
}  # fmt: skip
TORCH_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64",
}  # fmt: skip
"""torch dtype name -> safetensors dtype."""


class MappedSlot:
    """A slot's segment mapped into this process; `address` is where its bytes start
    (writable mappings only). A writable mapping keeps its file open, so that
    `unlinked` can tell when the daemon dropped the segment: the mapping alone would
    keep that memory alive."""

    def __init__(self, mapping: mmap.mmap, writable: bool, fd: int = -1) -> None:
        self.mapping = mapping
        self.view = memoryview(mapping)
        self._fd = fd
        self._anchor = ctypes.c_char.from_buffer(mapping) if writable else None
        self.address = ctypes.addressof(self._anchor) if self._anchor is not None else 0

    @classmethod
    def open(cls, path: Path, size: int, writable: bool) -> MappedSlot:
        """Map `size` bytes of the segment at `path`, its pages populated up front (the
        writer's first copy into it then takes no page fault)."""
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        if not writable:
            os.close(fd)
            fd = -1
        return cls(mapping, writable, fd)

    def unlinked(self) -> bool:
        """Whether the segment's file is gone from /dev/shm (writable mappings only)."""
        return self._fd >= 0 and os.fstat(self._fd).st_nlink == 0

    def close(self) -> None:
        """Unmap; a tensor that still views the mapping leaves it to the GC."""
        self._anchor = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.view.release()
            self.mapping.close()
        except BufferError:
            pass


class Copier:
    """memmove, a large state in chunks over `threads` threads; `behind` copies while
    the caller goes on (ctypes lets go of the GIL for each memmove)."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, "pitstop-copy") if threads > 1 else None
        self._driver: ThreadPoolExecutor | None = None

    def behind(self, moves: list[tuple[int, int, int]]) -> Future[None]:
        """`move` on a thread of its own: done when the future is."""
        if self._driver is None:
            self._driver = ThreadPoolExecutor(1, "pitstop-copy-behind")
        return self._driver.submit(self.move, moves)

    def move(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy each (target address, source address, bytes)."""
        if self._pool is None or sum(size for _, _, size in moves) < _PARALLEL_COPY_BYTES:
            for target, source, size in moves:
                ctypes.memmove(target, source, size)
            return
        pieces = [
            (target + offset, source + offset, min(_COPY_CHUNK, size - offset))
            for target, source, size in moves
            for offset in range(0, size, _COPY_CHUNK)
        ]
        for _ in self._pool.map(lambda piece: ctypes.memmove(*piece), pieces):
            pass

    def close(self) -> None:
        """Stop the threads (a copy behind is finished first)."""
        if self._driver is not None:
            self._driver.shutdown()
        if self._pool is not None:
            self._pool.shutdown()


def is_torch(value: Any) -> bool:
    """Whether `value` is a torch tensor (without importing torch)."""
    return type(value).__module__.startswith("torch")


PLAIN, CUDA, OTHER = "plain", "cuda", "other"
"""How a value is copied: memmove (a contiguous CPU tensor), through pinned memory (a
CUDA tensor), or by `copy_into` (anything else)."""


Signature = tuple[str, object, object]


def signature(value: Any) -> Signature:
    """(how it is copied, dtype, shape): what a snapshot's plan depends on, cheaper to
    take than `describe`. A loop's snapshot is planned again only when one changes."""
    if is_torch(value):
        if value.is_cuda:
            kind = CUDA
        elif value.is_cpu and value.is_contiguous():
            kind = PLAIN
        else:
            kind = OTHER
        return kind, value.dtype, value.shape
    view = memoryview(value)
    return OTHER, (view.format, view.itemsize), view.shape


def describe(name: str, value: Any) -> TensorSpec:
    """The layout entry of a torch tensor or a buffer-protocol object."""
    if is_torch(value):
        dtype = TORCH_DTYPES.get(str(value.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {value.dtype} has no safetensors name")
        return TensorSpec(name, dtype, tuple(value.shape))
    view = memoryview(value)
    dtype = _BUFFER_DTYPES.get((view.format.lstrip("@=<"), view.itemsize))
    if dtype is None:
        raise ValueError(f"tensor {name!r}: buffer format {view.format!r} is not supported")
    return TensorSpec(name, dtype, tuple(view.shape or ()))


def copy_into(value: Any, view: memoryview, begin: int, end: int) -> None:
    """Copy a non-contiguous CPU tensor or a buffer object into view[begin:end]."""
    if is_torch(value):
        import torch

        target = torch.frombuffer(view, dtype=value.dtype, count=value.numel(), offset=begin)
        target.view(value.shape).copy_(value)
        return
    source = memoryview(value)
    if not source.c_contiguous:
        source = memoryview(source.tobytes())
    view[begin:end] = source.cast("B")


def read_tensor(
    view: memoryview, layout: ShardLayout, name: str, into: Mapping[str, Any] | None
) -> Any:
    """Tensor `name` of the shard in `view`, copied out: into `into[name]` in place when
    given with the same shape, else a new torch tensor (bytes without torch)."""
    entry = layout.entry(name)
    begin, end = layout.span(entry)
    try:
        import torch
    except ImportError:
        return bytes(view[begin:end])
    dtype = getattr(torch, {v: k for k, v in TORCH_DTYPES.items()}[entry.dtype])
    count = (end - begin) // max(1, dtype.itemsize)
    if not count:
        source = torch.empty(entry.shape, dtype=dtype)
    else:
        with warnings.catch_warnings():  # read-only on purpose: it is copied out at once
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(view, dtype=dtype, count=count, offset=begin)
        source = source.view(entry.shape)
    target = into.get(name) if into is not None else None
    if target is not None and tuple(target.shape) == tuple(entry.shape):
        return target.copy_(source)
    return source.clone()


class CudaStager:
    """Copies CUDA tensors into a pinned host staging buffer on a side stream. `stage`
    only enqueues the copies and returns the function that, in the background, waits
    for their CUDA event and moves the bytes into the slot. Needs a GPU."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self._staging: torch.Tensor | None = None
        self._landed: Any = None  # the CUDA event of the last stage's copies

    def wait_landed(self) -> None:
        """Block until the last stage's copies are in pinned host memory: from then on
        the tensors it was given may change."""
        if self._landed is not None:
            self._landed.synchronize()

    def stage(
        self, tensors: Mapping[str, Any], layout: ShardLayout, view: memoryview
    ) -> Callable[[], None]:
        """Enqueue the device-to-host copies; the returned function completes them."""
        torch = self._torch
        if self._staging is None or self._staging.numel() < layout.size:
            self._staging = torch.empty(layout.size, dtype=torch.uint8, pin_memory=True)
        staging = self._staging
        self._stream.wait_stream(torch.cuda.current_stream())
        spans = [layout.span(layout.entry(name)) for name in tensors]
        with torch.cuda.stream(self._stream):
            for (begin, end), tensor in zip(spans, tensors.values(), strict=True):
                staging[begin:end].view(tensor.dtype).view(tensor.shape).copy_(
                    tensor, non_blocking=True
                )
            done = torch.cuda.Event()
            done.record(self._stream)
        self._landed = done

        def complete() -> None:
            done.synchronize()
            for begin, end in spans:
                target = torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=begin)
                target.copy_(staging[begin:end])
                del target

        return complete
