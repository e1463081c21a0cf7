"""Real GPUs through NVML (the nvidia-ml-py binding, imported as `pynvml`).

Every reading is taken field by field: a field the GPU or driver does not support is
named in `GpuHealth.unsupported` and never stops the others. A GPU that NVML has
lost is reported with `lost=True` and nothing else.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

import pitstop.agent.gpu.kmsg as kmsg
from pitstop.agent.gpu.base import FaultNotSupported, GpuBackend, GpuBackendError, XidCallback
from pitstop.v1 import common_pb2

log = logging.getLogger(__name__)

WAIT_TIMEOUT_MS = 500
SIM_HINT = "or run with --gpus sim:8"


def load_pynvml() -> Any:
    """The pynvml module, or GpuBackendError saying how to install it."""
    try:
        import pynvml
    except ImportError as exc:
        raise GpuBackendError(
            f"the NVML binding is not installed ({exc}): pip install 'pitstop[agent]' {SIM_HINT}"
        ) from exc
    return pynvml


def init_error(nvml: Any, exc: Exception) -> GpuBackendError:
    """A GpuBackendError for a failed nvmlInit, naming the cause and the fix."""
    if isinstance(exc, nvml.NVMLError_LibraryNotFound):
        why = "NVML is not available (libnvidia-ml.so.1 not found): install the NVIDIA driver"
    elif isinstance(exc, nvml.NVMLError_DriverNotLoaded):
        why = "NVML found no loaded NVIDIA kernel driver: load it (modprobe nvidia)"
    elif isinstance(exc, nvml.NVMLError_NoPermission):
        why = "NVML refused access to the GPUs: run the agent as a user allowed /dev/nvidia*"
    elif isinstance(exc, nvml.NVMLError_LibRmVersionMismatch):
        why = "NVML and the kernel driver versions differ: reboot or reload the driver"
    else:
        why = f"NVML failed to initialise ({exc}): check nvidia-smi"
    return GpuBackendError(f"{why} {SIM_HINT}")


class NvmlBackend(GpuBackend):
    """The node's GPUs as NVML sees them. NVML is initialised here and shut down by
    close(). `nvml` replaces the pynvml module (tests pass a fake)."""

    name = "nvml"
    error_backoff_s = 0.5
    """Pause after a failed event wait, so a persistent error cannot spin the thread."""

    def __init__(self, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        self._nvml = nvml if nvml is not None else load_pynvml()
        self._clock = clock
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise init_error(self._nvml, exc) from exc
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        try:
            self._driver_version = _text(self._nvml.nvmlSystemGetDriverVersion())
            count = int(self._nvml.nvmlDeviceGetCount())
        except self._nvml.NVMLError as exc:
            self._nvml.nvmlShutdown()
            raise GpuBackendError(
                f"NVML could not list the GPUs ({exc}): check nvidia-smi"
            ) from exc
        self._handles: list[Any] = []
        self._inventory: list[common_pb2.GpuInfo] = []
        for index in range(count):
            handle, info = self._probe(index)
            self._handles.append(handle)
            self._inventory.append(info)
        # NVLink links each GPU answered for at the first reading; None until then.
        self._links: list[list[int] | None] = [None] * count

    def driver_version(self) -> str:
        return self._driver_version

    def inventory(self) -> list[common_pb2.GpuInfo]:
        return [_copy_info(info) for info in self._inventory]

    def read_health(self) -> list[common_pb2.GpuHealth]:
        readings = []
        for info, handle in zip(self._inventory, self._handles, strict=True):
            reading = common_pb2.GpuHealth(index=info.index, uuid=info.uuid)
            if handle is None:
                reading.lost = True
            else:
                try:
                    self._links[info.index] = read_device_health(
                        self._nvml, handle, reading, self._links[info.index]
                    )
                except GpuLost:
                    reading = common_pb2.GpuHealth(index=info.index, uuid=info.uuid, lost=True)
            readings.append(reading)
        return readings

    def start_xid_watch(self, on_xid: XidCallback) -> None:
        if self._thread is not None:
            raise RuntimeError("the Xid watch is already running")
        nvml = self._nvml
        self._event_set = nvml.nvmlEventSetCreate()
        handle_index: dict[int, int] = {}
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._event_set
                )
            except nvml.NVMLError as exc:
                log.warning("GPU %d does not report Xid events through NVML: %s", index, exc)
                continue
            handle_index[_handle_key(handle)] = index
        self._thread = threading.Thread(
            target=self._watch_xids,
            args=(on_xid, handle_index),
            name="pitstop-nvml-xid-watch",
        )
        self._thread.start()

    def inject_fault(self, fault: common_pb2.Fault) -> None:
        raise FaultNotSupported(
            f"the NVML backend cannot inject a {fault.WhichOneof('kind')} fault on GPU "
            f"{fault.gpu_index}: NVML only reads; run the agent with --gpus sim:N for drills"
        )

    def slow_multiplier(self, gpu_index: int) -> float:
        return 1.0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._event_set is not None:
                self._nvml.nvmlEventSetFree(self._event_set)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.warning("NVML shutdown failed: %s", exc)

    def kernel_log_xids(self) -> list[common_pb2.XidEvent]:
        text = kmsg.read_kernel_log()
        if text is None:
            log.info("no kernel log reader works here (dmesg, journalctl): skipping past Xids")
            return []
        bus_ids = {info.pci_bus_id: info.index for info in self._inventory if info.pci_bus_id}
        events = kmsg.parse_xid_lines(text, bus_ids)
        for event in events:
            event.gpu_uuid = self._inventory[event.gpu_index].uuid
        return events

    def _probe(self, index: int) -> tuple[Any, common_pb2.GpuInfo]:
        """The handle (None when the GPU cannot be reached) and inventory of GPU `index`."""
        nvml = self._nvml
        info = common_pb2.GpuInfo(index=index)
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            info.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError as exc:
            log.error("GPU %d cannot be reached through NVML (%s): reporting it lost", index, exc)
            return None, info

        def optional(what: str, read: Callable[[], Any]) -> Any:
            try:
                return read()
            except nvml.NVMLError as exc:
                log.warning("GPU %d: NVML gives no %s: %s", index, what, exc)
                return None

        info.name = optional("name", lambda: _text(nvml.nvmlDeviceGetName(handle))) or ""
        info.memory_bytes = optional("memory size", lambda: _memory_total(nvml, handle)) or 0
        info.pci_bus_id = optional("PCI bus id", lambda: _bus_id(nvml, handle)) or ""
        fabric = optional("fabric info", lambda: _read_fabric(nvml, handle))
        if fabric is not None:
            info.fabric_cluster_uuid, info.fabric_clique_id = fabric
        return handle, info

    def _watch_xids(self, on_xid: XidCallback, handle_index: dict[int, int]) -> None:
        nvml = self._nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, WAIT_TIMEOUT_MS)
            except nvml.NVMLError_Timeout:
                continue
            except nvml.NVMLError as exc:
                log.warning("waiting for NVML events failed: %s", exc)
                self._stop.wait(self.error_backoff_s)
                continue
            if not int(data.eventType) & nvml.nvmlEventTypeXidCriticalError:
                continue
            event = self._xid_event(data, handle_index)
            try:
                on_xid(event)
            except Exception:  # the watch must outlive a faulty consumer
                log.exception("the Xid callback failed on %s", event)

    def _xid_event(self, data: Any, handle_index: dict[int, int]) -> common_pb2.XidEvent:
        index = handle_index.get(_handle_key(data.device))
        if index is None:
            try:
                event_uuid = _text(self._nvml.nvmlDeviceGetUUID(data.device))
            except self._nvml.NVMLError:
                event_uuid = ""
            index = next((i.index for i in self._inventory if i.uuid == event_uuid), 0)
        now = Timestamp()
        now.FromNanoseconds(int(self._clock() * 1e9))
        return common_pb2.XidEvent(
            gpu_index=index,
            gpu_uuid=self._inventory[index].uuid if self._inventory else "",
            xid=int(data.eventData),
            time=now,
            source=common_pb2.XID_SOURCE_NVML_EVENT,
        )


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> int:
    """A device handle as a number, so the event's handle can be matched to an index."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
    return address if address is not None else id(handle)


