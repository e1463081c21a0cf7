"""Short temporary folders, and small filesystems."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
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


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` ("64k") mounted at `path` (made here), unmounted afterwards:
    a real filesystem that fills up (mounting one needs root)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
