"""Simulated GPUs: healthy H100s until a fault is injected.

Every reading the NVML backend can report can be produced here, either by a Fault
(the kinds the wire carries) or by `set_reading` (fields with no Fault kind yet), so
the health rules and the recovery path can be driven end to end without hardware.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.agent.gpu.base import GpuBackend, XidCallback
from pitstop.v1 import common_pb2, rank_pb2

GPU_NAME = "Simulated H100 80GB HBM3"
MEMORY_BYTES = 80 << 30
NVLINK_COUNT = 18
HEALTHY_TEMPERATURE_C = 40.0
HEALTHY_POWER_W = 300.0
THROTTLED_TEMPERATURE_C = 95.0
# nvmlClocksEventReasonHwThermalSlowdown | nvmlClocksEventReasonSwThermalSlowdown
THERMAL_CLOCK_EVENT_REASONS = 0x40 | 0x20
XID_GPU_FALLEN_OFF_BUS = 79

_M = TypeVar("_M", bound=Message)

# Fields a test may not overwrite through set_reading: identity, the link list
# (use an nvlink_errors fault) and the verdict, which is not a reading.
_NOT_SETTABLE = frozenset({"index", "uuid", "nvlinks", "verdict", "reasons"})


def healthy_reading(index: int, uuid: str) -> common_pb2.GpuHealth:
    """The readings of a healthy simulated GPU."""
    return common_pb2.GpuHealth(
        index=index,
        uuid=uuid,
        temperature_c=HEALTHY_TEMPERATURE_C,
        power_w=HEALTHY_POWER_W,
        nvlinks=[common_pb2.NvLinkStatus(link=link, active=True) for link in range(NVLINK_COUNT)],
        pcie_link_gen=5,
        pcie_link_gen_max=5,
        pcie_link_width=16,
        pcie_link_width_max=16,
        recovery_action=common_pb2.RECOVERY_ACTION_NONE,
    )


class SimulatedBackend(GpuBackend):
    """`count` simulated GPUs on node `node_id`, with deterministic identities.

    Thread-safe: faults arrive from the event loop while readings are taken from a
    worker thread. The Xid callback is called outside the lock.
    """

    name = "sim"

    def __init__(self, node_id: str, count: int, clock: Callable[[], float] = time.time) -> None:
        if not 1 <= count <= 64:
            raise ValueError(f"simulated GPU count {count}: use 1 to 64")
        self._clock = clock
        self._lock = threading.Lock()
        self._inventory = [
            common_pb2.GpuInfo(
                index=index,
                uuid=f"GPU-sim-{node_id}-{index}",
                name=GPU_NAME,
                memory_bytes=MEMORY_BYTES,
                pci_bus_id=f"00000000:{0x18 + index:02x}:00.0",
            )
            for index in range(count)
        ]
        self._readings = [healthy_reading(gpu.index, gpu.uuid) for gpu in self._inventory]
        self._multipliers = [1.0] * count
        # Faults the rank on each GPU carries out at its next step (handed out once).
        self._rank_faults = [rank_pb2.RANK_FAULT_NONE] * count
        self._fail_preflight = False  # the node's next preflight fails
        self._on_xid: XidCallback | None = None
        # Xids injected before the watch starts are delivered when it does.
        self._undelivered: list[common_pb2.XidEvent] = []

    def driver_version(self) -> str:
        return "sim"

    def inventory(self) -> list[common_pb2.GpuInfo]:
        return [_copy(gpu) for gpu in self._inventory]

    def read_health(self) -> list[common_pb2.GpuHealth]:
        with self._lock:
            readings = [_copy(reading) for reading in self._readings]
        for reading in readings:
            if reading.lost:
                # A lost GPU answers nothing, as on NVML.
                uuid, index = reading.uuid, reading.index
                reading.Clear()
                reading.index, reading.uuid, reading.lost = index, uuid, True
        return readings

    def start_xid_watch(self, on_xid: XidCallback) -> None:
        with self._lock:
            self._on_xid = on_xid
            undelivered, self._undelivered = self._undelivered, []
        for event in undelivered:
            on_xid(event)

    def inject_fault(self, fault: common_pb2.Fault) -> None:
        index = self._check_index(fault.gpu_index)
        kind = fault.WhichOneof("kind")
        if kind is None:
            raise ValueError(f"fault on GPU {index} names no kind: set one of xid .. clear")
        if kind == "xid":
            self._inject_xid(index, fault.xid)
            return
        with self._lock:
            reading = self._readings[index]
            if kind == "ecc_double_bit":
                reading.ecc_uncorrected_volatile += fault.ecc_double_bit
                reading.ecc_uncorrected_aggregate += fault.ecc_double_bit
            elif kind == "pending_row_remap":
                reading.remapped_rows_pending = fault.pending_row_remap
            elif kind == "gpu_lost":
                reading.lost = fault.gpu_lost
            elif kind == "thermal_throttle":
                reading.temperature_c = THROTTLED_TEMPERATURE_C
                reading.clock_event_reasons |= THERMAL_CLOCK_EVENT_REASONS
            elif kind == "nvlink_errors":
                self._add_nvlink_errors(reading, fault.nvlink_errors)
            elif kind == "slow_multiplier":
                self._multipliers[index] = _checked_multiplier(index, fault.slow_multiplier)
            elif kind == "sdc":
                self._rank_faults[index] = rank_pb2.RANK_FAULT_SDC
            elif kind == "nan":
                self._rank_faults[index] = rank_pb2.RANK_FAULT_NAN
            elif kind == "hang":
                self._rank_faults[index] = rank_pb2.RANK_FAULT_HANG
            elif kind == "fail_preflight":
                self._fail_preflight = True
            elif kind == "clear":
                self._readings[index] = healthy_reading(index, reading.uuid)
                self._multipliers[index] = 1.0
                self._rank_faults[index] = rank_pb2.RANK_FAULT_NONE
                self._fail_preflight = False
            else:  # a Fault kind added to the proto after this backend
                raise ValueError(f"fault kind {kind!r} is unknown to the simulated backend")

    def set_reading(self, gpu_index: int, **fields: Any) -> None:
        """Set raw readings that no Fault kind produces yet, e.g. retired pages,
        PCIe replays or width, the recovery action: `set_reading(0, pcie_link_width=8)`.
        """
        index = self._check_index(gpu_index)
        known = {field.name for field in common_pb2.GpuHealth.DESCRIPTOR.fields}
        for name in fields:
            if name not in known or name in _NOT_SETTABLE:
                settable = sorted(known - _NOT_SETTABLE)
                raise ValueError(f"GpuHealth field {name!r} cannot be set: use one of {settable}")
        with self._lock:
            updated = _copy(self._readings[index])
            for name, value in fields.items():
                if name == "unsupported":
                    del updated.unsupported[:]
                    updated.unsupported.extend(value)
                else:
                    setattr(updated, name, value)
            self._readings[index] = updated

    def slow_multiplier(self, gpu_index: int) -> float:
        index = self._check_index(gpu_index)
        with self._lock:
            return self._multipliers[index]

    def take_rank_fault(self, gpu_index: int) -> int:
        index = self._check_index(gpu_index)
        with self._lock:
            fault, self._rank_faults[index] = self._rank_faults[index], rank_pb2.RANK_FAULT_NONE
        return fault

    def take_preflight_fault(self) -> bool:
        with self._lock:
            fault, self._fail_preflight = self._fail_preflight, False
        return fault

    def close(self) -> None:
        with self._lock:
            self._on_xid = None

    def _inject_xid(self, index: int, xid: int) -> None:
        time_now = Timestamp()
        time_now.FromNanoseconds(int(self._clock() * 1e9))
        event = common_pb2.XidEvent(
            gpu_index=index,
            gpu_uuid=self._inventory[index].uuid,
            xid=xid,
            message=f"simulated Xid {xid}",
            time=time_now,
            source=common_pb2.XID_SOURCE_SIMULATED,
        )
        with self._lock:
            if xid == XID_GPU_FALLEN_OFF_BUS:
                self._readings[index].lost = True
            on_xid = self._on_xid
            if on_xid is None:
                self._undelivered.append(event)
        if on_xid is not None:
            on_xid(event)

    def _add_nvlink_errors(
        self, reading: common_pb2.GpuHealth, fault: common_pb2.NvLinkFault
    ) -> None:
        if fault.link >= len(reading.nvlinks):
            raise ValueError(
                f"NVLink link {fault.link} on GPU {reading.index}: "
                f"use 0 to {len(reading.nvlinks) - 1}"
            )
        link = reading.nvlinks[fault.link]
        link.crc_errors += fault.crc_errors
        if fault.down:
            link.active = False

    def _check_index(self, gpu_index: int) -> int:
        if not 0 <= gpu_index < len(self._inventory):
            raise ValueError(
                f"GPU index {gpu_index}: this node has GPUs 0 to {len(self._inventory) - 1}"
            )
        return gpu_index


def _checked_multiplier(index: int, value: float) -> float:
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(f"slow multiplier {value} for GPU {index}: use a finite number > 0")
    return value


def _copy(message: _M) -> _M:
    copy = type(message)()
    copy.CopyFrom(message)
    return copy
