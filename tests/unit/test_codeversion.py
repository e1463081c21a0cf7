"""The code version a job's record keeps (pitstop.common.codeversion): a directory's git commit,
and whether (and how) its tree differs from it, in real git trees."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from pitstop.common import codeversion
from pitstop.common.codeversion import code_version

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git tree with one commit: train.py, a .gitignore that ignores data/."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / "train.py").write_text("print('train')\n")
    (root / ".gitignore").write_text("data/\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_a_clean_tree_is_its_commit(repo: Path) -> None:
    found = code_version(repo)
    assert found.git_commit == git(repo, "rev-parse", "HEAD")
    assert len(found.git_commit) == 40
    assert (found.dirty, found.dirty_digest) == (False, "")
    assert found.working_dir == str(repo)


def test_an_ignored_file_leaves_the_tree_clean(repo: Path) -> None:
    (repo / "data").mkdir()
    (repo / "data" / "shard-0.bin").write_bytes(b"\0" * 100)
    assert code_version(repo).dirty is False


def test_a_changed_tracked_file_is_dirty_and_the_digest_follows_the_change(repo: Path) -> None:
    (repo / "train.py").write_text("print('train harder')\n")
    first = code_version(repo)
    assert first.dirty
    diff = subprocess.run(
        ["git", "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    expected = hashlib.sha256(b"diff\0%d\0" % len(diff) + diff).hexdigest()
    assert first.dirty_digest == expected
    assert code_version(repo).dirty_digest == first.dirty_digest  # stable
    (repo / "train.py").write_text("print('train even harder')\n")
    assert code_version(repo).dirty_digest not in ("", first.dirty_digest)
    assert code_version(repo).git_commit == first.git_commit


def test_an_untracked_file_is_dirty_by_its_name_and_bytes(repo: Path) -> None:
    (repo / "notes.txt").write_text("a")
    first = code_version(repo)
    assert first.dirty
    assert len(first.dirty_digest) == 64
    (repo / "notes.txt").write_text("b")
    second = code_version(repo)
    assert second.dirty_digest not in ("", first.dirty_digest)
    (repo / "notes.txt").rename(repo / "other.txt")
    assert code_version(repo).dirty_digest not in ("", second.dirty_digest)


def test_a_subdirectory_sees_the_whole_tree(repo: Path) -> None:
    (repo / "pkg").mkdir()
    (repo / "pkg" / "model.py").write_text("x = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "pkg")
    (repo / "elsewhere.txt").write_text("untracked at the top")
    found = code_version(repo / "pkg")
    assert found.working_dir == str(repo / "pkg")
    assert found.dirty
    assert found.dirty_digest == code_version(repo).dirty_digest


def test_a_directory_that_is_no_git_tree_gives_only_its_path(tmp_path: Path) -> None:
    found = code_version(tmp_path)
    assert (found.git_commit, found.dirty, found.dirty_digest) == ("", False, "")
    assert found.working_dir == str(tmp_path)
    missing = code_version(tmp_path / "absent")
    assert (missing.git_commit, missing.working_dir) == ("", str(tmp_path / "absent"))


def test_a_tree_without_a_commit_gives_only_its_path(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "train.py").write_text("pass\n")
    found = code_version(tmp_path)
    assert (found.git_commit, found.dirty) == ("", False)


def test_without_git_nothing_is_raised(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    found = code_version(repo)
    assert (found.git_commit, found.dirty, found.working_dir) == ("", False, str(repo))


def test_changes_not_read_in_time_are_dirty_without_a_digest(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (repo / "big.bin").write_bytes(b"\1" * 1024)
    assert code_version(repo, timeout=0.0).git_commit == ""  # no time: not even HEAD read
    monkeypatch.setattr(codeversion, "_hash_file", lambda *_: False)  # the deadline passed
    found = code_version(repo)
    assert found.git_commit
    assert found.dirty
    assert found.dirty_digest == ""
