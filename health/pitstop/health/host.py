"""Health verdicts for a node's host: its network links, memory, disks and PCIe devices.

Pure functions over the wire types, as `verdict.py` is for the GPUs: nothing here reads
a clock, a device or a file. A counter means something only as growth, so the caller
passes the readings it kept of the last `HostThresholds.flap_window_seconds` with the
time of each.

- FATAL (replace the node now): a link down that was up; a PCIe device's fatal AER count grew; the
  memory's uncorrected (EDAC) count grew.
- WARNING (drain at the next committed step): a link flapped (went down `flap_downs`
  times within the window, though up now); a link's error counters grew by
  `link_error_growth` within the window; a PCIe device's link runs narrower than its
  maximum (a NIC's also slower);
  its non-fatal AER count grew, or its correctable one by `pcie_correctable_growth`;
  corrected memory errors grew by `edac_corrected_growth`.
- APPLICATION (the rank restarts in place): the kernel killed a process for memory (OOM).
- DEGRADED (reported, nothing drained): a link's rate fell below the highest the agent
  saw it at (it carries every byte, only slower: the job's straggler policy, which
  sees what it costs, reports or swaps the node, its event naming the link; and a
  switch retrained for a whole rack never drains the rack); memory pressure over
  `memory_pressure_percent`; a daemon's disk under `disk_free_fraction` (or
  `disk_free_bytes`) free, out of inodes, or read-only: the checkpoint daemon refuses
  durable flushes and training goes on.

The worst verdict wins, and every rule that fired adds a reason naming the device and
the numbers. A source named in the reading's `unsupported` list is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pitstop.health.verdict import worst_verdict
from pitstop.v1 import common_pb2

_HEALTHY = common_pb2.HEALTH_VERDICT_HEALTHY
_DEGRADED = common_pb2.HEALTH_VERDICT_DEGRADED
_APPLICATION = common_pb2.HEALTH_VERDICT_APPLICATION
_WARNING = common_pb2.HEALTH_VERDICT_WARNING
_FATAL = common_pb2.HEALTH_VERDICT_FATAL

_ORDER = {_FATAL: 0, _WARNING: 1, _APPLICATION: 2, _DEGRADED: 3, _HEALTHY: 4}

GiB = 1 << 30


@dataclass(frozen=True)
class HostThresholds:
    """The numbers the host rules compare against (agent settings `host_*`)."""

    flap_window_seconds: float = 60.0
    """The window a link's downs and errors are counted over. A minute: long enough to
    see a link that bounces every few seconds, short enough that one bounce a day never
    adds up to a flap."""

    flap_downs: int = 3
    """Downs within the window that make a flap. One down can be a cable reseated or a
    switch's planned restart; three in a minute is a link the job cannot trust."""

    link_error_growth: int = 100
    """Growth of a link's error counters within the window that makes a warning. Symbol
    errors trickle on a healthy long copper link (a few an hour); a hundred in a minute
    is a failing cable or transceiver, the cause NCCL timeouts are later traced to."""

    pcie_correctable_growth: int = 100
    """Growth of a PCIe device's correctable AER count within the window that makes a
    warning. A correctable error is retried by the link itself and a few are noise; a
    burst is a marginal slot or riser, whose replays already slow the device's traffic."""

    edac_corrected_growth: int = 100
    """Growth of the corrected memory error count within the window that makes a
    warning: a DIMM whose corrections burst is the one that fails uncorrected next."""

    memory_pressure_percent: float = 20.0
    """/proc/pressure/memory "full" avg10 at or above which memory pressure is reported:
    a fifth of the time every task waited on memory, where the data loaders and the
    checkpoint daemon's copies slow the step."""

    disk_free_fraction: float = 0.05
    """A daemon's filesystem with less than this share free is reported (and the checkpoint
    daemon stops flushing to it before a write fails half-way)."""

    disk_free_bytes: int = 10 * GiB
    """... or with less than this many bytes free, whichever is hit first: one durable
    flush of a large rank's state."""

    def __post_init__(self) -> None:
        for name in (
            "flap_downs",
            "link_error_growth",
            "pcie_correctable_growth",
            "edac_corrected_growth",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"HostThresholds.{name} is {getattr(self, name)}; it must be at least 1"
                )
        if self.flap_window_seconds <= 0:
            raise ValueError(
                f"HostThresholds.flap_window_seconds is {self.flap_window_seconds}; "
                "give a positive number of seconds"
            )
        if not 0 <= self.disk_free_fraction < 1:
            raise ValueError(
                f"HostThresholds.disk_free_fraction is {self.disk_free_fraction}; give 0..1"
            )


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def gist(reasons: Iterable[str]) -> tuple[str, ...]:
    """Reasons without their numbers: what they say, not how much. A disk filling or
    memory pressure rising says a new number every look and is the same news until
    what it says changes."""
    return tuple(_NUMBER.sub("#", reason) for reason in reasons)


