"""The real host backend: links, memory, disks and PCIe devices as Linux reports them.

Every source is a file under `root` (`/` on a node; a fixture tree in the tests):

- InfiniBand and RoCE ports: `sys/class/infiniband/<dev>/ports/<n>/` `state`
  ("4: ACTIVE"), `phys_state` ("5: LinkUp"), `rate` ("400 Gb/sec (4X NDR)") and
  `counters/` (`link_downed`, and the error counters summed).
- Ethernet interfaces with a device behind them (type 1, a `device` link; not `lo`,
  bridges or veths): `sys/class/net/<if>/` `carrier`, `carrier_down_count`, `speed`
  (Mb/s) and `statistics/rx_errors`, `tx_errors`.
- Memory: `proc/pressure/memory` ("full avg10=..."), EDAC's
  `sys/devices/system/edac/mc/mc*/ce_count` and `ue_count`, and OOM kills from the
  kernel log (`kmsg.KernelLog`).
- Disks: `statvfs` of the paths the node's daemons write to.
- PCIe: `sys/bus/pci/devices/<address>/` `aer_dev_correctable`, `aer_dev_nonfatal`,
  `aer_dev_fatal` (their TOTAL_ERR_* lines), `current_link_width`, `max_link_width`,
  `current_link_speed`, `max_link_speed`, for the GPUs named and every port's NIC.

A source the host lacks (no InfiniBand, no EDAC driver, no PSI, no AER) is named in
`unsupported` and never fails the read; a file that vanishes between listing and
reading (a port reset) reads as absent.
"""

from __future__ import annotations

import os
import re
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from pitstop.agent.host.base import HostBackend
from pitstop.agent.host.kmsg import KernelLog
from pitstop.v1 import common_pb2

IB_ERROR_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
"""A port's counters that count errors on the wire (not congestion: no xmit_wait)."""

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
ARPHRD_ETHER = 1


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):  # absent, vanished, or EINVAL (carrier of a down link)
        return None


def _int(path: Path) -> int | None:
    text = _text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _first_number(text: str | None) -> float:
    match = _NUMBER.search(text or "")
    return float(match.group()) if match else 0.0


