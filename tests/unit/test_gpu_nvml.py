"""The NVML backend: against the real driver where there is one, and against a fake
driver everywhere (pynvml's own constants, errors and structs; only the calls are
faked), so the field mapping, error handling and the Xid thread are tested here too."""

# ruff: noqa: N802  (the fake keeps NVML's function names)

from __future__ import annotations

import ctypes
import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kit.hardware import NO_HARDWARE

pynvml = pytest.importorskip("pynvml")

from pitstop.agent.gpu import FaultNotSupported, GpuBackendError, kmsg, open_backend  # noqa: E402
from pitstop.agent.gpu.nvml import NvmlBackend  # noqa: E402
from pitstop.v1 import common_pb2  # noqa: E402


def nvml_init_error() -> str | None:
    """Why the real NVML cannot start here, or None when it can."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    return None


NVML_UNAVAILABLE = nvml_init_error()
needs_nvml = pytest.mark.skipif(
    NVML_UNAVAILABLE is not None,
    reason=f"{NO_HARDWARE}NVML cannot initialise here (no NVIDIA GPU?): {NVML_UNAVAILABLE}",
)


@needs_nvml
def test_real_gpus() -> None:
    backend = NvmlBackend()
    try:
        inventory = backend.inventory()
        assert inventory
        assert backend.driver_version()
        assert all(gpu.uuid.startswith(("GPU-", "MIG-")) and gpu.pci_bus_id for gpu in inventory)
        readings = backend.read_health()
        assert [r.index for r in readings] == [gpu.index for gpu in inventory]
        assert all(r.uuid for r in readings)
        backend.start_xid_watch(lambda event: None)
    finally:
        backend.close()
    assert not any(t.name == "pitstop-nvml-xid-watch" for t in threading.enumerate())


@pytest.mark.skipif(
    NVML_UNAVAILABLE is None, reason=f"{NO_HARDWARE}NVML works here: no driver-less case to try"
)
def test_open_backend_without_a_driver_says_what_to_do() -> None:
    with pytest.raises(GpuBackendError, match=r"--gpus sim:8") as raised:
        open_backend("nvml", "node-a")
    assert "NVML" in str(raised.value)


# A fake driver ---------------------------------------------------------------------


@dataclass
class FakeGpu:
    index: int
    values: dict[str, Any] = field(default_factory=dict)
    refuse: dict[str, int] = field(default_factory=dict)  # function name → NVML error code
    lost: bool = False
    links: int = 4


class FakeNvml:
    """pynvml with a fake driver: every attribute not defined here is pynvml's own."""

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = [FakeGpu(i) for i in range(gpus)]
        self.events: queue.Queue[Any] = queue.Queue()
        self.init_error: int | None = None
        self.initialised = False
        self.freed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(pynvml, name)

    def answer(self, gpu: FakeGpu, function: str, default: Any) -> Any:
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.refuse:
            raise pynvml.NVMLError(gpu.refuse[function])
        return gpu.values.get(function, default)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.answer(self.gpus[index], "handle", self.gpus[index])  # type: ignore[no-any-return]

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return f"GPU-fake-{gpu.index}"

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return self.answer(gpu, "name", "NVIDIA H100 80GB HBM3")  # type: ignore[no-any-return]

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        total = self.answer(gpu, "memory", 80 << 30)
        return SimpleNamespace(total=total, used=self.answer(gpu, "memory_used", 61 << 30))

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(busId=f"00000000:{0x18 + gpu.index:02X}:00.0".encode())

    def nvmlDeviceGetGpuFabricInfoV(self, gpu: FakeGpu, pointer: Any) -> None:
        fabric = pointer._obj
        self.answer(gpu, "fabric", None)
        fabric.clusterUuid[:] = list(uuid.UUID(int=0xABC).bytes)
        fabric.cliqueId = 7
        fabric.state = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        fabric.status = pynvml.NVML_SUCCESS

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self.answer(gpu, "temperature", 41)  # type: ignore[no-any-return]

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "power", 312_500)  # type: ignore[no-any-return]

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        return self.answer(gpu, "utilization", SimpleNamespace(gpu=87, memory=40))

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter: int) -> int:
        counts = {(1, 0): 2, (1, 1): 5, (0, 0): 10, (0, 1): 30}
        return int(self.answer(gpu, "ecc", counts)[(error_type, counter)])

    def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
        return self.answer(gpu, "remapped", (3, 1, 1, 0))  # type: ignore[no-any-return]

    def nvmlDeviceGetRetiredPages(self, gpu: FakeGpu, cause: int) -> list[int]:
        return self.answer(gpu, "retired", [0x1000] * (cause + 1))  # type: ignore[no-any-return]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "retired_pending", 1)  # type: ignore[no-any-return]

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "clocks", 0x40)  # type: ignore[no-any-return]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "throttle", 0x20)  # type: ignore[no-any-return]

    def nvmlDeviceGetPcieReplayCounter(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "replay", 9)  # type: ignore[no-any-return]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "gen", 4)  # type: ignore[no-any-return]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "gen_max", 5)  # type: ignore[no-any-return]

    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "width", 8)  # type: ignore[no-any-return]

    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: FakeGpu) -> int:
        return self.answer(gpu, "width_max", 16)  # type: ignore[no-any-return]

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, ids: list[int]) -> Any:
        assert ids == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        values = (pynvml.c_nvmlFieldValue_t * 1)()
        values[0].fieldId = ids[0]
        values[0].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        values[0].nvmlReturn = self.answer(gpu, "field_return", pynvml.NVML_SUCCESS)
        values[0].value.uiVal = self.answer(gpu, "recovery", 1)
        return values

    def nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int:
        self.answer(gpu, "nvlink", None)
        if link >= gpu.links:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 0 if link == 1 else 1

    def nvmlDeviceGetNvLinkErrorCounter(self, gpu: FakeGpu, link: int, counter: int) -> int:
        self.answer(gpu, "nvlink_counter", None)
        return {0: 100, 1: 10, 2: 3, 3: 4}.get(counter, 0) * (link + 1)

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, types: int, event_set: str) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError
        self.answer(gpu, "register", None)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        try:
            event = self.events.get(timeout=0.01)  # the real wait blocks up to timeout_ms
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        if isinstance(event, Exception):
            raise event
        return event

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed = True


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def backend(fake: FakeNvml) -> Iterator[NvmlBackend]:
    opened = NvmlBackend(nvml=fake, clock=lambda: 1_700_000_000.0)
    yield opened
    opened.close()


