"""The code a directory holds, as a job's record keeps it: its git commit and whether
(and how) its tree differs from that commit.

Here, beside the wire types, because two sides compute it that may import nothing of
each other: `pitstop job submit` (the client, for the code it saw) and a job's rank 0
(`pitstop.trainer`, for the code it runs). Never raises: a directory that is no git
tree, a missing git, one that fails or takes too long gives empty fields, not an error.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

from pitstop.v1 import agent_pb2

GIT_TIMEOUT_SECONDS = 10.0
"""The longest the whole look at a directory takes (every git call and the hashing of
its untracked files together)."""
_CHUNK = 1 << 20


def code_version(
    directory: str | os.PathLike[str], timeout: float = GIT_TIMEOUT_SECONDS
) -> agent_pb2.CodeVersion:
    """The CodeVersion of `directory`: HEAD's commit; `dirty` when tracked files differ
    from HEAD or untracked files that git does not ignore exist; `dirty_digest` the
    SHA-256 of those changes (`git diff HEAD --binary`, then each untracked file's name
    and bytes, by name). Not a git tree, no commit yet, or git missing: only
    `working_dir` is set. A tree whose changes could not be read in time (or at all) is
    `dirty` with an empty digest: changed, by how much unknown."""
    path = os.path.abspath(directory)
    found = agent_pb2.CodeVersion(working_dir=path)
    deadline = time.monotonic() + timeout
    top = _git(path, deadline, "rev-parse", "--show-toplevel")
    commit = _git(path, deadline, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    if top is None or commit is None or not commit.strip():
        return found
    found.git_commit = commit.decode("ascii", "replace").strip()
    # The whole tree's changes, wherever in it the directory is.
    root = os.fsdecode(top.removesuffix(b"\n"))
    status = _git(root, deadline, "status", "--porcelain", "-z", "--untracked-files=normal")
    if status is None:
        found.dirty = True  # unknown: said as changed, with no digest
        return found
    if not status:
        return found
    found.dirty = True
    digest = _changes_digest(root, deadline)
    found.dirty_digest = digest or ""
    return found


def _changes_digest(path: str, deadline: float) -> str | None:
    """SHA-256 over the tracked changes and the untracked files; None when they could
    not all be read before `deadline`."""
    diff = _git(path, deadline, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff")
    untracked = _git(path, deadline, "ls-files", "--others", "--exclude-standard", "-z")
    if diff is None or untracked is None:
        return None
    digest = hashlib.sha256()
    digest.update(b"diff\0%d\0" % len(diff))
    digest.update(diff)
    for name in sorted(n for n in untracked.split(b"\0") if n):
        digest.update(b"untracked\0" + name + b"\0")
        if not _hash_file(Path(os.fsdecode(name)), path, digest, deadline):
            return None
    return digest.hexdigest()


def _hash_file(name: Path, root: str, digest: hashlib._Hash, deadline: float) -> bool:
    """Add one untracked file's bytes (a symlink's target, as git stores it) to
    `digest`; False when it ran past `deadline`. An unreadable file counts as its error."""
    full = Path(root) / name
    try:
        if full.is_symlink():
            digest.update(b"link\0" + os.fsencode(os.readlink(full)))
            return True
        with full.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                if time.monotonic() > deadline:
                    return False
    except OSError as exc:
        digest.update(f"unreadable\0{exc.strerror}".encode())
    return time.monotonic() <= deadline


def _git(path: str, deadline: float, *args: str) -> bytes | None:
    """git's output in `path`, or None when it failed, is missing or ran out of time."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_OPTIONAL_LOCKS"] = "0"  # a look must not take the index lock from its owner
    try:
        done = subprocess.run(
            ["git", "-c", "core.quotepath=off", *args],
            cwd=path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=left,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return done.stdout if done.returncode == 0 else None
