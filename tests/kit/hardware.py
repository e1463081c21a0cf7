"""Skips for missing hardware."""

from __future__ import annotations

# Where `make test` sets up everything the tests need by itself (root on Debian: the
# Debian packages by apt-get, helm and the Python packages from their registries), a
# skip means that set-up failed: it fails the test, saying so (tests/conftest.py). Only a
# test that needs hardware the machine lacks (an NVIDIA GPU) may skip there; its reason
# starts with NO_HARDWARE.
NO_HARDWARE = "hardware: "
