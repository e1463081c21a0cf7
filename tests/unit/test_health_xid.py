"""The Xid catalog and classification (pitstop.health.xid)."""

from __future__ import annotations

import pytest

from pitstop.health.xid import XID_CATALOG, XidClass, XidInfo, classify_xid, verdict_for
from pitstop.v1 import common_pb2

# docs/architecture.md ("Health") names these; the catalog must agree with it.
DOCUMENTED_CLASSES = [
    *[(xid, XidClass.FATAL) for xid in (48, 64, 74, 79, 95, 119, 120, 140)],
    *[(xid, XidClass.APPLICATION) for xid in (13, 31, 43, 45)],
    *[(xid, XidClass.WARNING) for xid in (63, 92, 94)],
]


@pytest.mark.parametrize(("xid", "xid_class"), DOCUMENTED_CLASSES)
def test_design_xids_have_the_designed_class(xid: int, xid_class: XidClass) -> None:
    info = classify_xid(xid)
    assert info.xid == xid
    assert info.xid_class is xid_class
    assert info.name
    assert not info.name.startswith("unknown")


@pytest.mark.parametrize(
    ("xid", "name"),
    [
        (13, "Graphics engine exception"),
        (31, "GPU memory page fault"),
        (48, "Double-bit ECC error"),
        (74, "NVLink error"),
        (79, "GPU has fallen off the bus"),
        (94, "Contained ECC error"),
        (95, "Uncontained ECC error"),
        (119, "GSP RPC timeout"),
        (154, "GPU recovery action changed"),
    ],
)
def test_names_come_from_the_nvidia_catalog(xid: int, name: str) -> None:
    assert classify_xid(xid).name == name


@pytest.mark.parametrize(
    ("xid_class", "action_words"),
    [
        (XidClass.FATAL, "replace the node"),
        (XidClass.APPLICATION, "restart the rank"),
        (XidClass.WARNING, "next committed checkpoint"),
        (XidClass.INFO, "record"),
    ],
)
def test_every_class_is_in_the_catalog_with_its_action(
    xid_class: XidClass, action_words: str
) -> None:
    rows = [info for info in XID_CATALOG.values() if info.xid_class is xid_class]
    assert rows
    assert all(action_words in info.action for info in rows)


@pytest.mark.parametrize("xid", [0, 1, 2, 57, 999, 2**31])
def test_unknown_xid_is_a_warning_not_ignored_and_not_fatal(xid: int) -> None:
    assert xid not in XID_CATALOG
    info = classify_xid(xid)
    assert info == XidInfo(xid, f"unknown Xid {xid}", XidClass.WARNING, info.action)
    assert "next committed checkpoint" in info.action
    assert verdict_for(info.xid_class) == common_pb2.HEALTH_VERDICT_WARNING


@pytest.mark.parametrize(
    ("xid_class", "verdict"),
    [
        (XidClass.FATAL, common_pb2.HEALTH_VERDICT_FATAL),
        (XidClass.APPLICATION, common_pb2.HEALTH_VERDICT_APPLICATION),
        (XidClass.WARNING, common_pb2.HEALTH_VERDICT_WARNING),
        (XidClass.INFO, common_pb2.HEALTH_VERDICT_HEALTHY),
    ],
)
def test_verdict_for_each_class(xid_class: XidClass, verdict: int) -> None:
    assert verdict_for(xid_class) == verdict


def test_catalog_rows_are_keyed_by_their_own_xid() -> None:
    for xid, info in XID_CATALOG.items():
        assert info.xid == xid
        assert classify_xid(xid) is info


def test_catalog_is_read_only() -> None:
    with pytest.raises(TypeError):
        XID_CATALOG[1] = classify_xid(1)  # type: ignore[index]
    with pytest.raises(AttributeError):
        classify_xid(79).xid_class = XidClass.INFO  # type: ignore[misc]


def test_xid_class_is_a_str_enum() -> None:
    assert [str(c) for c in XidClass] == ["fatal", "application", "warning", "info"]