Timed = tuple[float, common_pb2.HostHealth]
"""A reading and the time (seconds, any clock) it was taken."""


def assess_host(
    reading: common_pb2.HostHealth,
    *,
    now: float,
    earlier: Sequence[Timed] = (),
    seen_up: Mapping[str, float] | None = None,
    thresholds: HostThresholds = HostThresholds(),
) -> common_pb2.HostHealth:
    """Return a copy of `reading` (taken at `now`) with `verdict` and `reasons` set.

    `earlier` are this host's earlier readings, oldest first; those older than the flap
    window are ignored, and counters are judged as growth from the oldest one left.
    `seen_up` is each link the agent has seen up, with the highest rate it saw it at: a
    link below that runs slower than it can, and only a link once up is judged down (a
    port no cable was ever plugged into is not a fault). A counter that went down (a
    driver reload, a reboot) is judged from its new value on.
    """
    window = [r for t, r in earlier if now - t <= thresholds.flap_window_seconds]
    base = window[0] if window else None
    skip = frozenset(reading.unsupported)
    found: list[tuple[common_pb2.HealthVerdict, str]] = []
    if "links" not in skip:
        _links(reading, base, seen_up or {}, thresholds, found)
    _memory(reading, base, skip, thresholds, found)
    if "disks" not in skip:
        _disks(reading, thresholds, found)
    if "aer" not in skip:
        _pcie(reading, base, thresholds, found)
    assessed = common_pb2.HostHealth()
    assessed.CopyFrom(reading)
    assessed.verdict = worst_verdict(v for v, _ in found)
    del assessed.reasons[:]
    assessed.reasons.extend(reason for _, reason in sorted(found, key=lambda f: _ORDER[f[0]]))
    return assessed


def _growth(now: int, then: int | None) -> int:
    """How much a counter grew; a counter that went back (reset) grew by its new value."""
    if then is None:
        return 0
    return now - then if now >= then else now


def _links(
    reading: common_pb2.HostHealth,
    base: common_pb2.HostHealth | None,
    peaks: Mapping[str, float],
    limits: HostThresholds,
    found: list[tuple[common_pb2.HealthVerdict, str]],
) -> None:
    before = {link.name: link for link in base.links} if base is not None else {}
    window = f"{limits.flap_window_seconds:g} s"
    for link in reading.links:
        old = before.get(link.name)
        downs = _growth(link.down_count, old.down_count if old else None)
        errors = _growth(link.error_count, old.error_count if old else None)
        if not link.up:
            if link.name in peaks:
                found.append((_FATAL, f"{link.kind} link {link.name} is down"))
        elif downs >= limits.flap_downs:
            found.append(
                (_WARNING, f"{link.kind} link {link.name} flapped {downs} times in {window}")
            )
        if errors >= limits.link_error_growth:
            found.append(
                (_WARNING, f"{link.kind} link {link.name}: {errors} new errors in {window}")
            )
        peak = peaks.get(link.name, 0.0)
        if link.up and 0 < link.rate_gbps < peak:
            found.append(
                (
                    _DEGRADED,
                    f"{link.kind} link {link.name} runs at {link.rate_gbps:g} Gb/s, "
                    f"below the {peak:g} Gb/s it ran at",
                )
            )


