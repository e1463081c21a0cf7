"""The simulated GPU backend: deterministic identities, one fault → exactly its fields."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from pitstop.agent.gpu import (
    FaultNotSupported,
    GpuBackend,
    GpuBackendError,
    SimulatedBackend,
    open_backend,
)
from pitstop.v1 import common_pb2, rank_pb2

NOW = 1_700_000_000.5


def backend(count: int = 2) -> SimulatedBackend:
    return SimulatedBackend("node-a", count, clock=lambda: NOW)


def changed(before: common_pb2.GpuHealth, after: common_pb2.GpuHealth) -> set[str]:
    """Names of the fields that differ; NVLink fields as nvlinks[i].field."""
    names = set()
    for field in common_pb2.GpuHealth.DESCRIPTOR.fields:
        if field.name == "nvlinks":
            continue
        if getattr(before, field.name) != getattr(after, field.name):
            names.add(field.name)
    for old, new in zip(before.nvlinks, after.nvlinks, strict=True):
        for field in common_pb2.NvLinkStatus.DESCRIPTOR.fields:
            if getattr(old, field.name) != getattr(new, field.name):
                names.add(f"nvlinks[{old.link}].{field.name}")
    return names


def test_inventory_is_deterministic() -> None:
    first, second = backend(3).inventory(), backend(3).inventory()
    assert first == second
    assert [gpu.index for gpu in first] == [0, 1, 2]
    assert first[2].uuid == "GPU-sim-node-a-2"
    assert first[0].name == "Simulated H100 80GB HBM3"
    assert first[0].memory_bytes == 80 * 1024**3
    assert [gpu.pci_bus_id for gpu in first] == [
        "00000000:18:00.0",
        "00000000:19:00.0",
        "00000000:1a:00.0",
    ]
    assert backend().driver_version() == "sim"
    assert backend().name == "sim"
    assert backend().inventory()[0].uuid != SimulatedBackend("node-b", 1).inventory()[0].uuid


def test_healthy_by_default() -> None:
    readings = backend().read_health()
    assert [reading.index for reading in readings] == [0, 1]
    reading = readings[1]
    assert reading.uuid == "GPU-sim-node-a-1"
    assert reading.temperature_c == pytest.approx(40, abs=10)
    assert reading.power_w == pytest.approx(300, abs=100)
    assert len(reading.nvlinks) == 18
    assert all(link.active and link.crc_errors == 0 for link in reading.nvlinks)
    assert (reading.pcie_link_gen, reading.pcie_link_width) == (5, 16)
    assert (reading.pcie_link_gen_max, reading.pcie_link_width_max) == (5, 16)
    assert reading.recovery_action == common_pb2.RECOVERY_ACTION_NONE
    assert not reading.lost
    assert not reading.unsupported
    assert reading.verdict == common_pb2.HEALTH_VERDICT_UNSPECIFIED


@pytest.mark.parametrize(
    ("fault", "fields"),
    [
        (
            common_pb2.Fault(ecc_double_bit=3),
            {"ecc_uncorrected_volatile": 3, "ecc_uncorrected_aggregate": 3},
        ),
        (common_pb2.Fault(pending_row_remap=True), {"remapped_rows_pending": True}),
        (
            common_pb2.Fault(thermal_throttle=True),
            {"temperature_c": 95.0, "clock_event_reasons": 0x60},
        ),
        (
            common_pb2.Fault(nvlink_errors=common_pb2.NvLinkFault(link=4, crc_errors=7)),
            {"nvlinks[4].crc_errors": 7},
        ),
        (
            common_pb2.Fault(nvlink_errors=common_pb2.NvLinkFault(link=17, down=True)),
            {"nvlinks[17].active": False},
        ),
    ],
    ids=["ecc", "row-remap", "thermal", "nvlink-crc", "nvlink-down"],
)
def test_each_fault_changes_exactly_its_fields(
    fault: common_pb2.Fault, fields: dict[str, Any]
) -> None:
    sim = backend()
    before = sim.read_health()
    fault.gpu_index = 1
    sim.inject_fault(fault)
    after = sim.read_health()
    assert after[0] == before[0], "another GPU changed"
    assert changed(before[1], after[1]) == set(fields)
    for name, value in fields.items():
        if name.startswith("nvlinks["):
            link, attribute = name[len("nvlinks[") :].split("].")
            assert getattr(after[1].nvlinks[int(link)], attribute) == value
        else:
            assert getattr(after[1], name) == value
    sim.inject_fault(common_pb2.Fault(gpu_index=1, clear=True))
    assert sim.read_health() == before


def test_gpu_lost_reports_nothing_but_lost() -> None:
    sim = backend()
    sim.inject_fault(common_pb2.Fault(gpu_index=0, gpu_lost=True))
    lost = sim.read_health()[0]
    assert lost == common_pb2.GpuHealth(index=0, uuid="GPU-sim-node-a-0", lost=True)
    sim.inject_fault(common_pb2.Fault(gpu_index=0, clear=True))
    assert not sim.read_health()[0].lost


def test_xid_calls_back_at_once_and_79_loses_the_gpu() -> None:
    sim = backend()
    seen: list[common_pb2.XidEvent] = []
    sim.start_xid_watch(seen.append)
    sim.inject_fault(common_pb2.Fault(gpu_index=1, xid=48))
    assert len(seen) == 1
    event = seen[0]
    assert (event.gpu_index, event.gpu_uuid, event.xid) == (1, "GPU-sim-node-a-1", 48)
    assert event.source == common_pb2.XID_SOURCE_SIMULATED
    assert event.time.ToNanoseconds() == int(NOW * 1e9)
    assert not sim.read_health()[1].lost, "only Xid 79 loses the GPU"
    sim.inject_fault(common_pb2.Fault(gpu_index=1, xid=79))
    assert [e.xid for e in seen] == [48, 79]
    assert sim.read_health()[1].lost
    sim.close()


def test_xid_before_the_watch_is_delivered_when_it_starts() -> None:
    sim = backend()
    sim.inject_fault(common_pb2.Fault(gpu_index=0, xid=13))
    seen: list[common_pb2.XidEvent] = []
    sim.start_xid_watch(seen.append)
    assert [e.xid for e in seen] == [13]


def test_slow_multiplier() -> None:
    sim = backend()
    assert sim.slow_multiplier(1) == 1.0
    before = sim.read_health()
    sim.inject_fault(common_pb2.Fault(gpu_index=1, slow_multiplier=2.5))
    assert sim.slow_multiplier(1) == 2.5
    assert sim.slow_multiplier(0) == 1.0
    assert sim.read_health() == before, "slowness is not a health reading"
    sim.inject_fault(common_pb2.Fault(gpu_index=1, clear=True))
    assert sim.slow_multiplier(1) == 1.0


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_bad_slow_multiplier_is_refused(value: float) -> None:
    sim = backend()
    with pytest.raises(ValueError, match="slow multiplier"):
        sim.inject_fault(common_pb2.Fault(gpu_index=0, slow_multiplier=value))
    assert sim.slow_multiplier(0) == 1.0


def test_bad_index_names_index_and_range() -> None:
    sim = backend()
    with pytest.raises(ValueError, match=r"GPU index 2: this node has GPUs 0 to 1"):
        sim.inject_fault(common_pb2.Fault(gpu_index=2, xid=79))
    with pytest.raises(ValueError, match="GPU index 5"):
        sim.slow_multiplier(5)
    with pytest.raises(ValueError, match="GPU index 9"):
        sim.set_reading(9, pcie_link_width=8)


def test_malformed_faults_are_refused() -> None:
    sim = backend()
    with pytest.raises(ValueError, match="names no kind"):
        sim.inject_fault(common_pb2.Fault(gpu_index=0))
    link = common_pb2.NvLinkFault(link=18, crc_errors=1)
    with pytest.raises(ValueError, match="NVLink link 18 on GPU 0: use 0 to 17"):
        sim.inject_fault(common_pb2.Fault(gpu_index=0, nvlink_errors=link))


def test_set_reading_for_fields_without_a_fault_kind() -> None:
    sim = backend()
    before = sim.read_health()[0]
    sim.set_reading(
        0,
        retired_pages_double_bit=2,
        retired_pages_pending=True,
        pcie_replay_counter=120,
        pcie_link_width=8,
        recovery_action=common_pb2.RECOVERY_ACTION_GPU_RESET,
        unsupported=["remapped_rows_pending"],
    )
    after = sim.read_health()[0]
    assert changed(before, after) == {
        "retired_pages_double_bit",
        "retired_pages_pending",
        "pcie_replay_counter",
        "pcie_link_width",
        "recovery_action",
        "unsupported",
    }
    assert after.recovery_action == common_pb2.RECOVERY_ACTION_GPU_RESET
    with pytest.raises(ValueError, match="'uuid' cannot be set"):
        sim.set_reading(0, uuid="GPU-other")
    with pytest.raises(ValueError, match="'no_such_field' cannot be set"):
        sim.set_reading(0, no_such_field=1)
    assert sim.read_health()[0] == after, "a refused set_reading changes nothing"


def test_readings_are_copies() -> None:
    sim = backend()
    sim.read_health()[0].temperature_c = 1000
    sim.inventory()[0].uuid = "changed"
    assert sim.read_health()[0].temperature_c == 40
    assert sim.inventory()[0].uuid == "GPU-sim-node-a-0"


def test_faults_from_one_thread_while_reading_in_another() -> None:
    sim = backend()
    rounds = 2000
    start = threading.Barrier(2)

    def inject() -> None:
        start.wait()
        for _ in range(rounds):
            sim.inject_fault(common_pb2.Fault(gpu_index=0, ecc_double_bit=1))

    injector = threading.Thread(target=inject)
    injector.start()
    start.wait()
    last = 0
    while injector.is_alive():
        reading = sim.read_health()[0]
        # Both counters move together under the lock: never a half-applied fault.
        assert reading.ecc_uncorrected_volatile == reading.ecc_uncorrected_aggregate
        assert reading.ecc_uncorrected_volatile >= last
        last = reading.ecc_uncorrected_volatile
    injector.join()
    assert sim.read_health()[0].ecc_uncorrected_volatile == rounds


@pytest.mark.parametrize("spec", ["sim:1", "sim:8", "sim:64", " sim:8 "])
def test_open_backend_sim(spec: str) -> None:
    opened = open_backend(spec, "node-z")
    assert isinstance(opened, GpuBackend)
    assert opened.name == "sim"
    assert len(opened.inventory()) == int(spec.strip().split(":")[1])
    opened.close()


@pytest.mark.parametrize("spec", ["sim:x", "sim:0", "sim:65", "sim:", "sim", "sim:-1", "cuda", ""])
def test_open_backend_refuses_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match=r"use nvml or sim:N with N from 1 to 64") as raised:
        open_backend(spec, "node-z")
    assert repr(spec) in str(raised.value)


def test_error_types_are_distinct() -> None:
    assert not issubclass(FaultNotSupported, GpuBackendError)
    assert not issubclass(GpuBackendError, FaultNotSupported)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (common_pb2.Fault(sdc=True), rank_pb2.RANK_FAULT_SDC),
        (common_pb2.Fault(nan=True), rank_pb2.RANK_FAULT_NAN),
        (common_pb2.Fault(hang=True), rank_pb2.RANK_FAULT_HANG),
    ],
    ids=["sdc", "nan", "hang"],
)
def test_a_rank_fault_is_handed_to_its_gpus_rank_once_and_leaves_the_readings(
    fault: common_pb2.Fault, expected: int
) -> None:
    sim = backend()
    before = sim.read_health()
    fault.gpu_index = 1
    sim.inject_fault(fault)
    assert sim.read_health() == before  # nothing NVML reads: only the rank notices
    assert sim.take_rank_fault(0) == rank_pb2.RANK_FAULT_NONE
    assert sim.take_rank_fault(1) == expected
    assert sim.take_rank_fault(1) == rank_pb2.RANK_FAULT_NONE  # carried out once
    sim.inject_fault(fault)
    sim.inject_fault(common_pb2.Fault(gpu_index=1, clear=True))
    assert sim.take_rank_fault(1) == rank_pb2.RANK_FAULT_NONE


def test_utilization_and_memory_in_use_are_exported_per_gpu() -> None:
    from prometheus_client import generate_latest

    from pitstop.agent.metrics import AgentMetrics
    from pitstop.health.verdict import assess_gpu

    sim = backend()
    sim.set_reading(1, utilization_percent=87.0, memory_used_bytes=61 << 30)
    metrics = AgentMetrics("n1")
    metrics.observe_health([assess_gpu(r, previous=None) for r in sim.read_health()])
    text = generate_latest(metrics.registry).decode()
    uuid = sim.inventory()[1].uuid
    labels = f'gpu="1",node="n1",uuid="{uuid}"'
    assert f"pitstop_agent_gpu_utilization_ratio{{{labels}}} 0.87" in text
    assert f"pitstop_agent_gpu_memory_used_bytes{{{labels}}} 6.5498251264e+10" in text
