"""Where a node's snapshot slots live: files of shared memory that the checkpoint daemon
creates and a rank maps to copy its state in (or out, on a restore)."""

from __future__ import annotations

from pathlib import Path

SHM_DIR = Path("/dev/shm")
