"""What the GPU checks (`make gpu-check`, tests/gpu) share: whether this machine has what
a check needs, decided without importing torch where NVML already says no, and where
each check's numbers go.

A check that cannot run here skips, saying why; every reason starts with the kit's
NO_HARDWARE, so on a machine that sets everything else up (root on Debian) such a skip
stays a skip: a missing GPU is no broken set-up.

Each check prints its numbers as one JSON line, and appends the line to the file named
by PITSTOP_GPU_REPORT when that is set (`make gpu-check` sets it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kit.hardware import NO_HARDWARE

REPORT_ENV = "PITSTOP_GPU_REPORT"


def _nvml_gpus() -> tuple[int, str]:
    """The GPUs NVML sees, and why there are none ("" when there are)."""
    try:
        import pynvml
    except ImportError as exc:  # the agent extra is missing: a set-up error, not hardware
        return 0, f"the NVML binding is not installed ({exc}): pip install 'pitstop[agent]'"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return 0, f"{NO_HARDWARE}no NVIDIA GPU here: NVML cannot initialise ({exc})"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    return count, "" if count else f"{NO_HARDWARE}no NVIDIA GPU here: NVML lists none"


NVML_GPUS, NO_GPU = _nvml_gpus()

needs_gpu = pytest.mark.skipif(bool(NO_GPU), reason=NO_GPU or "-")
"""Skips a check on a machine without an NVIDIA GPU, without importing torch."""

needs_two_gpus = pytest.mark.skipif(
    NVML_GPUS < 2,
    reason=NO_GPU
    or f"{NO_HARDWARE}NCCL puts one rank on each GPU (it refuses two ranks on one): two ranks "
    f"need two GPUs, and this machine has {NVML_GPUS}",
)


def cuda() -> Any:
    """torch, once it sees a CUDA device; else the check skips, saying why."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        pytest.skip(
            f"{NO_HARDWARE}torch {torch.__version__} (built with {built}) sees no CUDA device "
            f"although NVML lists {NVML_GPUS} GPU(s): install a CUDA build of torch that "
            "this driver runs"
        )
    return torch


def machine() -> dict[str, Any]:
    """The GPU, driver and software a check's numbers were measured with."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def report(check: str, numbers: dict[str, Any]) -> None:
    """Print `numbers` as one JSON line; append it to $PITSTOP_GPU_REPORT when set."""
    line = json.dumps({"check": check, **numbers}, sort_keys=False)
    print(line, flush=True)
    target = os.environ.get(REPORT_ENV, "")
    if target:
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(line + "\n")
