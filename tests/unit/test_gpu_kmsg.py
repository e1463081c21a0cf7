"""Xid lines from the kernel log, matched to GPUs by PCI bus id."""

from __future__ import annotations

import pytest

from pitstop.agent.gpu import kmsg
from pitstop.v1 import common_pb2

# As NVML names them.
GPUS = {"00000000:18:00.0": 0, "00000000:3B:00.0": 1, "00000009:01:00.0": 2}

LOG = """\
[    4.120113] nvidia: module license 'NVIDIA' taints kernel.
[    5.771201] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15
NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit \
error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.
NVRM: GPU at PCI:0000:3b:00: GPU-3f2a61c4-1b2c-4d5e-8f90-a1b2c3d4e5f6
NVRM: GPU Board Serial Number: 1652722012345
NVRM: Xid (PCI:0000:af:00): 31, pid=99, name=python3, Ch 00000008, intr 00000000. MMU Fault
kernel: NVRM: Xid (PCI:0009:01:00): 94, pid=4242, name=pt_main_thread, Contained: CE User \
Channel (0x9). RST: No, D-RST: No
[ 8812.441980] NVRM: Xid (PCI:0000:18:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)
NVRM: Xid (PCI:0000:3B:00): 63, pid=1, name=init, Row Remapper: New row marked for remapping
NVRM: Xid (PCI:0000:18:00): 119
NVRM: Xid (PCI:zz:18:00): 79, pid=1, name=x, garbage bus id
NVRM: Xid (PCI:0000:18:00): notanumber, pid=1, name=x, bad xid
systemd[1]: Started Session 3 of User root.
"""


def test_real_looking_log() -> None:
    events = kmsg.parse_xid_lines(LOG, GPUS)
    assert [(e.gpu_index, e.xid) for e in events] == [
        (1, 79),
        (0, 48),
        (2, 94),
        (0, 13),
        (1, 63),
        (0, 119),
    ]
    assert events[0].message == "GPU has fallen off the bus."
    assert events[1].message.startswith("An uncorrectable double bit error (DBE)")
    assert events[1].message.endswith("subpartition 0.")
    assert events[2].message == "Contained: CE User Channel (0x9). RST: No, D-RST: No"
    assert events[3].message == "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)"
    assert events[5].message == ""
    for event in events:
        assert event.source == common_pb2.XID_SOURCE_KERNEL_LOG
        assert event.gpu_uuid == ""
        assert not event.HasField("time")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.", 79),
        ("[123.4] NVRM: Xid (PCI:0000:3B:00): 74, pid=7, name=torchrun, NVLink: fatal error", 74),
        ("Jan 01 host kernel: NVRM: Xid (PCI:0000:3b:00): 45, pid=8, name=p, Ch 00000010", 45),
        ("NVRM: Xid (PCI:3b:00): 43, pid=8, name=p, reset channel", 43),
        ("NVRM: Xid (PCI:0000:5e:00): 79, pid=1234, name=python, other GPU", None),
        ("NVRM: GPU at PCI:0000:3b:00: GPU-3f2a61c4", None),
        ("NVRM: Xid 79 mentioned in passing", None),
        ("", None),
    ],
)
def test_one_line(line: str, expected: int | None) -> None:
    events = kmsg.parse_xid_lines(line, GPUS)
    assert [e.xid for e in events] == ([] if expected is None else [expected])
    assert all(e.gpu_index == 1 for e in events)


def test_domains_tell_grace_gpus_apart() -> None:
    gpus = {"00000008:01:00.0": 0, "00000009:01:00.0": 1}
    text = "NVRM: Xid (PCI:0009:01:00): 79, pid=1, name=p, x\nNVRM: Xid (PCI:0008:01:00): 48"
    assert [(e.gpu_index, e.xid) for e in kmsg.parse_xid_lines(text, gpus)] == [(1, 79), (0, 48)]


@pytest.mark.parametrize(
    ("bus_id", "address"),
    [
        ("00000000:3B:00.0", (0, 0x3B, 0)),
        ("0000:3b:00", (0, 0x3B, 0)),
        ("3b:00", (0, 0x3B, 0)),
        ("00000009:01:00.0", (9, 1, 0)),
        ("not a bus id", None),
        ("", None),
        ("0000:3b:00:00:1", None),
    ],
)
def test_pci_address(bus_id: str, address: tuple[int, int, int] | None) -> None:
    assert kmsg.pci_address(bus_id) == address


def test_no_gpus_no_events() -> None:
    assert kmsg.parse_xid_lines(LOG, {}) == []


def test_read_kernel_log_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kmsg, "KERNEL_LOG_COMMANDS", (("pitstop-no-such-command",),))
    assert kmsg.read_kernel_log() is None
    monkeypatch.setattr(kmsg, "KERNEL_LOG_COMMANDS", (("false",), ("echo", "NVRM: hello")))
    assert kmsg.read_kernel_log() == "NVRM: hello\n"