def _memory(
    reading: common_pb2.HostHealth,
    base: common_pb2.HostHealth | None,
    skip: frozenset[str],
    limits: HostThresholds,
    found: list[tuple[common_pb2.HealthVerdict, str]],
) -> None:
    memory, old = reading.memory, base.memory if base is not None else None
    if "edac" not in skip:
        uncorrected = _growth(memory.edac_uncorrected, old.edac_uncorrected if old else None)
        corrected = _growth(memory.edac_corrected, old.edac_corrected if old else None)
        if uncorrected:
            found.append((_FATAL, f"host memory: {uncorrected} new uncorrected errors (EDAC)"))
        if corrected >= limits.edac_corrected_growth:
            found.append(
                (
                    _WARNING,
                    f"host memory: {corrected} new corrected errors (EDAC) in "
                    f"{limits.flap_window_seconds:g} s",
                )
            )
    if "psi" not in skip and memory.pressure_full_avg10 >= limits.memory_pressure_percent:
        found.append(
            (
                _DEGRADED,
                f"host memory pressure: every task stalled {memory.pressure_full_avg10:g}% "
                "of the last 10 s",
            )
        )
    kills = _growth(memory.oom_kills, old.oom_kills if old else None)
    if kills:
        last = f", the latest {memory.last_oom_killed}" if memory.last_oom_killed else ""
        found.append(
            (
                _APPLICATION,
                f"host memory: the kernel killed {kills} process(es) for memory (OOM){last}",
            )
        )


def _disks(
    reading: common_pb2.HostHealth,
    limits: HostThresholds,
    found: list[tuple[common_pb2.HealthVerdict, str]],
) -> None:
    for disk in reading.disks:
        if disk.read_only:
            found.append((_DEGRADED, f"disk {disk.path} is read-only"))
            continue
        low = disk.total_bytes and (
            disk.free_bytes < limits.disk_free_fraction * disk.total_bytes
            or disk.free_bytes < limits.disk_free_bytes
        )
        if low:
            found.append(
                (
                    _DEGRADED,
                    f"disk {disk.path}: {disk.free_bytes / GiB:.1f} GiB free of "
                    f"{disk.total_bytes / GiB:.1f} GiB",
                )
            )
        if disk.total_inodes and disk.free_inodes == 0:
            found.append((_DEGRADED, f"disk {disk.path}: no inodes free"))


def _pcie(
    reading: common_pb2.HostHealth,
    base: common_pb2.HostHealth | None,
    limits: HostThresholds,
    found: list[tuple[common_pb2.HealthVerdict, str]],
) -> None:
    before = {d.address: d for d in base.pcie} if base is not None else {}
    for device in reading.pcie:
        old = before.get(device.address)
        name = f"PCIe {device.role} {device.address}"
        fatal = _growth(device.aer_fatal, old.aer_fatal if old else None)
        nonfatal = _growth(device.aer_nonfatal, old.aer_nonfatal if old else None)
        correctable = _growth(device.aer_correctable, old.aer_correctable if old else None)
        if fatal:
            found.append((_FATAL, f"{name}: {fatal} new fatal AER errors"))
        if nonfatal:
            found.append((_WARNING, f"{name}: {nonfatal} new non-fatal AER errors"))
        if correctable >= limits.pcie_correctable_growth:
            found.append(
                (
                    _WARNING,
                    f"{name}: {correctable} new correctable AER errors in "
                    f"{limits.flap_window_seconds:g} s",
                )
            )
        if device.link_width_max and device.link_width < device.link_width_max:
            found.append(
                (_WARNING, f"{name} runs x{device.link_width} of x{device.link_width_max}")
            )
        # A GPU lowers its link speed when idle to save power (its own NVML reading
        # judges that, knowing when it is idle); a NIC's slower link is a fault.
        slower = device.link_speed_gts < device.link_speed_gts_max
        if device.role == "nic" and device.link_speed_gts_max and slower:
            found.append(
                (
                    _WARNING,
                    f"{name} runs at {device.link_speed_gts:g} of "
                    f"{device.link_speed_gts_max:g} GT/s",
                )
            )