def _memory_total(nvml: Any, handle: Any) -> int:
    return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)


def _bus_id(nvml: Any, handle: Any) -> str:
    return _text(nvml.nvmlDeviceGetPciInfo(handle).busId)


def _read_fabric(nvml: Any, handle: Any) -> tuple[str, int] | None:
    """NVLink fabric cluster uuid and clique id (NVL72-class systems); None when the
    GPU has no fabric or its registration has not completed."""
    fabric: Any = None
    if hasattr(nvml, "nvmlDeviceGetGpuFabricInfoV"):
        fabric = nvml.c_nvmlGpuFabricInfoV_t()
        try:
            nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(fabric))
        except nvml.NVMLError_FunctionNotFound:  # driver older than the binding
            fabric = None
    if fabric is None:
        fabric = nvml.c_nvmlGpuFabricInfo_t()
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(fabric))
    if fabric.state != nvml.NVML_GPU_FABRIC_STATE_COMPLETED or fabric.status != nvml.NVML_SUCCESS:
        return None
    cluster = bytes(fabric.clusterUuid)
    return (str(uuid.UUID(bytes=cluster)) if any(cluster) else ""), int(fabric.cliqueId)


def _copy_info(info: common_pb2.GpuInfo) -> common_pb2.GpuInfo:
    copy = common_pb2.GpuInfo()
    copy.CopyFrom(info)
    return copy


