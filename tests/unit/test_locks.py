"""The lock files (requirements/*.txt) against pyproject.toml: what `make install` and
`make test` install is what the ranges ask for, each package pinned with its hash, and a
dependency added to, moved in or dropped from one side only is named."""

from __future__ import annotations

import copy
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.locks import (
    BUILD_INPUT,
    LOCK_SETS,
    ROOT,
    lock_path,
    mismatches,
    parse_lock,
)

PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
BUILD_IN = (ROOT / BUILD_INPUT).read_text()
DEV_LOCK = lock_path("dev").read_text()


def with_dev(pyproject: dict[str, Any], change: Any) -> dict[str, Any]:
    changed = copy.deepcopy(pyproject)
    dev = changed["project"]["optional-dependencies"]["dev"]
    changed["project"]["optional-dependencies"]["dev"] = change(dev)
    return changed


@pytest.mark.parametrize("lock_set", sorted(LOCK_SETS))
def test_every_lock_satisfies_pyproject(lock_set: str) -> None:
    text = lock_path(lock_set).read_text()
    assert mismatches(PYPROJECT, BUILD_IN, text, LOCK_SETS[lock_set]) == []


def test_every_pin_of_the_lock_has_a_hash_and_a_reason() -> None:
    pins = parse_lock(DEV_LOCK)
    assert {"torch", "redis", "pip", "hatchling", "uv"} <= set(pins)
    assert pins["torch"].version == "2.13.0+cpu"
    assert all(pin.hashes and pin.via for pin in pins.values())


def test_a_dependency_added_to_pyproject_alone_is_named() -> None:
    changed = with_dev(PYPROJECT, lambda dev: [*dev, "left-pad>=1.3"])
    assert mismatches(changed, BUILD_IN, DEV_LOCK, ("dev",)) == [
        "pyproject.toml asks for 'left-pad>=1.3' and the lock has no left-pad: `make lock`"
    ]


def test_a_dependency_added_to_the_lock_alone_is_named() -> None:
    extra = "left-pad==1.3.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    assert mismatches(PYPROJECT, BUILD_IN, DEV_LOCK + extra, ("dev",)) == [
        "the lock pins left-pad==1.3.0 and nothing in it or in pyproject.toml asks for it: "
        "`make lock`"
    ]


def test_a_dependency_dropped_from_pyproject_and_kept_in_the_lock_is_named() -> None:
    changed = with_dev(PYPROJECT, lambda dev: [d for d in dev if not d.startswith("hypothesis")])
    problems = mismatches(changed, BUILD_IN, DEV_LOCK, ("dev",))
    assert len(problems) == 1
    assert problems[0].startswith("the lock pins hypothesis==")
    assert "pyproject.toml, which no longer asks for it" in problems[0]


def test_a_range_the_lock_no_longer_meets_is_named() -> None:
    changed = copy.deepcopy(PYPROJECT)
    scheduler = changed["project"]["optional-dependencies"]["scheduler"]
    scheduler[:] = ["redis>=9" if d.startswith("redis>") else d for d in scheduler]
    version = parse_lock(DEV_LOCK)["redis"].version
    assert mismatches(changed, BUILD_IN, DEV_LOCK, ("dev",)) == [
        f"pyproject.toml asks for 'redis>=9' and the lock pins redis=={version}: `make lock`"
    ]


def test_a_build_requirement_build_in_lacks_is_named() -> None:
    changed = copy.deepcopy(PYPROJECT)
    changed["build-system"]["requires"].append("editables>=0.5")
    assert mismatches(changed, BUILD_IN, DEV_LOCK, ("dev",)) == [
        "pyproject.toml's [build-system] requires 'editables>=0.5' and "
        f"{BUILD_INPUT} does not: add it there, then run `make lock`"
    ]


def test_a_requirement_for_another_platform_needs_no_pin() -> None:
    changed = with_dev(PYPROJECT, lambda dev: [*dev, "pywin32>=306; sys_platform == 'win32'"])
    assert mismatches(changed, BUILD_IN, DEV_LOCK, ("dev",)) == []


def test_parse_reads_one_and_several_sources() -> None:
    text = """# header
a-b==1.0 \\
    --hash=sha256:aa \\
    --hash=sha256:bb
    # via pitstop (pyproject.toml)
c[x]==2.0rc1 \\
    --hash=sha256:cc
    # via
    #   a-b
    #   -r requirements/build.in
"""
    pins = parse_lock(text)
    assert pins["a-b"].hashes == ["aa", "bb"]
    assert pins["a-b"].via == ["pitstop (pyproject.toml)"]
    assert pins["c"].version == "2.0rc1"
    assert pins["c"].via == ["a-b", "-r requirements/build.in"]