def test_inventory(backend: NvmlBackend) -> None:
    gpu = backend.inventory()[1]
    assert backend.name == "nvml"
    assert backend.driver_version() == "550.54.15"
    assert (gpu.index, gpu.uuid, gpu.name) == (1, "GPU-fake-1", "NVIDIA H100 80GB HBM3")
    assert gpu.memory_bytes == 80 << 30
    assert gpu.pci_bus_id == "00000000:19:00.0"
    assert gpu.fabric_cluster_uuid == str(uuid.UUID(int=0xABC))
    assert gpu.fabric_clique_id == 7


def test_inventory_survives_missing_fields(fake: FakeNvml) -> None:
    fake.gpus[0].refuse = {"fabric": pynvml.NVML_ERROR_NOT_SUPPORTED}
    fake.gpus[1].refuse = {"handle": pynvml.NVML_ERROR_UNKNOWN}
    backend = NvmlBackend(nvml=fake)
    inventory = backend.inventory()
    assert (inventory[0].fabric_cluster_uuid, inventory[0].fabric_clique_id) == ("", 0)
    assert inventory[1] == common_pb2.GpuInfo(index=1)
    assert backend.read_health()[1] == common_pb2.GpuHealth(index=1, lost=True)
    backend.close()


def test_every_reading(backend: NvmlBackend) -> None:
    reading = backend.read_health()[0]
    assert (reading.index, reading.uuid) == (0, "GPU-fake-0")
    assert reading.temperature_c == 41.0
    assert reading.power_w == 312.5
    assert reading.utilization_percent == 87.0
    assert reading.memory_used_bytes == 61 << 30
    assert (reading.ecc_corrected_volatile, reading.ecc_corrected_aggregate) == (10, 30)
    assert (reading.ecc_uncorrected_volatile, reading.ecc_uncorrected_aggregate) == (2, 5)
    assert (reading.remapped_rows_correctable, reading.remapped_rows_uncorrectable) == (3, 1)
    assert reading.remapped_rows_pending
    assert not reading.remapped_rows_failure
    assert (reading.retired_pages_single_bit, reading.retired_pages_double_bit) == (1, 2)
    assert reading.retired_pages_pending
    assert reading.clock_event_reasons == 0x40
    assert reading.pcie_replay_counter == 9
    assert (reading.pcie_link_gen, reading.pcie_link_gen_max) == (4, 5)
    assert (reading.pcie_link_width, reading.pcie_link_width_max) == (8, 16)
    assert reading.recovery_action == common_pb2.RECOVERY_ACTION_GPU_RESET
    assert [(link.link, link.active) for link in reading.nvlinks] == [
        (0, True),
        (1, False),
        (2, True),
        (3, True),
    ]
    link = reading.nvlinks[2]
    assert (link.crc_errors, link.replay_errors, link.recovery_errors) == (21, 300, 30)
    assert not reading.lost
    assert list(reading.unsupported) == []
    assert reading.verdict == common_pb2.HEALTH_VERDICT_UNSPECIFIED


