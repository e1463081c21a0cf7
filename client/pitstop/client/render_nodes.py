"""Rich tables and detail views of nodes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from rich.console import Group, RenderableType
from rich.table import Table

from pitstop.client.enums import NODE_ROLES, NODE_STATES, VERDICTS, XID_SOURCES, enum_word
from pitstop.client.render import add_row, details, format_age, format_time, table
from pitstop.v1 import common_pb2, nodes_pb2


def node_state(node: nodes_pb2.Node) -> str:
    """The node's state as a word, e.g. ``cordoned``."""
    return enum_word(NODE_STATES, node.state)


def node_role(node: nodes_pb2.Node) -> str:
    """The node's role as a word: ``worker`` or ``spare``."""
    return enum_word(NODE_ROLES, node.role)


def topology(labels: common_pb2.TopologyLabels) -> str:
    """Failure-domain labels as ``zone/block/rack``."""
    return "/".join(label or "-" for label in (labels.zone, labels.block, labels.rack))


def nodes_table(nodes: Sequence[nodes_pb2.Node], now: datetime) -> Table:
    """One row per node: id, role, state, reason, topology, GPUs, connection, heartbeat."""
    result = table(
        "ID", "ROLE", "STATE", "REASON", "ZONE/BLOCK/RACK", "GPUS", "CONNECTED", "HEARTBEAT"
    )
    for node in nodes:
        add_row(
            result,
            (
                node.id,
                node_role(node),
                node_state(node),
                node.reason or "-",
                topology(node.labels),
                len(node.inventory.gpus),
                "yes" if node.connected else "no",
                format_age(node.last_heartbeat, now),
            ),
        )
    return result


def node_summary(node: nodes_pb2.Node, now: datetime) -> Table:
    """Key facts of a node: role, state, labels, inventory, liveness."""
    inventory = node.inventory
    health = node.health
    verdict = enum_word(VERDICTS, health.verdict)
    if health.reasons:
        verdict += f" ({'; '.join(health.reasons)})"
    rows: list[tuple[str, object]] = [
        ("id", node.id),
        ("role", node_role(node)),
        ("state", node_state(node) + (f" ({node.reason})" if node.reason else "")),
        ("zone/block/rack", topology(node.labels)),
        ("nvlink domain", node.labels.nvlink_domain or "-"),
        ("hostname", inventory.hostname or "-"),
        ("gpus", f"{len(inventory.gpus)} ({inventory.gpu_backend or '?'} backend)"),
        ("driver", inventory.driver_version or "-"),
        ("agent", inventory.agent_version or "-"),
        ("checkpointd", inventory.checkpointd_address or "-"),
        ("connected", "yes" if node.connected else "no"),
        (
            "last heartbeat",
            f"{format_time(node.last_heartbeat)} ({format_age(node.last_heartbeat, now)} ago)",
        ),
        ("registered", format_time(node.registered_at)),
        ("health", verdict),
        ("jobs", ", ".join(node.job_ids) or "-"),
        ("standbys waiting", ", ".join(node.standby_job_ids) or "-"),
    ]
    return details(rows)


def gpu_health_table(node: nodes_pb2.Node) -> Table:
    """Per-GPU readings and verdicts."""
    names = {gpu.index: gpu.name for gpu in node.inventory.gpus}
    result = table(
        "GPU",
        "NAME",
        "TEMP",
        "POWER",
        "ECC DBE",
        "REMAP",
        "LOST",
        "VERDICT",
        "REASONS",
        title="gpu health",
    )
    for gpu in node.health.gpus:
        remap = "pending" if gpu.remapped_rows_pending else ""
        if gpu.remapped_rows_failure:
            remap = "failed"
        add_row(
            result,
            (
                gpu.index,
                names.get(gpu.index, "-"),
                f"{gpu.temperature_c:.0f}C",
                f"{gpu.power_w:.0f}W",
                gpu.ecc_uncorrected_volatile,
                remap,
                "yes" if gpu.lost else "",
                enum_word(VERDICTS, gpu.verdict),
                "; ".join(gpu.reasons),
            ),
        )
    return result


def xid_table(node: nodes_pb2.Node) -> Table:
    """Recent Xid events, newest first."""
    result = table("TIME", "GPU", "XID", "VERDICT", "SOURCE", "MESSAGE", title="xid history")
    for xid in node.xid_history:
        add_row(
            result,
            (
                format_time(xid.time),
                xid.gpu_index,
                xid.xid,
                enum_word(VERDICTS, xid.verdict),
                enum_word(XID_SOURCES, xid.source),
                xid.message,
            ),
        )
    return result


def node_view(node: nodes_pb2.Node, now: datetime) -> RenderableType:
    """Everything ``pitstop node show`` prints, sections left out when empty."""
    parts: list[RenderableType] = [node_summary(node, now)]
    if node.health.gpus:
        parts += ["", gpu_health_table(node)]
    if node.xid_history:
        parts += ["", xid_table(node)]
    return Group(*parts)
