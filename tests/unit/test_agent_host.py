"""The host backends: the real one reads the files Linux writes, in the kernel's layout
(a fixture tree a test writes, and this machine's own /sys, /proc and /dev/kmsg); the
simulated one injects every fault the real one can report."""

from __future__ import annotations

import os
import select
from pathlib import Path

import pytest

from pitstop.agent.host.kmsg import KMSG, KernelLog, oom_killed
from pitstop.agent.host.sim import SimulatedHost
from pitstop.agent.host.sysfs import SysfsHost, aer_total
from pitstop.health.host import HostThresholds, assess_host
from pitstop.v1 import common_pb2

AER_CORRECTABLE = "".join(
    f"{name} {count}\n"
    for name, count in (
        *(("RxErr", 0), ("BadTLP", 2), ("BadDLLP", 5), ("Rollover", 0), ("Timeout", 0)),
        *(("NonFatalErr", 0), ("CorrIntErr", 0), ("HeaderOF", 0), ("TOTAL_ERR_COR", 7)),
    )
)
_UNCORRECTABLE = (
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
)
"""The lines of aer_dev_fatal and aer_dev_nonfatal, as the kernel prints them."""
AER_FATAL = "".join(f"{n} {int(n == 'DLP')}\n" for n in _UNCORRECTABLE) + "TOTAL_ERR_FATAL 1\n"
AER_NONFATAL = "".join(f"{n} 0\n" for n in _UNCORRECTABLE) + "TOTAL_ERR_NONFATAL 0\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pci_device(root: Path, address: str, *, width: int, speed: str) -> Path:
    device = root / "sys/devices/pci0000:00/0000:00:01.0" / address
    write(device / "aer_dev_correctable", AER_CORRECTABLE)
    write(device / "aer_dev_nonfatal", AER_NONFATAL)
    write(device / "aer_dev_fatal", AER_FATAL)
    write(device / "current_link_width", f"{width}\n")
    write(device / "max_link_width", "16\n")
    write(device / "current_link_speed", f"{speed} GT/s PCIe\n")
    write(device / "max_link_speed", "32.0 GT/s PCIe\n")
    link = root / "sys/bus/pci/devices" / address
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(device)
    return device


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A node as the kernel lays it out: an NDR port that is up and one that is down,
    an Ethernet NIC, a loopback and a veth, PSI, two memory controllers, and a GPU and
    the NIC on PCIe."""
    root = tmp_path / "root"
    nic = pci_device(root, "0000:18:00.0", width=8, speed="16.0")
    pci_device(root, "0000:3b:00.0", width=16, speed="2.5")
    ib = root / "sys/class/infiniband/mlx5_0"
    ib.mkdir(parents=True)
    (ib / "device").symlink_to(nic)
    for port, state, phys, downed, errors in (
        ("1", "4: ACTIVE", "5: LinkUp", 3, (2, 1, 0, 0, 0)),
        ("2", "1: DOWN", "3: Disabled", 7, (0, 0, 0, 0, 0)),
    ):
        p = ib / "ports" / port
        write(p / "state", f"{state}\n")
        write(p / "phys_state", f"{phys}\n")
        write(p / "rate", "400 Gb/sec (4X NDR)\n")
        write(p / "counters/link_downed", f"{downed}\n")
        write(p / "counters/xmit_wait", "123456\n")  # congestion: not an error
        for name, count in zip(
            (
                "symbol_error",
                "port_rcv_errors",
                "link_error_recovery",
                "local_link_integrity_errors",
                "excessive_buffer_overrun_errors",
            ),
            errors,
            strict=True,
        ):
            write(p / "counters" / name, f"{count}\n")
    net = root / "sys/class/net"
    eth = net / "eth0"
    for name, text in (
        ("type", "1"),
        ("carrier", "1"),
        ("carrier_down_count", "2"),
        ("speed", "100000"),
        ("statistics/rx_errors", "4"),
        ("statistics/tx_errors", "1"),
    ):
        write(eth / name, f"{text}\n")
    (eth / "device").symlink_to(nic)
    write(net / "lo/type", "772\n")
    write(net / "veth0/type", "1\n")  # virtual: no device behind it
    write(net / "veth0/carrier", "0\n")
    write(
        root / "proc/pressure/memory",
        "some avg10=1.50 avg60=0.80 avg300=0.20 total=912345\n"
        "full avg10=0.75 avg60=0.30 avg300=0.05 total=412345\n",
    )
    for mc, ce, ue in (("mc0", 3, 0), ("mc1", 2, 1)):
        write(root / "sys/devices/system/edac/mc" / mc / "ce_count", f"{ce}\n")
        write(root / "sys/devices/system/edac/mc" / mc / "ue_count", f"{ue}\n")
    return root


def test_the_real_reader_reads_the_kernels_layout(tree: Path, tmp_path: Path) -> None:
    reading = SysfsHost(root=tree, disk_paths=[tmp_path], gpu_addresses=["00000000:3B:00.0"]).read()
    links = {link.name: link for link in reading.links}
    assert set(links) == {"mlx5_0/1", "mlx5_0/2", "eth0"}
    up, down, eth = links["mlx5_0/1"], links["mlx5_0/2"], links["eth0"]
    assert (up.kind, up.up, up.rate_gbps, up.down_count, up.error_count) == (
        "infiniband",
        True,
        400,
        3,
        3,
    )
    assert (down.up, down.down_count) == (False, 7)
    assert (eth.kind, eth.up, eth.rate_gbps, eth.down_count, eth.error_count) == (
        "ethernet",
        True,
        100,
        2,
        5,
    )
    assert reading.memory.pressure_full_avg10 == 0.75
    assert (reading.memory.edac_corrected, reading.memory.edac_uncorrected) == (5, 1)
    assert [d.path for d in reading.disks] == [str(tmp_path)]
    assert reading.disks[0].total_bytes > reading.disks[0].free_bytes > 0
    pcie = {d.role: d for d in reading.pcie}
    assert pcie["gpu"].address == "0000:3b:00.0"
    assert (pcie["nic"].address, pcie["nic"].link_width, pcie["nic"].link_speed_gts) == (
        "0000:18:00.0",
        8,
        16,
    )
    assert (pcie["nic"].aer_correctable, pcie["nic"].aer_fatal, pcie["nic"].aer_nonfatal) == (
        7,
        1,
        0,
    )
    assert list(reading.unsupported) == ["oom"]  # no kernel log given


def test_a_host_without_a_source_names_it_and_reads_the_rest(tmp_path: Path) -> None:
    reading = SysfsHost(root=tmp_path, gpu_addresses=["0000:3b:00.0"]).read()
    assert list(reading.unsupported) == ["infiniband", "psi", "edac", "oom", "aer"]
    assert list(reading.links) == []
    assert list(reading.pcie) == []


def test_the_fixture_node_is_judged_as_its_faults_say(tree: Path, tmp_path: Path) -> None:
    seen_up = {"mlx5_0/1": 400.0, "mlx5_0/2": 400.0}  # both ports were up before
    judged = assess_host(SysfsHost(root=tree, disk_paths=[tmp_path]).read(), now=0, seen_up=seen_up)
    assert judged.verdict == common_pb2.HEALTH_VERDICT_FATAL
    assert judged.reasons[0] == "infiniband link mlx5_0/2 is down"


def test_this_machine_reads_without_error() -> None:
    reading = SysfsHost(disk_paths=[Path("/")]).read()
    assert ("infiniband" in reading.unsupported) != Path("/sys/class/infiniband").is_dir()
    assert ("psi" in reading.unsupported) != Path("/proc/pressure/memory").exists()
    assert reading.disks[0].total_bytes > 0


def test_aer_lines_are_summed_by_their_total() -> None:
    assert aer_total(AER_CORRECTABLE, "TOTAL_ERR_COR") == 7
    assert aer_total("", "TOTAL_ERR_FATAL") == 0


def test_oom_records_in_the_kmsg_format() -> None:
    global_oom = (
        "3,1024,6143210987,-;Out of memory: Killed process 4321 (python) total-vm:5432100kB, "
        "anon-rss:4012345kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:8200kB oom_score_adj:0\n"
    )
    assert oom_killed(global_oom) == "pid 4321 (python)"
    cgroup = (
        "3,1025,6143210999,-;Memory cgroup out of memory: Killed process 77 (pt_main_thread) "
        "total-vm:1kB\n SUBSYSTEM=memory"
    )
    assert oom_killed(cgroup) == "pid 77 (pt_main_thread)"
    # The same kill's summary line, and anything else, is no second kill.
    summary = (
        "6,1026,6143211000,-;oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),"
        "task=python,pid=4321,uid=0\n"
    )
    assert oom_killed(summary) is None
    assert oom_killed("6,1027,1,-;EXT4-fs (vda): mounted filesystem\n") is None


@pytest.mark.skipif(not os.access(KMSG, os.R_OK | os.W_OK), reason="/dev/kmsg needs root")
def test_the_kernel_log_reports_an_oom_record_logged_after_it_opened() -> None:
    log = KernelLog.open()
    assert log is not None
    try:
        assert log.oom_kills() == []  # what was logged before it opened is not news
        writer = os.open(KMSG, os.O_WRONLY)
        try:
            os.write(writer, b"<6>pitstop test record: Killed process 999999 (pitstop-test)\n")
        finally:
            os.close(writer)
        poll = select.poll()
        poll.register(log.fileno(), select.POLLIN)
        assert poll.poll(5000), "the record never reached /dev/kmsg"
        assert log.oom_kills() == ["pid 999999 (pitstop-test)"]
        assert SysfsHost(root=Path("/nonexistent"), kernel_log=log).read().memory.oom_kills == 0
    finally:
        log.close()


def test_every_simulated_fault_gives_the_verdict_a_real_one_would(tmp_path: Path) -> None:
    sim = SimulatedHost(disk_paths=[tmp_path])
    start = sim.read()
    peaks = {link.name: link.rate_gbps for link in start.links}
    # The disk is real: judged full only at no byte free, whatever this machine has left.
    limits = HostThresholds(disk_free_fraction=0, disk_free_bytes=1)

    def verdict() -> common_pb2.HealthVerdict:
        judged = assess_host(
            sim.read(), now=10, earlier=[(0, start)], seen_up=peaks, thresholds=limits
        )
        return judged.verdict

    assert verdict() == common_pb2.HEALTH_VERDICT_HEALTHY
    steps = [
        (lambda: sim.disk_full(), common_pb2.HEALTH_VERDICT_DEGRADED),
        (lambda: sim.disk_full(False), common_pb2.HEALTH_VERDICT_HEALTHY),
        (lambda: sim.oom_kill(4321, "python"), common_pb2.HEALTH_VERDICT_APPLICATION),
        (lambda: sim.link_flap("mlx5_1/1", 4), common_pb2.HEALTH_VERDICT_WARNING),
        (lambda: sim.link_errors("mlx5_0/1", 500), common_pb2.HEALTH_VERDICT_WARNING),
        (lambda: sim.link_degraded("mlx5_0/1", 200), common_pb2.HEALTH_VERDICT_WARNING),  # errors
        (lambda: sim.pcie_degraded("nic"), common_pb2.HEALTH_VERDICT_WARNING),
        (lambda: sim.memory_errors(corrected=100), common_pb2.HEALTH_VERDICT_WARNING),
        (lambda: sim.pcie_aer(1), common_pb2.HEALTH_VERDICT_FATAL),
    ]
    for inject, expected in steps:
        inject()
        assert verdict() == expected  # each fault at least as bad as the ones before
    sim = SimulatedHost()
    start = sim.read()
    sim.link_down("mlx5_0/1")
    assert verdict() == common_pb2.HEALTH_VERDICT_FATAL
    with pytest.raises(ValueError, match="port 'ib9/1': this node has mlx5_0/1, mlx5_1/1"):
        sim.link_flap("ib9/1", 1)
    with pytest.raises(ValueError, match="count 0: give 1 or more"):
        sim.link_errors("mlx5_0/1", 0)
    with pytest.raises(ValueError, match="reads no disk: set host_disk_paths"):
        sim.disk_full()
    # Each fault alone, on a fresh host: the verdict the real reading would get.
    alone = [
        (lambda h: h.memory_pressure(30), common_pb2.HEALTH_VERDICT_DEGRADED),
        (lambda h: h.disk_read_only(), common_pb2.HEALTH_VERDICT_DEGRADED),
        (lambda h: h.memory_errors(uncorrected=1), common_pb2.HEALTH_VERDICT_FATAL),
        (lambda h: h.pcie_aer(1, severity="nonfatal"), common_pb2.HEALTH_VERDICT_WARNING),
        (lambda h: h.pcie_aer(100, severity="correctable"), common_pb2.HEALTH_VERDICT_WARNING),
        (lambda h: h.pcie_aer(99, severity="correctable"), common_pb2.HEALTH_VERDICT_HEALTHY),
    ]
    for inject, expected in alone:
        fresh = SimulatedHost(disk_paths=[tmp_path])
        before = fresh.read()
        inject(fresh)
        judged = assess_host(fresh.read(), now=10, earlier=[(0, before)], thresholds=limits)
        assert judged.verdict == expected, judged.reasons
    with pytest.raises(ValueError, match="severity 'bad': give fatal, nonfatal or correctable"):
        sim.pcie_aer(1, severity="bad")
    with pytest.raises(ValueError, match="memory pressure 120%: give 0 to 100"):
        sim.memory_pressure(120)


def test_a_cleared_simulated_host_is_healthy_again_with_its_counters_kept(
    tmp_path: Path,
) -> None:
    sim = SimulatedHost(disk_paths=[tmp_path / "not-made-yet"])
    start = sim.read()
    assert [d.path for d in start.disks] == [str(tmp_path / "not-made-yet")]  # its parent's
    peaks = {link.name: link.rate_gbps for link in start.links}
    sim.link_down("mlx5_1/1")
    sim.pcie_degraded()
    sim.disk_full()
    assert sim.read().disks[0].free_bytes == 0
    sim.clear()
    after = sim.read()
    limits = HostThresholds(disk_free_fraction=0, disk_free_bytes=1)
    judged = assess_host(after, now=100, earlier=[(0, start)], seen_up=peaks, thresholds=limits)
    assert judged.verdict == common_pb2.HEALTH_VERDICT_HEALTHY, judged.reasons
    assert after.disks[0].free_bytes > 0
    assert [link.down_count for link in after.links] == [0, 1]  # the kernel's count stays


def test_an_oom_kill_is_known_by_the_pid_it_killed() -> None:
    sim = SimulatedHost()
    assert not sim.killed_for_memory(4321)
    sim.oom_kill(4321, "python")
    assert sim.killed_for_memory(4321)
    assert not sim.killed_for_memory(432)  # the whole pid, not a prefix
    assert sim.recent_oom_kills() == ["pid 4321 (python)"]
