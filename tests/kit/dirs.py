"""Short temporary folders."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def short_tempdir(prefix: str = "pt-") -> Iterator[Path]:
    """A new folder with a short path under /tmp, removed afterwards: Unix socket paths
    are limited to 107 bytes, and pytest's own folders are longer."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
