#!/usr/bin/env bash
# Installs pitstop and everything `make test` runs into a virtual environment, made with
# PYTHON when it does not exist yet:
#
#   scripts/install.sh VENV PYTHON            what the suite was tested with: every package
#                                             pinned, with its hash, in requirements/dev.txt
#   scripts/install.sh --latest VENV PYTHON   the newest versions pyproject.toml's ranges
#                                             allow (make test-latest)
#
# The lock is resolved for CPython 3.11 on Linux x86_64 (scripts/locks.py). Another
# interpreter or platform gets the ranges instead, and this says so.
set -euo pipefail
cd "$(dirname "$0")/.."

LATEST=0
if [ "${1:-}" = "--latest" ]; then
    LATEST=1
    shift
fi
VENV="${1:?usage: scripts/install.sh [--latest] VENV PYTHON}"
PYTHON="${2:-python3}"
LOCK=requirements/dev.txt
PIP=("$VENV/bin/python" -m pip install --quiet)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi

torch_hint() {
    echo "install: pip could not install the lock. torch 2.13.0+cpu is PyTorch's CPU build," >&2
    echo "  which PyPI does not serve: give pip a folder holding its wheel or PyTorch's CPU" >&2
    echo "  index, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make install" >&2
}

if [ "$LATEST" = 1 ]; then
    echo "install: the newest versions pyproject.toml allows, into $VENV"
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" --upgrade --upgrade-strategy eager -e '.[dev]'
    exit 0
fi

if ! "$VENV/bin/python" -c 'import platform, sys
sys.exit(sys.version_info[:2] != (3, 11) or sys.platform != "linux" or platform.machine() != "x86_64")'; then
    echo "install: $LOCK is for CPython 3.11 on Linux x86_64 and $VENV runs" \
        "$("$VENV/bin/python" -c 'import platform; print(platform.python_implementation(), platform.python_version(), platform.system(), platform.machine())'):"
    echo "  installing from pyproject.toml's ranges instead, so versions may differ from the tested ones"
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" -e '.[dev]'
    exit 0
fi

# Every package from the lock, checked against its hashes (pip refuses a package the
# lock pins without one, or a dependency the lock lacks); then pitstop itself, editable,
# built by the locked hatchling with nothing else fetched.
"${PIP[@]}" --require-hashes -r "$LOCK" || { torch_hint; exit 1; }
"${PIP[@]}" --no-deps --no-build-isolation -e .
