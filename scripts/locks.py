"""The lock files: every package `make install` and `make test` install, pinned with hashes.

``pyproject.toml`` keeps the ranges users install with; ``requirements/<set>.txt`` pins
what the suite was tested with, for one target: CPython 3.11 on Linux x86_64 (torch
2.13.0+cpu, the CPU wheel). ``requirements/build.in`` adds what builds and installs
pitstop itself from the lock (pip, hatchling: ``pip install --no-build-isolation -e .``).

    python scripts/locks.py compile   refresh every lock (``make lock``; needs uv)
    python scripts/locks.py check     every lock satisfies pyproject.toml and build.in
    python scripts/locks.py drift     what this interpreter has installed that differs
                                      from the dev lock (``make test-latest`` prints it)

``check`` exits 1 naming each mismatch: a requirement the lock lacks or pins outside
its range, or a pinned package that nothing in pyproject.toml asks for any more. The
unit tests run the same check (tests/unit/test_locks.py)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "pitstop"
BUILD_INPUT = "requirements/build.in"
# Lock set -> the extras it installs. `make install` and `make test` install `dev`.
LOCK_SETS = {"dev": ("dev",)}
# The one interpreter and platform the locks are resolved for (the torch wheel is the
# CPU build for CPython 3.11 on x86_64 Linux).
TARGET_PYTHON = "3.11"
TARGET_PLATFORM = "x86_64-manylinux_2_28"
TARGET_ENVIRONMENT = {
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}
# Where pip and uv find torch's CPU build: a wheel on this machine's disk, else the
# PyTorch CPU index (not PyPI, which serves the CUDA build).
LOCAL_WHEELS = Path("/opt/wheels")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# What uv writes as the source of a requirement read from pyproject.toml or build.in.
PROJECT_SOURCE = f"{PROJECT} (pyproject.toml)"
BUILD_SOURCE = f"-r {BUILD_INPUT}"


def lock_path(lock_set: str) -> Path:
    return ROOT / "requirements" / f"{lock_set}.txt"


@dataclass
class Pin:
    """One package of a lock: its version, hashes and what pulled it in (uv's `# via`)."""

    name: str
    version: str
    hashes: list[str] = field(default_factory=list)
    via: list[str] = field(default_factory=list)


def parse_lock(text: str) -> dict[str, Pin]:
    """The pins of a `uv pip compile --generate-hashes` file, by canonical name."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    in_via = False
    for line in text.splitlines():
        stripped = line.strip()
        pinned = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)", line)
        if pinned:
            current = Pin(canonicalize_name(pinned.group(1)), pinned.group(3))
            pins[current.name] = current
            in_via = False
        elif current is None:
            continue
        elif stripped.startswith("--hash=sha256:"):
            current.hashes.append(stripped.removeprefix("--hash=sha256:").rstrip(" \\"))
        elif stripped == "# via":
            in_via = True
        elif stripped.startswith("# via "):
            current.via.append(stripped.removeprefix("# via ").strip())
            in_via = False
        elif in_via and stripped.startswith("#   "):
            current.via.append(stripped.removeprefix("#   ").strip())
        else:
            in_via = False
    return pins


def project_requirements(pyproject: dict[str, object], extras: tuple[str, ...]) -> list[str]:
    """The requirement strings of the base install and `extras`, the project's own
    extras (``pitstop[all,trainer]``) expanded."""
    project = pyproject["project"]
    assert isinstance(project, dict)
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    found: list[str] = list(project.get("dependencies", []))
    seen: set[str] = set()
    pending = list(extras)
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (lock sets: {LOCK_SETS})")
        seen.add(extra)
        for text in optional[extra]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == PROJECT:
                pending.extend(requirement.extras)
            else:
                found.append(text)
    return found


def build_requirements(text: str) -> list[str]:
    """The requirement lines of build.in (comments and blank lines left out)."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def applies(requirement: Requirement) -> bool:
    if requirement.marker is None:
        return True
    return Marker(str(requirement.marker)).evaluate(dict(TARGET_ENVIRONMENT))


def mismatches(
    pyproject: dict[str, object], build_in: str, lock_text: str, extras: tuple[str, ...]
) -> list[str]:
    """What keeps `lock_text` from being the lock of `extras`, one sentence each."""
    pins = parse_lock(lock_text)
    problems: list[str] = []
    direct: dict[str, str] = {}
    build_system = pyproject.get("build-system", {})
    assert isinstance(build_system, dict)
    build_lines = build_requirements(build_in)
    build_names = {canonicalize_name(Requirement(line).name) for line in build_lines}
    for text in build_system.get("requires", []):
        if canonicalize_name(Requirement(text).name) not in build_names:
            problems.append(
                f"pyproject.toml's [build-system] requires {text!r} and {BUILD_INPUT} does "
                "not: add it there, then run `make lock`"
            )
    wanted = [(t, "pyproject.toml") for t in project_requirements(pyproject, extras)]
    wanted += [(t, BUILD_INPUT) for t in build_lines]
    for text, source in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if not applies(requirement):
            continue
        direct[name] = source
        pin = pins.get(name)
        if pin is None:
            problems.append(f"{source} asks for {text!r} and the lock has no {name}: `make lock`")
        elif not requirement.specifier.contains(Version(pin.version), prereleases=True):
            problems.append(
                f"{source} asks for {text!r} and the lock pins {name}=={pin.version}: `make lock`"
            )
    for pin in pins.values():
        if not pin.hashes:
            problems.append(f"the lock pins {pin.name}=={pin.version} without a hash")
        from_project = PROJECT_SOURCE in pin.via or BUILD_SOURCE in pin.via
        from_packages = [v for v in pin.via if canonicalize_name(v.split(" ")[0]) in pins]
        if from_project and pin.name not in direct:
            problems.append(
                f"the lock pins {pin.name}=={pin.version} for pyproject.toml, which no "
                "longer asks for it: `make lock`"
            )
        elif not from_project and not from_packages:
            problems.append(
                f"the lock pins {pin.name}=={pin.version} and nothing in it or in "
                "pyproject.toml asks for it: `make lock`"
            )
    return problems


def check() -> int:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build_in = (ROOT / BUILD_INPUT).read_text()
    failed = 0
    for lock_set, extras in LOCK_SETS.items():
        path = lock_path(lock_set)
        if not path.exists():
            print(f"{path.relative_to(ROOT)}: missing: `make lock` writes it")
            failed += 1
            continue
        for problem in mismatches(pyproject, build_in, path.read_text(), extras):
            print(f"{path.relative_to(ROOT)}: {problem}")
            failed += 1
    if failed:
        return 1
    print(f"locks: {', '.join(LOCK_SETS)} satisfy pyproject.toml and {BUILD_INPUT}")
    return 0


def compile_locks(upgrade: bool) -> int:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        print("locks: uv is not installed: `make install` puts it in .venv/bin")
        return 2
    torch_source = (
        ["--find-links", str(LOCAL_WHEELS)]
        if LOCAL_WHEELS.is_dir()
        else ["--extra-index-url", TORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match"]
    )
    for lock_set, extras in LOCK_SETS.items():
        path = lock_path(lock_set)
        command = [uv, "pip", "compile", "pyproject.toml", BUILD_INPUT, "--quiet"]
        command += [arg for extra in extras for arg in ("--extra", extra)]
        command += ["--generate-hashes", "--python-version", TARGET_PYTHON]
        command += ["--python-platform", TARGET_PLATFORM, *torch_source]
        command += ["--custom-compile-command", "make lock", "-o", str(path.relative_to(ROOT))]
        if upgrade:
            command.append("--upgrade")
        print(f"locks: {path.relative_to(ROOT)} (extras {', '.join(extras)})", flush=True)
        if subprocess.run(command, cwd=ROOT).returncode != 0:
            return 1
    return check()


def drift() -> int:
    """Print each installed distribution whose version differs from the dev lock."""
    from importlib import metadata

    pins = parse_lock(lock_path("dev").read_text())
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in metadata.distributions()
        if d.metadata["Name"] and canonicalize_name(d.metadata["Name"]) != PROJECT
    }
    rows: list[tuple[str, str, str]] = [
        (name, pins[name].version if name in pins else "-", version)
        for name, version in sorted(installed.items())
        if name not in pins or pins[name].version != version
    ]
    rows += [
        (name, pin.version, "-") for name, pin in sorted(pins.items()) if name not in installed
    ]
    print(f"versions that differ from {lock_path('dev').relative_to(ROOT)} ({len(rows)}):")
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, locked, found in rows:
        print(f"  {name:<{width}}  locked {locked:<14} installed {found}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    refresh = sub.add_parser("compile", help="refresh the lock files (needs uv)")
    refresh.add_argument(
        "--upgrade",
        action="store_true",
        help="take the newest versions the ranges allow, not only what changed",
    )
    sub.add_parser("check", help="every lock satisfies pyproject.toml")
    sub.add_parser("drift", help="installed versions that differ from the dev lock")
    args = parser.parse_args()
    if args.action == "compile":
        return compile_locks(args.upgrade)
    return check() if args.action == "check" else drift()


if __name__ == "__main__":
    sys.exit(main())