class GpuLost(Exception):
    """NVML said GPU_IS_LOST: the GPU fell off the bus or stopped answering."""


# NVML_RECOVERY_ACTION_* (nvml.h) to the wire. Values the wire has no name for ask
# for at least as much as their nearest wire value, so no action is ever understated.
_RECOVERY_ACTIONS = {
    0: common_pb2.RECOVERY_ACTION_NONE,
    1: common_pb2.RECOVERY_ACTION_GPU_RESET,
    2: common_pb2.RECOVERY_ACTION_NODE_REBOOT,
    3: common_pb2.RECOVERY_ACTION_DRAIN_P2P,
    4: common_pb2.RECOVERY_ACTION_DRAIN_AND_RESET,
    5: common_pb2.RECOVERY_ACTION_DRAIN_AND_RESET,  # RECOVER_IMEX_DOMAIN
    6: common_pb2.RECOVERY_ACTION_GPU_RESET,  # BUS_RESET
    7: common_pb2.RECOVERY_ACTION_NODE_REBOOT,  # SYSTEM_REBOOT
}


def read_device_health(
    nvml: Any, handle: Any, reading: common_pb2.GpuHealth, links: list[int] | None
) -> list[int]:
    """Fill `reading` from the GPU behind `handle`; returns the NVLink links it has.

    `links` are the links found at an earlier reading (None: probe every possible
    link). Raises GpuLost as soon as NVML reports the GPU lost.
    """

    def field(names: tuple[str, ...], read: Callable[[], Any]) -> Any:
        try:
            return read()
        except nvml.NVMLError_GpuIsLost as exc:
            raise GpuLost from exc
        # NOT_SUPPORTED, NO_PERMISSION, ... or a call this binding no longer has
        # (several are deprecated): this field only.
        except (nvml.NVMLError, AttributeError):
            reading.unsupported.extend([n for n in names if n not in reading.unsupported])
            return None

    def ecc(kind: str, counter: str) -> Callable[[], int]:
        error_type = getattr(nvml, f"NVML_MEMORY_ERROR_TYPE_{kind}")
        counter_type = getattr(nvml, f"NVML_{counter}_ECC")
        return lambda: int(nvml.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type))

    def retired(cause: str) -> Callable[[], int]:
        source = getattr(nvml, f"NVML_PAGE_RETIREMENT_CAUSE_{cause}")
        return lambda: len(nvml.nvmlDeviceGetRetiredPages(handle, source))

    scalars: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("temperature_c", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        ("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        ("utilization_percent", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        ("memory_used_bytes", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
        ("ecc_corrected_volatile", ecc("CORRECTED", "VOLATILE")),
        ("ecc_uncorrected_volatile", ecc("UNCORRECTED", "VOLATILE")),
        ("ecc_corrected_aggregate", ecc("CORRECTED", "AGGREGATE")),
        ("ecc_uncorrected_aggregate", ecc("UNCORRECTED", "AGGREGATE")),
        ("retired_pages_single_bit", retired("MULTIPLE_SINGLE_BIT_ECC_ERRORS")),
        ("retired_pages_double_bit", retired("DOUBLE_BIT_ECC_ERROR")),
        ("retired_pages_pending", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)),
        ("clock_event_reasons", lambda: _clock_event_reasons(nvml, handle)),
        ("pcie_replay_counter", lambda: nvml.nvmlDeviceGetPcieReplayCounter(handle)),
        ("pcie_link_gen", lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
        ("pcie_link_gen_max", lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
        ("pcie_link_width", lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
        ("pcie_link_width_max", lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)),
    )
    for name, read in scalars:
        value = field((name,), read)
        if value is not None:
            python_type = type(getattr(reading, name))
            setattr(reading, name, python_type(value))

    rows = ("remapped_rows_correctable", "remapped_rows_uncorrectable")
    flags = ("remapped_rows_pending", "remapped_rows_failure")
    remapped = field(rows + flags, lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    if remapped is not None:
        for name, value in zip(rows + flags, remapped, strict=True):
            setattr(reading, name, bool(value) if name in flags else int(value))

    action = None
    if hasattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"):
        action = field(("recovery_action",), lambda: _recovery_action(nvml, handle))
    elif "recovery_action" not in reading.unsupported:
        reading.unsupported.append("recovery_action")
    reading.recovery_action = (
        action if action is not None else common_pb2.RECOVERY_ACTION_NOT_SUPPORTED
    )

    return _read_nvlinks(nvml, handle, reading, links, field)


def _read_nvlinks(
    nvml: Any,
    handle: Any,
    reading: common_pb2.GpuHealth,
    links: list[int] | None,
    field: Callable[[tuple[str, ...], Callable[[], Any]], Any],
) -> list[int]:
    def counter(link: int, name: str) -> Callable[[], int]:
        kind = getattr(nvml, f"NVML_NVLINK_ERROR_DL_{name}")
        return lambda: int(nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, kind))

    found: list[int] = []
    candidates = links if links is not None else range(nvml.NVML_NVLINK_MAX_LINKS)
    for link in candidates:
        try:
            active = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError_GpuIsLost as exc:
            raise GpuLost from exc
        except nvml.NVMLError:  # the GPU has no such link
            continue
        found.append(link)
        status = reading.nvlinks.add(link=link, active=bool(active))
        flit = field(("nvlinks.crc_errors",), counter(link, "CRC_FLIT"))
        data = field(("nvlinks.crc_errors",), counter(link, "CRC_DATA"))
        status.crc_errors = (flit or 0) + (data or 0)
        status.replay_errors = field(("nvlinks.replay_errors",), counter(link, "REPLAY")) or 0
        status.recovery_errors = field(("nvlinks.recovery_errors",), counter(link, "RECOVERY")) or 0
    if not found:
        reading.unsupported.append("nvlinks")
    return found


def _clock_event_reasons(nvml: Any, handle: Any) -> int:
    """nvmlDeviceGetCurrentClocksEventReasons, or its older name on older drivers."""
    current = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if current is not None:
        try:
            return int(current(handle))
        except nvml.NVMLError_FunctionNotFound:
            pass
    return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _recovery_action(nvml: Any, handle: Any) -> int:
    (value,) = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        raise nvml.NVMLError(value.nvmlReturn)
    raw = _field_number(nvml, value)
    return _RECOVERY_ACTIONS.get(raw, common_pb2.RECOVERY_ACTION_DRAIN_AND_RESET)


def _field_number(nvml: Any, value: Any) -> int:
    """The integer in an nvmlFieldValue_t, whatever its declared type."""
    member = {
        nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    }.get(value.valueType, "uiVal")
    return int(getattr(value.value, member))
