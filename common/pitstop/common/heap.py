"""Give the C heap's free pages back to the kernel.

glibc keeps a heap (an arena) per thread that allocated under contention, and returns
a freed page only from the top of an arena. A long-lived daemon whose worker threads
once held a large transient buffer (a shard's durable read, a checksum, a replica's
chunks) keeps those pages resident for good: its RSS steps up to each new high-water
mark and never comes down. `malloc_trim(0)` walks every arena and releases the free
pages inside them too (`MADV_DONTNEED`), so RSS tracks what is live."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any


@functools.cache
def _malloc_trim() -> Callable[[int], Any] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim() -> bool:
    """Release the free pages of every arena; True if any went back to the kernel.
    Takes a few milliseconds for a heap of a few hundred MB: call it off the event loop."""
    malloc_trim = _malloc_trim()
    return bool(malloc_trim(0)) if malloc_trim is not None else False
