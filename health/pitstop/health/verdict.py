"""Health verdicts for one GPU and one node, from NVML readings and Xid events.

Pure functions over the wire types: nothing here reads a clock, a device or a file, and
no input message is changed; every function returns new messages. The rules follow
docs/architecture.md ("Health"):

- FATAL (replace the node now): the GPU is lost, a row remap failed, the volatile
  uncorrected ECC count grew, or a fatal Xid arrived.
- WARNING (drain and swap at the next committed checkpoint): a row remap or page
  retirement is pending, the driver asks for a recovery action, an NVLink link's error
  counters grew or the link went down, the PCIe link runs below its maximum width or
  generation, the PCIe replay counter grew, or a warning Xid arrived.
- APPLICATION (restart the rank in place): an application Xid and nothing worse.
- Thermal throttling is reported as a reason but leaves the verdict alone: a slow GPU is
  the straggler detector's business, not a failure.

The worst verdict wins. Every rule that fires adds one reason naming the GPU and the
value. A field named in the reading's `unsupported` list is skipped, never a failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pitstop.health.xid import classify_xid, verdict_for
from pitstop.v1 import common_pb2

_HEALTHY = common_pb2.HEALTH_VERDICT_HEALTHY
_APPLICATION = common_pb2.HEALTH_VERDICT_APPLICATION
_WARNING = common_pb2.HEALTH_VERDICT_WARNING
_FATAL = common_pb2.HEALTH_VERDICT_FATAL

# NVML clock event (throttle) reason bits, nvmlClocksEventReason*.
_GPU_IDLE = 0x01
_HW_SLOWDOWN = 0x08
_SW_THERMAL_SLOWDOWN = 0x20
_HW_THERMAL_SLOWDOWN = 0x40
_HW_POWER_BRAKE_SLOWDOWN = 0x80

THERMAL_CLOCK_EVENT_MASK = (
    _HW_SLOWDOWN | _SW_THERMAL_SLOWDOWN | _HW_THERMAL_SLOWDOWN | _HW_POWER_BRAKE_SLOWDOWN
)
"""NVML clock event reasons that mean the GPU is throttled for heat or by a hardware brake."""

_CLOCK_EVENT_NAMES = (
    (_HW_SLOWDOWN, "HW slowdown"),
    (_SW_THERMAL_SLOWDOWN, "SW thermal slowdown"),
    (_HW_THERMAL_SLOWDOWN, "HW thermal slowdown"),
    (_HW_POWER_BRAKE_SLOWDOWN, "HW power brake slowdown"),
)

_NO_RECOVERY_ACTION = frozenset(
    {
        common_pb2.RECOVERY_ACTION_UNSPECIFIED,
        common_pb2.RECOVERY_ACTION_NOT_SUPPORTED,
        common_pb2.RECOVERY_ACTION_NONE,
    }
)

_NVLINK_COUNTERS = (
    ("crc_errors", "CRC errors"),
    ("replay_errors", "replay errors"),
    ("recovery_errors", "recovery errors"),
)

_SEVERITY = {
    common_pb2.HEALTH_VERDICT_UNSPECIFIED: 0,
    _HEALTHY: 1,
    common_pb2.HEALTH_VERDICT_DEGRADED: 1.5,
    _APPLICATION: 2,
    _WARNING: 3,
    _FATAL: 4,
}


@dataclass(frozen=True)
class HealthThresholds:
    """Limits for the health rules that compare a reading against a number."""

    temperature_warning_c: float = 90.0
    """At or above this core temperature a GPU is reported as thermally throttled. Data
    centre parts slow down in the high 80s °C; 90 °C is past that on every current part."""

    nvlink_error_growth_per_interval: int = 1
    """Growth of one NVLink link's CRC, replay or recovery error count between two readings
    that makes a warning. 1: any new error on a link is a warning, because the counters sit
    at zero on a healthy link and a failing link only gets worse."""

    pcie_replay_growth: int = 100
    """Growth of the PCIe replay counter between two readings that makes a warning. A few
    replays are normal link retraining; a burst means a marginal link."""

    pcie_gen_below_max_is_warning: bool = True
    """Whether a PCIe link running below its maximum generation is a warning. An idle GPU
    lowers its link generation to save power, which is not damage: the check is skipped
    while NVML reports the GPU idle (clock event reason GpuIdle), and this turns it off
    altogether. A link narrower than its maximum width is always a warning."""

    def __post_init__(self) -> None:
        for name in ("nvlink_error_growth_per_interval", "pcie_replay_growth"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"HealthThresholds.{name} is {value}; it must be at least 1")


def worst_verdict(verdicts: Iterable[common_pb2.HealthVerdict]) -> common_pb2.HealthVerdict:
    """Return the worst of `verdicts`: FATAL > WARNING > APPLICATION > DEGRADED > HEALTHY;
    HEALTHY if none."""
    worst = _HEALTHY
    for verdict in verdicts:
        if _SEVERITY.get(verdict, 0) > _SEVERITY[worst]:
            worst = verdict
    return worst


def assess_gpu(
    reading: common_pb2.GpuHealth,
    *,
    previous: common_pb2.GpuHealth | None,
    xids: Sequence[int] = (),
    thresholds: HealthThresholds = HealthThresholds(),
) -> common_pb2.GpuHealth:
    """Return a copy of `reading` with `verdict` and `reasons` set.

    `previous` is the same GPU's reading from the last interval, or None; counters that
    only mean something as growth (NVLink errors, PCIe replays) are judged against it. A
    `previous` with another uuid is a different GPU and is ignored. `xids` are the Xids
    the GPU reported since `previous`. A lost GPU's other readings are not judged: they
    are stale or zero, and the loss already decides the verdict.
    """
    if previous is not None and previous.uuid != reading.uuid:
        previous = None
    findings = _Findings(reading.index)
    if reading.lost:
        findings.add(_FATAL, "lost (fell off the bus or NVML cannot reach it)")
    for xid in dict.fromkeys(xids):
        info = classify_xid(xid)
        findings.add(verdict_for(info.xid_class), f"Xid {xid} ({info.name})")
    if not reading.lost:
        fields = _Fields(reading, previous)
        _check_memory(fields, findings)
        _check_recovery_action(fields, findings)
        _check_nvlinks(fields, thresholds, findings)
        _check_pcie(fields, thresholds, findings)
        _check_thermal(fields, thresholds, findings)

    assessed = common_pb2.GpuHealth()
    assessed.CopyFrom(reading)
    assessed.verdict = findings.verdict()
    del assessed.reasons[:]
    assessed.reasons.extend(findings.reasons())
    return assessed


def assess_node(gpus: Sequence[common_pb2.GpuHealth]) -> common_pb2.NodeHealth:
    """Return the node's health from its GPUs' assessed readings (see `assess_gpu`).

    The verdict is the worst GPU verdict, the reasons are every GPU's reasons in GPU order,
    and a node without GPUs is HEALTHY. Raises ValueError for a reading without a verdict.
    """
    for gpu in gpus:
        if gpu.verdict == common_pb2.HEALTH_VERDICT_UNSPECIFIED:
            raise ValueError(
                f"GPU {gpu.index} ({gpu.uuid or 'no uuid'}) has no verdict; "
                "pass its reading through assess_gpu first"
            )
    return common_pb2.NodeHealth(
        verdict=worst_verdict(gpu.verdict for gpu in gpus),
        reasons=[reason for gpu in gpus for reason in gpu.reasons],
        gpus=gpus,
    )


class _Findings:
    """The rules that fired for one GPU: a verdict and a reason each."""

    def __init__(self, index: int) -> None:
        self._index = index
        self._found: list[tuple[common_pb2.HealthVerdict, str]] = []

    def add(self, verdict: common_pb2.HealthVerdict, what: str) -> None:
        self._found.append((verdict, f"GPU {self._index}: {what}"))

    def verdict(self) -> common_pb2.HealthVerdict:
        return worst_verdict(verdict for verdict, _ in self._found)

    def reasons(self) -> list[str]:
        # Worst first, so the first reason explains the verdict; ties keep rule order.
        ordered = sorted(self._found, key=lambda found: -_SEVERITY[found[0]])
        return [reason for _, reason in ordered]


class _Fields:
    """A reading and its predecessor, seen through their `unsupported` lists."""

    def __init__(self, reading: common_pb2.GpuHealth, previous: common_pb2.GpuHealth | None):
        self.reading = reading
        self._unsupported = frozenset(reading.unsupported)
        self._previous = previous
        self._previous_unsupported = frozenset(previous.unsupported) if previous else frozenset()

    def supported(self, *names: str) -> bool:
        """Whether the current reading has every named field."""
        return not self._unsupported.intersection(names)

    def previous(self, name: str) -> common_pb2.GpuHealth | None:
        """The previous reading, if it exists and has the named field."""
        if self._previous is None or name in self._previous_unsupported:
            return None
        return self._previous


def _growth(current: int, previous: int) -> int:
    """How much a cumulative counter grew; a counter that went down was reset, so all of
    its current value is new."""
    return current - previous if current >= previous else current


def _check_memory(fields: _Fields, findings: _Findings) -> None:
    reading = fields.reading
    if fields.supported("remapped_rows_failure") and reading.remapped_rows_failure:
        findings.add(_FATAL, "row remapping failed; the GPU needs service")
    if fields.supported("ecc_uncorrected_volatile"):
        # Any uncorrected error the last reading did not already show is fatal; without a
        # last reading (or after a driver reload reset the count) every one of them is.
        count = reading.ecc_uncorrected_volatile
        previous = fields.previous("ecc_uncorrected_volatile")
        seen = previous.ecc_uncorrected_volatile if previous is not None else 0
        seen = seen if count >= seen else 0
        if count > seen > 0:
            findings.add(_FATAL, f"uncorrected ECC errors grew by {count - seen} to {count}")
        elif count > seen:
            findings.add(_FATAL, f"{count} uncorrected ECC errors")
    if fields.supported("remapped_rows_pending") and reading.remapped_rows_pending:
        findings.add(_WARNING, "row remap pending; it takes effect at the next GPU reset")
    if fields.supported("retired_pages_pending") and reading.retired_pages_pending:
        findings.add(_WARNING, "page retirement pending; it takes effect at the next reboot")


def _check_recovery_action(fields: _Fields, findings: _Findings) -> None:
    action = fields.reading.recovery_action
    if not fields.supported("recovery_action") or action in _NO_RECOVERY_ACTION:
        return
    try:
        name = common_pb2.RecoveryAction.Name(action).removeprefix("RECOVERY_ACTION_")
    except ValueError:  # a value newer than this build's proto
        name = str(int(action))
    findings.add(_WARNING, f"driver asks for recovery action {name}")


def _check_nvlinks(fields: _Fields, thresholds: HealthThresholds, findings: _Findings) -> None:
    previous = fields.previous("nvlinks")
    if not fields.supported("nvlinks") or previous is None:
        return
    before = {link.link: link for link in previous.nvlinks}
    for link in fields.reading.nvlinks:
        old = before.get(link.link)
        if old is None:
            continue
        if old.active and not link.active:
            findings.add(_WARNING, f"NVLink {link.link} went down")
        for counter, label in _NVLINK_COUNTERS:
            grew = _growth(getattr(link, counter), getattr(old, counter))
            if grew >= thresholds.nvlink_error_growth_per_interval:
                findings.add(_WARNING, f"NVLink {link.link} {label} grew by {grew}")


def _check_pcie(fields: _Fields, thresholds: HealthThresholds, findings: _Findings) -> None:
    reading = fields.reading
    # Zero means the driver did not say; only a known link below a known maximum counts.
    width, width_max = reading.pcie_link_width, reading.pcie_link_width_max
    if fields.supported("pcie_link_width", "pcie_link_width_max") and 0 < width < width_max:
        findings.add(_WARNING, f"PCIe link runs at x{width}, below its x{width_max}")
    gen, gen_max = reading.pcie_link_gen, reading.pcie_link_gen_max
    idle = fields.supported("clock_event_reasons") and reading.clock_event_reasons & _GPU_IDLE
    if (
        thresholds.pcie_gen_below_max_is_warning
        and not idle
        and fields.supported("pcie_link_gen", "pcie_link_gen_max")
        and 0 < gen < gen_max
    ):
        findings.add(_WARNING, f"PCIe link runs at gen {gen}, below its gen {gen_max}")
    previous = fields.previous("pcie_replay_counter")
    if fields.supported("pcie_replay_counter") and previous is not None:
        grew = _growth(reading.pcie_replay_counter, previous.pcie_replay_counter)
        if grew >= thresholds.pcie_replay_growth:
            findings.add(_WARNING, f"PCIe replay counter grew by {grew}")


def _check_thermal(fields: _Fields, thresholds: HealthThresholds, findings: _Findings) -> None:
    reading = fields.reading
    signs: list[str] = []
    if fields.supported("clock_event_reasons"):
        bits = reading.clock_event_reasons & THERMAL_CLOCK_EVENT_MASK
        if bits:
            names = ", ".join(name for bit, name in _CLOCK_EVENT_NAMES if bits & bit)
            signs.append(f"{names} (clock event reasons {reading.clock_event_reasons:#x})")
    temperature = reading.temperature_c
    if fields.supported("temperature_c") and temperature >= thresholds.temperature_warning_c:
        signs.append(f"{temperature:.1f} °C, at or above {thresholds.temperature_warning_c:.1f} °C")
    if signs:
        findings.add(_HEALTHY, "thermal throttling: " + "; ".join(signs))