def test_unsupported_fields_are_named_not_fatal(fake: FakeNvml, backend: NvmlBackend) -> None:
    not_supported = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.gpus[0].refuse = {
        name: not_supported
        for name in ("remapped", "retired", "power", "nvlink", "field_return", "clocks")
    }
    fake.gpus[0].refuse["gen"] = pynvml.NVML_ERROR_NO_PERMISSION
    fake.gpus[0].values["field_return"] = not_supported
    reading = backend.read_health()[0]
    assert set(reading.unsupported) == {
        "power_w",
        "remapped_rows_correctable",
        "remapped_rows_uncorrectable",
        "remapped_rows_pending",
        "remapped_rows_failure",
        "retired_pages_single_bit",
        "retired_pages_double_bit",
        "clock_event_reasons",
        "pcie_link_gen",
        "recovery_action",
        "nvlinks",
    }
    assert len(reading.unsupported) == len(set(reading.unsupported))
    assert reading.recovery_action == common_pb2.RECOVERY_ACTION_NOT_SUPPORTED
    assert reading.temperature_c == 41.0, "the other fields are still read"
    assert reading.ecc_uncorrected_volatile == 2
    assert backend.read_health()[1].unsupported == []


def test_older_driver_falls_back_to_throttle_reasons(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.gpus[0].refuse = {"clocks": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
    assert backend.read_health()[0].clock_event_reasons == 0x20


def test_lost_gpu(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.gpus[1].lost = True
    readings = backend.read_health()
    assert readings[1] == common_pb2.GpuHealth(index=1, uuid="GPU-fake-1", lost=True)
    assert not readings[0].lost


def test_xid_events_arrive_from_the_watch_thread(fake: FakeNvml, backend: NvmlBackend) -> None:
    seen: queue.Queue[common_pb2.XidEvent] = queue.Queue()
    backend.error_backoff_s = 0.0
    backend.start_xid_watch(seen.put)
    xid = pynvml.nvmlEventTypeXidCriticalError
    fake.events.put(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN))  # logged, not fatal
    fake.events.put(SimpleNamespace(device=fake.gpus[1], eventType=xid, eventData=79))
    fake.events.put(SimpleNamespace(device=fake.gpus[0], eventType=0x1, eventData=0))
    fake.events.put(SimpleNamespace(device=fake.gpus[0], eventType=xid, eventData=48))
    first, second = seen.get(timeout=5), seen.get(timeout=5)
    assert (first.gpu_index, first.gpu_uuid, first.xid) == (1, "GPU-fake-1", 79)
    assert first.source == common_pb2.XID_SOURCE_NVML_EVENT
    assert first.time.seconds == 1_700_000_000
    assert (second.gpu_index, second.xid) == (0, 48)
    backend.close()
    assert seen.empty()
    assert not any(t.name == "pitstop-nvml-xid-watch" for t in threading.enumerate())
    assert fake.freed
    assert not fake.initialised


def test_a_gpu_refusing_events_is_skipped(fake: FakeNvml, backend: NvmlBackend) -> None:
    fake.gpus[0].refuse = {"register": pynvml.NVML_ERROR_NOT_SUPPORTED}
    seen: queue.Queue[common_pb2.XidEvent] = queue.Queue()
    backend.start_xid_watch(seen.put)
    event = SimpleNamespace(device=fake.gpus[1], eventType=pynvml.nvmlEventTypeXidCriticalError)
    event.eventData = 94
    fake.events.put(event)
    assert seen.get(timeout=5).gpu_index == 1


def test_close_is_idempotent_and_needs_no_watch(fake: FakeNvml) -> None:
    backend = NvmlBackend(nvml=fake)
    backend.close()
    backend.close()
    assert not fake.initialised


def test_fault_injection_is_refused(backend: NvmlBackend) -> None:
    with pytest.raises(FaultNotSupported, match=r"NVML backend cannot inject a xid fault on GPU 1"):
        backend.inject_fault(common_pb2.Fault(gpu_index=1, xid=79))
    assert backend.slow_multiplier(0) == 1.0


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (
            pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
            "NVML is not available (libnvidia-ml.so.1 not found)",
        ),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "no loaded NVIDIA kernel driver"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "refused access"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML failed to initialise (Unknown Error)"),
    ],
)
def test_init_failure_says_what_to_do(fake: FakeNvml, code: int, message: str) -> None:
    fake.init_error = code
    with pytest.raises(GpuBackendError) as raised:
        NvmlBackend(nvml=fake)
    assert message in str(raised.value)
    assert str(raised.value).endswith("or run with --gpus sim:8")