def aer_total(text: str | None, key: str) -> int:
    """The `key` line's count (TOTAL_ERR_COR, ...) of an aer_dev_* file; 0 without it."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value.strip() or 0)
    return 0


class SysfsHost(HostBackend):
    name = "sysfs"

    def __init__(
        self,
        *,
        root: Path = Path("/"),
        disk_paths: Sequence[Path] = (),
        gpu_addresses: Sequence[str] = (),
        kernel_log: KernelLog | None = None,
    ) -> None:
        self.root = root
        self.disk_paths = list(disk_paths)
        self.gpu_addresses = [_kernel_address(a) for a in gpu_addresses]
        self.kernel_log = kernel_log
        self._lock = threading.Lock()  # read() and an exit's recent_oom_kills() may race
        self._oom_kills = 0
        self._recent_kills: deque[str] = deque(maxlen=256)

    def read(self) -> common_pb2.HostHealth:
        reading = common_pb2.HostHealth()
        ib = self.root / "sys/class/infiniband"
        nics: list[str] = []
        if ib.is_dir():
            for device in sorted(ib.iterdir()):
                nics.append(_device_address(device))
                for port in sorted((device / "ports").glob("*")):
                    reading.links.append(_ib_port(device.name, port))
        else:
            reading.unsupported.append("infiniband")
        for interface in sorted((self.root / "sys/class/net").glob("*")):
            if _int(interface / "type") == ARPHRD_ETHER and (interface / "device").exists():
                reading.links.append(_ethernet(interface))
                nics.append(_device_address(interface))
        self._memory(reading)
        for path in self.disk_paths:
            disk = read_disk(path)
            if disk is not None:
                reading.disks.append(disk)
        roles = [(a, "gpu") for a in self.gpu_addresses]
        roles += [(a, "nic") for a in dict.fromkeys(nics) if a]
        pci = self.root / "sys/bus/pci/devices"
        devices = [_pcie(pci / address, role) for address, role in roles]
        if devices and not any((pci / a / "aer_dev_fatal").exists() for a, _ in roles):
            reading.unsupported.append("aer")
        reading.pcie.extend(d for d in devices if d is not None)
        return reading

    def _memory(self, reading: common_pb2.HostHealth) -> None:
        memory = reading.memory
        pressure = _text(self.root / "proc/pressure/memory")
        if pressure is None:
            reading.unsupported.append("psi")
        for line in (pressure or "").splitlines():
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            if line.startswith("full") and "avg10" in fields:
                memory.pressure_full_avg10 = float(fields["avg10"])
        controllers = sorted((self.root / "sys/devices/system/edac/mc").glob("mc*"))
        if not controllers:
            reading.unsupported.append("edac")
        for mc in controllers:
            memory.edac_corrected += _int(mc / "ce_count") or 0
            memory.edac_uncorrected += _int(mc / "ue_count") or 0
        if self.kernel_log is None:
            reading.unsupported.append("oom")
        with self._lock:
            self._follow_kernel_log()
            memory.oom_kills = self._oom_kills
            memory.last_oom_killed = self._recent_kills[-1] if self._recent_kills else ""

    def _follow_kernel_log(self) -> None:
        if self.kernel_log is not None:
            for killed in self.kernel_log.oom_kills():
                self._oom_kills += 1
                self._recent_kills.append(killed)

    def recent_oom_kills(self) -> list[str]:
        with self._lock:
            self._follow_kernel_log()
            return list(self._recent_kills)

    def close(self) -> None:
        with self._lock:
            if self.kernel_log is not None:
                self.kernel_log.close()


def _ib_port(device: str, port: Path) -> common_pb2.LinkReading:
    state, phys = _text(port / "state") or "", _text(port / "phys_state") or ""
    counters = port / "counters"
    return common_pb2.LinkReading(
        name=f"{device}/{port.name}",
        kind="infiniband",
        up="ACTIVE" in state and "LinkUp" in phys,
        rate_gbps=_first_number(_text(port / "rate")),
        down_count=_int(counters / "link_downed") or 0,
        error_count=sum(_int(counters / name) or 0 for name in IB_ERROR_COUNTERS),
    )


def _ethernet(interface: Path) -> common_pb2.LinkReading:
    speed = _int(interface / "speed") or 0  # Mb/s; -1 (unknown) while down
    stats = interface / "statistics"
    return common_pb2.LinkReading(
        name=interface.name,
        kind="ethernet",
        up=_int(interface / "carrier") == 1,
        rate_gbps=max(speed, 0) / 1000,
        down_count=_int(interface / "carrier_down_count") or 0,
        error_count=(_int(stats / "rx_errors") or 0) + (_int(stats / "tx_errors") or 0),
    )


def read_disk(path: Path) -> common_pb2.DiskReading | None:
    """The filesystem `path` is on (its nearest existing parent's, for a directory a
    daemon has yet to create); None where none can be read."""
    for place in (path, *path.parents):
        try:
            vfs = os.statvfs(place)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        break
    else:
        return None
    return common_pb2.DiskReading(
        path=str(path),
        free_bytes=vfs.f_bavail * vfs.f_frsize,
        total_bytes=vfs.f_blocks * vfs.f_frsize,
        free_inodes=vfs.f_favail,
        total_inodes=vfs.f_files,
        read_only=bool(vfs.f_flag & os.ST_RDONLY),
    )


def _pcie(device: Path, role: str) -> common_pb2.PcieDeviceReading | None:
    if not device.exists():
        return None
    return common_pb2.PcieDeviceReading(
        address=device.name,
        role=role,
        aer_correctable=aer_total(_text(device / "aer_dev_correctable"), "TOTAL_ERR_COR"),
        aer_nonfatal=aer_total(_text(device / "aer_dev_nonfatal"), "TOTAL_ERR_NONFATAL"),
        aer_fatal=aer_total(_text(device / "aer_dev_fatal"), "TOTAL_ERR_FATAL"),
        link_width=_int(device / "current_link_width") or 0,
        link_width_max=_int(device / "max_link_width") or 0,
        link_speed_gts=_first_number(_text(device / "current_link_speed")),
        link_speed_gts_max=_first_number(_text(device / "max_link_speed")),
    )


def _device_address(entry: Path) -> str:
    """The PCI address behind a class entry (its `device` link's target's name)."""
    try:
        return (entry / "device").resolve(strict=True).name
    except OSError:
        return ""


def _kernel_address(bus_id: str) -> str:
    """ "00000000:3B:00.0" (NVML) as the kernel names it: "0000:3b:00.0"."""
    domain, _, rest = bus_id.strip().lower().rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("", "", domain)
    return f"{int(domain or '0', 16):04x}:{bus}:{rest}"
