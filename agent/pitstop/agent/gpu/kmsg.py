"""Xid lines from the kernel log.

The NVIDIA driver logs every Xid as, for example::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

Older drivers leave out the pid and name. NVML names the same GPU
"00000000:3B:00.0", so bus ids are compared as (domain, bus, device) numbers:
the domain matters on Grace systems, where GPUs share bus 01 in different domains.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping

from pitstop.v1 import common_pb2

_XID_LINE = re.compile(
    r"NVRM: Xid \(PCI:(?P<bus_id>[0-9A-Fa-f:.]+)\): (?P<xid>\d+)"
    r"(?:, pid=(?P<pid>[^,]*), name=(?P<name>[^,]*?))?"
    r"(?:,\s*(?P<message>.*?))?\s*$"
)

# Commands that print the kernel ring buffer without timestamps, best first. dmesg
# may be restricted to root (kernel.dmesg_restrict); journalctl works for members of
# systemd-journal or adm.
KERNEL_LOG_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("dmesg", "--notime"),
    ("journalctl", "-k", "-b", "-o", "cat", "--no-pager"),
)

PciAddress = tuple[int, int, int]


def pci_address(bus_id: str) -> PciAddress | None:
    """(domain, bus, device) of a PCI bus id in NVML ("00000000:3B:00.0") or kernel
    ("0000:3b:00") form; None when `bus_id` is neither."""
    parts = bus_id.strip().split(".", 1)[0].split(":")
    if len(parts) == 2:  # no domain: domain 0
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    try:
        domain, bus, device = (int(part, 16) for part in parts)
    except ValueError:
        return None
    return domain, bus, device


def parse_xid_lines(text: str, pci_to_index: Mapping[str, int]) -> list[common_pb2.XidEvent]:
    """Every Xid in `text` on a GPU named in `pci_to_index` (bus id in any form → index).

    Lines for other devices and all other lines are skipped. Events carry the GPU
    index, the Xid, the driver's message and source KERNEL_LOG; no time, since the
    log is read without timestamps, and no uuid, which the caller fills in.
    """
    indexes: dict[PciAddress, int] = {}
    for bus_id, index in pci_to_index.items():
        address = pci_address(bus_id)
        if address is not None:
            indexes[address] = index
    events: list[common_pb2.XidEvent] = []
    for line in text.splitlines():
        match = _XID_LINE.search(line)
        if match is None:
            continue
        address = pci_address(match["bus_id"])
        if address is None or address not in indexes:
            continue
        events.append(
            common_pb2.XidEvent(
                gpu_index=indexes[address],
                xid=int(match["xid"]),
                message=match["message"] or "",
                source=common_pb2.XID_SOURCE_KERNEL_LOG,
            )
        )
    return events


def read_kernel_log(timeout_s: float = 5.0) -> str | None:
    """The kernel log since boot, or None when no reader works here. Never raises."""
    for command in KERNEL_LOG_COMMANDS:
        if shutil.which(command[0]) is None:
            continue
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, errors="replace", timeout=timeout_s
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0 and done.stdout:
            return done.stdout
    return None
