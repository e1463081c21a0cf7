"""The Xid catalog: what each NVIDIA driver Xid means and what pitstop does about it.

Source: NVIDIA, "NVIDIA GPU Xid Errors" (https://docs.nvidia.com/deploy/xid-errors/), the
Xid catalog table giving each Xid's description and recommended action. The names below
are that catalog's descriptions; the classes are pitstop's policy (docs/architecture.md, "Health"),
which wins where it differs from NVIDIA's per-Xid suggestion. Where it differs:

- 94 (contained ECC error): NVIDIA says restart the application; pitstop drains and
  swaps at the next committed checkpoint, because the memory that produced it is suspect.
- 154 (GPU recovery action changed): pitstop treats it as a warning, like any NVML recovery
  action other than none; the recovery action field itself is read with the GPU's health.

Only Xids whose meaning is well established are listed. An Xid not listed is classified
WARNING: an unknown hardware error is never ignored, but does not kill a node on its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pitstop.v1 import common_pb2


class XidClass(enum.StrEnum):
    """What an Xid means for the job: the four responses pitstop has."""

    FATAL = "fatal"
    """The GPU is broken: replace the node now."""
    APPLICATION = "application"
    """A rank failed but the GPU is fine: restart the rank in place."""
    WARNING = "warning"
    """The GPU is degrading: drain and swap at the next committed checkpoint."""
    INFO = "info"
    """Nothing to do: record it."""


@dataclass(frozen=True)
class XidInfo:
    """One catalog row: an Xid, its meaning and pitstop's response."""

    xid: int
    name: str
    """Short description, from NVIDIA's catalog."""
    xid_class: XidClass
    action: str
    """What pitstop does, in words."""


_REPLACE = "replace the node now"
_RESTART = "restart the rank in place; the GPU is fine"
_DRAIN = "drain and swap the node at the next committed checkpoint"
_RECORD = "record only"

_ROWS: tuple[tuple[int, str, XidClass], ...] = (
    # Application faults: the GPU is healthy, the process on it is not.
    (13, "Graphics engine exception", XidClass.APPLICATION),
    (31, "GPU memory page fault", XidClass.APPLICATION),
    (43, "GPU stopped processing", XidClass.APPLICATION),
    (45, "Preemptive cleanup, due to previous errors", XidClass.APPLICATION),
    (109, "Context switch timeout", XidClass.APPLICATION),
    # Hardware or firmware faults that need the GPU reset or serviced.
    (48, "Double-bit ECC error", XidClass.FATAL),
    (61, "Internal micro-controller breakpoint/warning", XidClass.FATAL),
    (62, "Internal micro-controller halt", XidClass.FATAL),
    (64, "ECC page retirement or row remapping recording failure", XidClass.FATAL),
    (74, "NVLink error", XidClass.FATAL),
    (79, "GPU has fallen off the bus", XidClass.FATAL),
    (95, "Uncontained ECC error", XidClass.FATAL),
    (119, "GSP RPC timeout", XidClass.FATAL),
    (120, "GSP error", XidClass.FATAL),
    (140, "Unrecovered ECC error", XidClass.FATAL),
    (143, "GPU initialization failure", XidClass.FATAL),
    # Degradation: the GPU still works, but should leave at the next checkpoint.
    (63, "ECC page retirement or row remapping recording event", XidClass.WARNING),
    (92, "High single-bit ECC error rate", XidClass.WARNING),
    (94, "Contained ECC error", XidClass.WARNING),
    (154, "GPU recovery action changed", XidClass.WARNING),
    # Out-of-band management test messages: nothing is wrong.
    (106, "SMBPBI test message", XidClass.INFO),
    (107, "SMBPBI test message (silent)", XidClass.INFO),
)

_ACTIONS: Mapping[XidClass, str] = MappingProxyType(
    {
        XidClass.FATAL: _REPLACE,
        XidClass.APPLICATION: _RESTART,
        XidClass.WARNING: _DRAIN,
        XidClass.INFO: _RECORD,
    }
)

XID_CATALOG: Mapping[int, XidInfo] = MappingProxyType(
    {xid: XidInfo(xid, name, cls, _ACTIONS[cls]) for xid, name, cls in _ROWS}
)
"""Every Xid pitstop knows, by number. Read-only."""

_VERDICTS: Mapping[XidClass, common_pb2.HealthVerdict] = MappingProxyType(
    {
        XidClass.FATAL: common_pb2.HEALTH_VERDICT_FATAL,
        XidClass.APPLICATION: common_pb2.HEALTH_VERDICT_APPLICATION,
        XidClass.WARNING: common_pb2.HEALTH_VERDICT_WARNING,
        XidClass.INFO: common_pb2.HEALTH_VERDICT_HEALTHY,
    }
)


def classify_xid(xid: int) -> XidInfo:
    """Return the catalog row for `xid`; an Xid not in the catalog is a WARNING."""
    info = XID_CATALOG.get(xid)
    if info is not None:
        return info
    return XidInfo(xid, f"unknown Xid {xid}", XidClass.WARNING, _ACTIONS[XidClass.WARNING])


def verdict_for(xid_class: XidClass) -> common_pb2.HealthVerdict:
    """Return the HealthVerdict an Xid of this class gives its GPU (INFO leaves it HEALTHY)."""
    return _VERDICTS[xid_class]
