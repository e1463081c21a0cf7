"""GPU backends: NVML on real nodes, a simulation everywhere else."""

from __future__ import annotations

from pitstop.agent.gpu.base import (
    FaultNotSupported,
    GpuBackend,
    GpuBackendError,
    XidCallback,
)
from pitstop.agent.gpu.sim import SimulatedBackend

__all__ = [
    "MAX_SIMULATED_GPUS",
    "FaultNotSupported",
    "GpuBackend",
    "GpuBackendError",
    "SimulatedBackend",
    "XidCallback",
    "open_backend",
]

MAX_SIMULATED_GPUS = 64


def open_backend(spec: str, node_id: str) -> GpuBackend:
    """The backend named by `spec` (the agent's --gpus): "nvml", or "sim:N" for N
    simulated GPUs. Raises ValueError for any other spec and GpuBackendError when
    NVML cannot start."""
    kind, _, count = spec.strip().partition(":")
    if kind == "nvml" and not count:
        # Imported here so that a node without the NVML binding can still simulate.
        from pitstop.agent.gpu.nvml import NvmlBackend

        return NvmlBackend()
    if kind == "sim" and count.isdecimal() and 1 <= int(count) <= MAX_SIMULATED_GPUS:
        return SimulatedBackend(node_id, int(count))
    raise ValueError(f"--gpus {spec!r}: use nvml or sim:N with N from 1 to {MAX_SIMULATED_GPUS}")