def test_kernel_log_xids(backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    log = "NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=python, GPU has fallen off the bus.\n"
    monkeypatch.setattr(kmsg, "read_kernel_log", lambda: log)
    (event,) = backend.kernel_log_xids()
    assert (event.gpu_index, event.gpu_uuid, event.xid) == (1, "GPU-fake-1", 79)
    assert event.source == common_pb2.XID_SOURCE_KERNEL_LOG
    monkeypatch.setattr(kmsg, "read_kernel_log", lambda: None)
    assert backend.kernel_log_xids() == []


def test_handles_compare_by_address() -> None:
    from pitstop.agent.gpu.nvml import _handle_key

    device = pynvml.struct_c_nvmlDevice_t()
    one = ctypes.pointer(device)
    other = ctypes.cast(ctypes.addressof(device), pynvml.c_nvmlDevice_t)
    assert one is not other
    assert _handle_key(one) == _handle_key(other)


def test_a_call_missing_from_the_binding_is_unsupported(
    fake: FakeNvml, backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(*args: Any) -> None:
        raise AttributeError("module 'pynvml' has no attribute 'nvmlDeviceGetRetiredPages'")

    monkeypatch.setattr(fake, "nvmlDeviceGetRetiredPages", missing, raising=False)
    reading = backend.read_health()[0]
    assert {"retired_pages_single_bit", "retired_pages_double_bit"} <= set(reading.unsupported)
    assert reading.retired_pages_pending
