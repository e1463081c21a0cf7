"""The GPU backend interface: what the agent needs from a node's GPUs.

A backend reports raw readings only. Verdicts (healthy, warning, fatal) are computed
elsewhere from these readings and from the Xid catalog, so the same rules apply to
real and simulated GPUs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from pitstop.v1 import common_pb2

XidCallback = Callable[[common_pb2.XidEvent], None]
"""Receives every Xid event; called from any thread, so it must be thread-safe."""


class GpuBackendError(Exception):
    """The backend could not start: the message names the cause and what to do."""


class FaultNotSupported(Exception):
    """The backend cannot inject this kind of fault."""


class GpuBackend(abc.ABC):
    """One node's GPUs: inventory, health readings, Xid events and fault injection."""

    name: str
    """Backend name as reported in the inventory: "nvml" or "sim"."""

    @abc.abstractmethod
    def driver_version(self) -> str:
        """The NVIDIA driver version, e.g. "550.54.15"; "sim" on the simulated backend."""

    @abc.abstractmethod
    def inventory(self) -> list[common_pb2.GpuInfo]:
        """Every GPU on the node, ordered by index."""

    @abc.abstractmethod
    def read_health(self) -> list[common_pb2.GpuHealth]:
        """Raw readings per GPU, ordered by index; verdict and reasons left unset.

        Fields the hardware does not report stay at zero and are named in
        `GpuHealth.unsupported`. May block for tens of milliseconds: call it from a
        thread, not from the event loop.
        """

    @abc.abstractmethod
    def start_xid_watch(self, on_xid: XidCallback) -> None:
        """Deliver every Xid from now on to `on_xid`. Returns at once; call it once."""

    @abc.abstractmethod
    def inject_fault(self, fault: common_pb2.Fault) -> None:
        """Make `fault` happen on the GPU it names.

        Raises FaultNotSupported where the backend cannot, and ValueError for a GPU
        index out of range or a malformed fault.
        """

    @abc.abstractmethod
    def slow_multiplier(self, gpu_index: int) -> float:
        """Factor by which ranks on this GPU stretch their step time; 1.0 unless simulated."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the Xid watch (joining its thread) and release the driver. Idempotent."""

    def take_rank_fault(self, gpu_index: int) -> int:
        """The rank fault (rank_pb2.RankFault) injected on this GPU and not yet handed to
        its rank, cleared as it is taken; RANK_FAULT_NONE (0) unless simulated."""
        return 0

    def take_preflight_fault(self) -> bool:
        """Whether an injected fault makes this preflight fail (cleared as it is taken);
        False unless simulated."""
        return False

    def kernel_log_xids(self) -> list[common_pb2.XidEvent]:
        """Xids the kernel logged before the agent started; empty where there is no log.

        These are history, not news: the caller decides whether they still matter
        (a GPU reset since then may have cleared them). Runs a command that may take
        seconds: call it from a thread.
        """
        return []
