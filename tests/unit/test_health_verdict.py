"""Per-GPU and per-node health verdicts (pitstop.health.verdict)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.health.verdict import (
    THERMAL_CLOCK_EVENT_MASK,
    HealthThresholds,
    assess_gpu,
    assess_node,
    worst_verdict,
)
from pitstop.v1 import common_pb2

HEALTHY = common_pb2.HEALTH_VERDICT_HEALTHY
APPLICATION = common_pb2.HEALTH_VERDICT_APPLICATION
WARNING = common_pb2.HEALTH_VERDICT_WARNING
FATAL = common_pb2.HEALTH_VERDICT_FATAL
VERDICTS = {HEALTHY, APPLICATION, WARNING, FATAL}

Edit = Callable[[common_pb2.GpuHealth], None]


def reading(index: int = 3, **fields: Any) -> common_pb2.GpuHealth:
    """A healthy H100-like reading, with `fields` overridden."""
    gpu = common_pb2.GpuHealth(
        index=index,
        uuid=f"GPU-{index}",
        temperature_c=55.0,
        power_w=500.0,
        pcie_link_gen=5,
        pcie_link_gen_max=5,
        pcie_link_width=16,
        pcie_link_width_max=16,
        pcie_replay_counter=10,
        recovery_action=common_pb2.RECOVERY_ACTION_NONE,
        nvlinks=[common_pb2.NvLinkStatus(link=n, active=True) for n in range(4)],
    )
    for name, value in fields.items():
        if name == "nvlinks":
            del gpu.nvlinks[:]
            gpu.nvlinks.extend(value)
        elif name in ("unsupported", "reasons"):
            getattr(gpu, name).extend(value)
        else:
            setattr(gpu, name, value)
    return gpu


def link(n: int, *, active: bool = True, crc: int = 0, replay: int = 0, recovery: int = 0) -> Any:
    return common_pb2.NvLinkStatus(
        link=n, active=active, crc_errors=crc, replay_errors=replay, recovery_errors=recovery
    )


def test_a_healthy_reading_is_healthy_with_no_reasons() -> None:
    out = assess_gpu(reading(), previous=reading())
    assert out.verdict == HEALTHY
    assert list(out.reasons) == []


# (case id, current reading fields, previous reading fields or None, verdict, reason text)
RULES: list[tuple[str, dict[str, Any], dict[str, Any] | None, int, str]] = [
    ("lost", {"lost": True}, {}, FATAL, "GPU 3: lost"),
    (
        "row remap failure",
        {"remapped_rows_failure": True},
        {},
        FATAL,
        "GPU 3: row remapping failed",
    ),
    (
        "ecc grew",
        {"ecc_uncorrected_volatile": 5},
        {"ecc_uncorrected_volatile": 3},
        FATAL,
        "GPU 3: uncorrected ECC errors grew by 2 to 5",
    ),
    (
        "ecc with no previous",
        {"ecc_uncorrected_volatile": 2},
        None,
        FATAL,
        "GPU 3: 2 uncorrected ECC errors",
    ),
    (
        "ecc after counter reset",
        {"ecc_uncorrected_volatile": 1},
        {"ecc_uncorrected_volatile": 4},
        FATAL,
        "GPU 3: 1 uncorrected ECC errors",
    ),
    ("row remap pending", {"remapped_rows_pending": True}, {}, WARNING, "GPU 3: row remap pending"),
    (
        "page retirement pending",
        {"retired_pages_pending": True},
        {},
        WARNING,
        "GPU 3: page retirement pending",
    ),
    (
        "recovery action",
        {"recovery_action": common_pb2.RECOVERY_ACTION_GPU_RESET},
        {},
        WARNING,
        "GPU 3: driver asks for recovery action GPU_RESET",
    ),
    (
        "nvlink crc grew",
        {"nvlinks": [link(0), link(4, crc=20)]},
        {"nvlinks": [link(0), link(4, crc=8)]},
        WARNING,
        "GPU 3: NVLink 4 CRC errors grew by 12",
    ),
    (
        "nvlink replay grew",
        {"nvlinks": [link(1, replay=1)]},
        {"nvlinks": [link(1)]},
        WARNING,
        "GPU 3: NVLink 1 replay errors grew by 1",
    ),
    (
        "nvlink recovery grew",
        {"nvlinks": [link(2, recovery=3)]},
        {"nvlinks": [link(2, recovery=1)]},
        WARNING,
        "GPU 3: NVLink 2 recovery errors grew by 2",
    ),
    (
        "nvlink went down",
        {"nvlinks": [link(5, active=False)]},
        {"nvlinks": [link(5)]},
        WARNING,
        "GPU 3: NVLink 5 went down",
    ),
    (
        "pcie width degraded",
        {"pcie_link_width": 8},
        {},
        WARNING,
        "GPU 3: PCIe link runs at x8, below its x16",
    ),
    (
        "pcie gen degraded",
        {"pcie_link_gen": 3},
        {},
        WARNING,
        "GPU 3: PCIe link runs at gen 3, below its gen 5",
    ),
    (
        "pcie replays grew",
        {"pcie_replay_counter": 250},
        {"pcie_replay_counter": 150},
        WARNING,
        "GPU 3: PCIe replay counter grew by 100",
    ),
    ("fatal xid", {"xids": [79]}, {}, FATAL, "GPU 3: Xid 79 (GPU has fallen off the bus)"),
    ("warning xid", {"xids": [94]}, {}, WARNING, "GPU 3: Xid 94 (Contained ECC error)"),
    ("unknown xid", {"xids": [4242]}, {}, WARNING, "GPU 3: Xid 4242 (unknown Xid 4242)"),
    ("application xid", {"xids": [31]}, {}, APPLICATION, "GPU 3: Xid 31 (GPU memory page fault)"),
    ("info xid", {"xids": [106]}, {}, HEALTHY, "GPU 3: Xid 106"),
]


def _assess(current: dict[str, Any], previous: dict[str, Any] | None) -> common_pb2.GpuHealth:
    fields = dict(current)
    xids = fields.pop("xids", ())
    prev = None if previous is None else reading(**previous)
    return assess_gpu(reading(**fields), previous=prev, xids=xids)


@pytest.mark.parametrize(
    ("current", "previous", "verdict", "reason"),
    [rule[1:] for rule in RULES],
    ids=[rule[0] for rule in RULES],
)
def test_each_rule_sets_its_verdict_and_one_reason_naming_gpu_and_value(
    current: dict[str, Any], previous: dict[str, Any] | None, verdict: int, reason: str
) -> None:
    out = _assess(current, previous)
    assert out.verdict == verdict
    assert len(out.reasons) == 1
    assert out.reasons[0].startswith(reason)


# (case id, field that goes unsupported, current fields, previous fields)
UNSUPPORTED: list[tuple[str, str, dict[str, Any], dict[str, Any] | None]] = [
    ("row remap failure", "remapped_rows_failure", {"remapped_rows_failure": True}, {}),
    ("ecc", "ecc_uncorrected_volatile", {"ecc_uncorrected_volatile": 7}, None),
    ("row remap pending", "remapped_rows_pending", {"remapped_rows_pending": True}, {}),
    ("page retirement", "retired_pages_pending", {"retired_pages_pending": True}, {}),
    (
        "recovery action",
        "recovery_action",
        {"recovery_action": common_pb2.RECOVERY_ACTION_NODE_REBOOT},
        {},
    ),
    ("nvlinks", "nvlinks", {"nvlinks": [link(0, active=False, crc=9)]}, {"nvlinks": [link(0)]}),
    ("pcie width", "pcie_link_width", {"pcie_link_width": 4}, {}),
    ("pcie width max", "pcie_link_width_max", {"pcie_link_width": 4}, {}),
    ("pcie gen", "pcie_link_gen", {"pcie_link_gen": 1}, {}),
    ("pcie gen max", "pcie_link_gen_max", {"pcie_link_gen": 1}, {}),
    ("pcie replays", "pcie_replay_counter", {"pcie_replay_counter": 10**6}, {}),
    ("clock events", "clock_event_reasons", {"clock_event_reasons": 0x40}, {}),
    ("temperature", "temperature_c", {"temperature_c": 120.0}, {}),
]


@pytest.mark.parametrize(
    ("field", "current", "previous"),
    [case[1:] for case in UNSUPPORTED],
    ids=[case[0] for case in UNSUPPORTED],
)
def test_unsupported_fields_are_skipped_never_failures(
    field: str, current: dict[str, Any], previous: dict[str, Any] | None
) -> None:
    out = _assess({**current, "unsupported": [field]}, previous)
    assert out.verdict == HEALTHY
    assert list(out.reasons) == []


def test_a_field_the_previous_reading_lacked_is_judged_as_if_there_were_no_previous() -> None:
    prev = reading(unsupported=["ecc_uncorrected_volatile", "pcie_replay_counter", "nvlinks"])
    out = assess_gpu(
        reading(
            ecc_uncorrected_volatile=0,
            pcie_replay_counter=10**6,
            nvlinks=[link(0, active=False, crc=50)],
        ),
        previous=prev,
    )
    assert out.verdict == HEALTHY


@pytest.mark.parametrize(
    ("action", "verdict"),
    [
        (common_pb2.RECOVERY_ACTION_UNSPECIFIED, HEALTHY),
        (common_pb2.RECOVERY_ACTION_NOT_SUPPORTED, HEALTHY),
        (common_pb2.RECOVERY_ACTION_NONE, HEALTHY),
        (common_pb2.RECOVERY_ACTION_GPU_RESET, WARNING),
        (common_pb2.RECOVERY_ACTION_NODE_REBOOT, WARNING),
        (common_pb2.RECOVERY_ACTION_DRAIN_P2P, WARNING),
        (common_pb2.RECOVERY_ACTION_DRAIN_AND_RESET, WARNING),
        (99, WARNING),  # newer than this proto: still an action other than none
    ],
)
def test_any_recovery_action_other_than_none_is_a_warning(action: int, verdict: int) -> None:
    assert assess_gpu(reading(recovery_action=action), previous=None).verdict == verdict


@pytest.mark.parametrize(
    ("bits", "words"),
    [
        (0x08, "HW slowdown (clock event reasons 0x8)"),
        (0x20, "SW thermal slowdown (clock event reasons 0x20)"),
        (0x40, "HW thermal slowdown (clock event reasons 0x40)"),
        (0x80, "HW power brake slowdown (clock event reasons 0x80)"),
        (0x61, "SW thermal slowdown, HW thermal slowdown (clock event reasons 0x61)"),
    ],
)
def test_thermal_clock_events_give_a_reason_but_stay_healthy(bits: int, words: str) -> None:
    out = assess_gpu(reading(index=2, clock_event_reasons=bits), previous=None)
    assert out.verdict == HEALTHY
    assert list(out.reasons) == [f"GPU 2: thermal throttling: {words}"]


def test_thermal_mask_is_the_nvml_throttle_bits() -> None:
    assert THERMAL_CLOCK_EVENT_MASK == 0x08 | 0x20 | 0x40 | 0x80
    # Idle (0x1) and applications clocks (0x2) are not thermal.
    out = assess_gpu(reading(clock_event_reasons=0x1 | 0x2 | 0x4), previous=None)
    assert list(out.reasons) == []


@pytest.mark.parametrize(
    ("temperature", "reasons"),
    [(89.9, []), (90.0, ["GPU 3: thermal throttling: 90.0 °C, at or above 90.0 °C"])],
)
def test_hot_gpu_gives_a_reason_but_stays_healthy(temperature: float, reasons: list[str]) -> None:
    out = assess_gpu(reading(temperature_c=temperature), previous=None)
    assert out.verdict == HEALTHY
    assert list(out.reasons) == reasons


def test_thermal_signs_are_one_reason_and_do_not_hide_a_warning() -> None:
    out = assess_gpu(
        reading(temperature_c=95.0, clock_event_reasons=0x40, remapped_rows_pending=True),
        previous=None,
    )
    assert out.verdict == WARNING
    assert len(out.reasons) == 2
    assert "row remap pending" in out.reasons[0]
    assert "95.0 °C" in out.reasons[1]
    assert "HW thermal slowdown" in out.reasons[1]


@pytest.mark.parametrize(
    ("xids", "verdict"),
    [
        ([31], APPLICATION),
        ([31, 94], WARNING),
        ([94, 31, 79], FATAL),
        ([106, 13], APPLICATION),
        ([106], HEALTHY),
    ],
)
def test_the_worst_xid_wins(xids: list[int], verdict: int) -> None:
    out = assess_gpu(reading(), previous=None, xids=xids)
    assert out.verdict == verdict
    assert len(out.reasons) == len(xids)


def test_worst_wins_across_rules_and_reasons_are_worst_first() -> None:
    out = assess_gpu(
        reading(index=1, temperature_c=99.0, pcie_link_width=8, ecc_uncorrected_volatile=2),
        previous=reading(index=1),
        xids=[13],
    )
    assert out.verdict == FATAL
    assert [r.split(":")[1].strip() for r in out.reasons] == [
        "2 uncorrected ECC errors",
        "PCIe link runs at x8, below its x16",
        "Xid 13 (Graphics engine exception)",
        "thermal throttling",
    ]
    assert all(r.startswith("GPU 1: ") for r in out.reasons)


@pytest.mark.parametrize(
    ("verdicts", "worst"),
    [
        ([], HEALTHY),
        ([HEALTHY], HEALTHY),
        ([APPLICATION, HEALTHY], APPLICATION),
        ([APPLICATION, WARNING], WARNING),
        ([FATAL, WARNING, APPLICATION], FATAL),
        ([common_pb2.HEALTH_VERDICT_UNSPECIFIED], HEALTHY),
    ],
)
def test_worst_verdict_ordering(verdicts: list[Any], worst: int) -> None:
    assert worst_verdict(verdicts) == worst


def test_repeated_xids_give_one_reason() -> None:
    out = assess_gpu(reading(), previous=None, xids=[79, 79, 79])
    assert list(out.reasons) == ["GPU 3: Xid 79 (GPU has fallen off the bus)"]


def test_a_lost_gpu_is_judged_by_the_loss_and_its_xids_only() -> None:
    lost = reading(lost=True, nvlinks=[link(0, active=False)], pcie_link_width=0)
    out = assess_gpu(lost, previous=reading(), xids=[79])
    assert out.verdict == FATAL
    assert [r.split(" (")[0] for r in out.reasons] == ["GPU 3: lost", "GPU 3: Xid 79"]


def test_counters_without_a_previous_reading_are_not_judged() -> None:
    out = assess_gpu(
        reading(pcie_replay_counter=10**9, nvlinks=[link(0, crc=10**6)]), previous=None
    )
    assert out.verdict == HEALTHY


def test_a_reset_counter_counts_its_whole_value_as_growth() -> None:
    out = assess_gpu(
        reading(nvlinks=[link(0, crc=3)]), previous=reading(nvlinks=[link(0, crc=500)])
    )
    assert list(out.reasons) == ["GPU 3: NVLink 0 CRC errors grew by 3"]


def test_a_new_link_or_an_already_inactive_link_is_not_a_change() -> None:
    out = assess_gpu(
        reading(nvlinks=[link(0, active=False), link(7, crc=5)]),
        previous=reading(nvlinks=[link(0, active=False)]),
    )
    assert out.verdict == HEALTHY


def test_a_previous_reading_of_another_gpu_is_ignored() -> None:
    other = reading(uuid="GPU-replaced", pcie_replay_counter=0)
    out = assess_gpu(reading(pcie_replay_counter=10**6), previous=other)
    assert out.verdict == HEALTHY


def test_zero_pcie_link_values_mean_unknown_not_degraded() -> None:
    out = assess_gpu(reading(pcie_link_width=0, pcie_link_gen=0), previous=None)
    assert out.verdict == HEALTHY
    out = assess_gpu(reading(pcie_link_width_max=0, pcie_link_gen_max=0), previous=None)
    assert out.verdict == HEALTHY


def test_an_idle_gpu_may_lower_its_pcie_generation_but_not_its_width() -> None:
    idle = 0x01  # nvmlClocksEventReasonGpuIdle
    assert assess_gpu(
        reading(pcie_link_gen=1, clock_event_reasons=idle), previous=None
    ).verdict == (HEALTHY)
    out = assess_gpu(reading(pcie_link_width=8, clock_event_reasons=idle), previous=None)
    assert out.verdict == WARNING


def test_thresholds_are_configurable() -> None:
    strict = HealthThresholds(
        temperature_warning_c=70.0, nvlink_error_growth_per_interval=10, pcie_replay_growth=5
    )
    out = assess_gpu(
        reading(temperature_c=75.0, pcie_replay_counter=15, nvlinks=[link(0, crc=9)]),
        previous=reading(pcie_replay_counter=10, nvlinks=[link(0)]),
        thresholds=strict,
    )
    assert out.verdict == WARNING
    assert [r.split(":")[1].strip() for r in out.reasons] == [
        "PCIe replay counter grew by 5",
        "thermal throttling",
    ]
    relaxed = HealthThresholds(pcie_gen_below_max_is_warning=False)
    assert assess_gpu(reading(pcie_link_gen=1), previous=None, thresholds=relaxed).verdict == (
        HEALTHY
    )


@pytest.mark.parametrize("field", ["nvlink_error_growth_per_interval", "pcie_replay_growth"])
def test_growth_thresholds_below_one_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} is 0; it must be at least 1"):
        HealthThresholds(**{field: 0})  # type: ignore[arg-type]


def test_inputs_are_not_mutated_and_a_new_message_is_returned() -> None:
    current = reading(
        ecc_uncorrected_volatile=1, reasons=["stale"], verdict=HEALTHY, nvlinks=[link(0, crc=2)]
    )
    previous = reading(nvlinks=[link(0)])
    before = (current.SerializeToString(), previous.SerializeToString())
    out = assess_gpu(current, previous=previous, xids=[79])
    assert (current.SerializeToString(), previous.SerializeToString()) == before
    assert out is not current
    assert "stale" not in out.reasons
    node = assess_node([out])
    node.gpus[0].reasons.append("changed")
    assert "changed" not in out.reasons


def test_assessed_copy_keeps_every_reading() -> None:
    current = reading(power_w=612.5, ecc_corrected_volatile=40, unsupported=["power_w"])
    out = assess_gpu(current, previous=None)
    out.ClearField("verdict")
    out.ClearField("reasons")
    assert out == current


def test_an_empty_node_is_healthy() -> None:
    node = assess_node([])
    assert node.verdict == HEALTHY
    assert list(node.reasons) == []
    assert list(node.gpus) == []


def test_a_node_takes_its_worst_gpu_and_every_reason() -> None:
    gpus = [
        assess_gpu(reading(0), previous=None),
        assess_gpu(reading(1), previous=None, xids=[31]),
        assess_gpu(reading(2, remapped_rows_pending=True), previous=None),
        assess_gpu(reading(3, temperature_c=95.0), previous=None),
    ]
    node = assess_node(gpus)
    assert node.verdict == WARNING
    assert [r.split(":")[0] for r in node.reasons] == ["GPU 1", "GPU 2", "GPU 3"]
    assert list(node.gpus) == gpus


def test_a_node_refuses_a_reading_that_was_never_assessed() -> None:
    with pytest.raises(ValueError, match=r"GPU 5 .* has no verdict"):
        assess_node([reading(5)])


# Random readings: every field over its full wire range, including values no GPU sends.
_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)
_links = st.lists(
    st.builds(
        common_pb2.NvLinkStatus,
        link=st.integers(0, 17),
        active=st.booleans(),
        crc_errors=_u64,
        replay_errors=_u64,
        recovery_errors=_u64,
    ),
    max_size=6,
)
_FIELDS = [
    "temperature_c",
    "ecc_uncorrected_volatile",
    "remapped_rows_pending",
    "remapped_rows_failure",
    "retired_pages_pending",
    "clock_event_reasons",
    "nvlinks",
    "pcie_replay_counter",
    "pcie_link_gen",
    "pcie_link_width",
    "recovery_action",
]


def _gpu_healths(uuid: str) -> st.SearchStrategy[common_pb2.GpuHealth]:
    return st.builds(
        common_pb2.GpuHealth,
        index=st.integers(0, 7),
        uuid=st.just(uuid),
        temperature_c=st.floats(allow_nan=True, allow_infinity=True),
        ecc_uncorrected_volatile=_u64,
        remapped_rows_pending=st.booleans(),
        remapped_rows_failure=st.booleans(),
        retired_pages_pending=st.booleans(),
        clock_event_reasons=_u64,
        nvlinks=_links,
        pcie_replay_counter=_u64,
        pcie_link_gen=st.integers(0, 6),
        pcie_link_gen_max=st.integers(0, 6),
        pcie_link_width=st.sampled_from([0, 1, 2, 4, 8, 16]),
        pcie_link_width_max=st.sampled_from([0, 8, 16]),
        recovery_action=st.sampled_from(list(common_pb2.RecoveryAction.values())),
        lost=st.booleans(),
        unsupported=st.lists(st.sampled_from(_FIELDS), max_size=4),
    )


@settings(max_examples=200, deadline=None)
@given(
    current=_gpu_healths("GPU-x"),
    previous=st.none() | _gpu_healths("GPU-x"),
    xids=st.lists(st.integers(0, 200), max_size=4),
)
def test_any_reading_gets_one_of_the_four_verdicts_and_lost_is_always_fatal(
    current: common_pb2.GpuHealth,
    previous: common_pb2.GpuHealth | None,
    xids: list[int],
) -> None:
    before = current.SerializeToString()
    out = assess_gpu(current, previous=previous, xids=xids)
    assert out.verdict in VERDICTS
    if current.lost:
        assert out.verdict == FATAL
    assert (out.verdict == HEALTHY) == all(
        "thermal throttling" in r or "(SMBPBI" in r for r in out.reasons
    )
    assert all(r.startswith(f"GPU {current.index}: ") for r in out.reasons)
    assert current.SerializeToString() == before
    assert assess_node([out]).verdict == out.verdict
