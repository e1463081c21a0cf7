"""``pitstop node ...``: inspect nodes, take them out of service, drill faults."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import typer

from pitstop.client.cli_context import (
    JsonFlag,
    ReasonOption,
    console,
    open_client,
    parse_words,
    print_json,
)
from pitstop.client.enums import NODE_ROLES, NODE_STATES, enum_words, parse_enum_word
from pitstop.client.render import to_json
from pitstop.client.render_nodes import node_role, node_state, node_view, nodes_table
from pitstop.v1 import common_pb2, nodes_pb2

nodes_app = typer.Typer(
    help="Inspect nodes, cordon and drain them, drill faults.", no_args_is_help=True
)

NodeArgument = Annotated[str, typer.Argument(help="Node id.")]


def _announce(node: nodes_pb2.Node, verb: str) -> None:
    reason = f" ({node.reason})" if node.reason else ""
    typer.echo(f"{verb} node {node.id}: {node_role(node)}, {node_state(node)}{reason}")


@nodes_app.command("list")
def list_nodes(
    ctx: typer.Context,
    state: Annotated[
        list[str] | None,
        typer.Option(
            "--state", help=f"Only nodes in this state: {', '.join(enum_words(NODE_STATES))}."
        ),
    ] = None,
    role: Annotated[
        list[str] | None,
        typer.Option(
            "--role", help=f"Only nodes with this role: {', '.join(enum_words(NODE_ROLES))}."
        ),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Nodes, ordered by id."""
    states = parse_words(NODE_STATES, state, "--state")
    roles = parse_words(NODE_ROLES, role, "--role")
    with open_client(ctx) as client:
        nodes = client.list_nodes(states=states, roles=roles)
    if json_out:
        print_json([to_json(node) for node in nodes])
    elif not nodes:
        typer.echo("no nodes" + (" match" if states or roles else " have registered yet"))
    else:
        console().print(nodes_table(nodes, datetime.now(UTC)))


@nodes_app.command("show")
def show(ctx: typer.Context, node_id: NodeArgument, json_out: JsonFlag = False) -> None:
    """A node's labels, inventory, per-GPU health and Xid history."""
    with open_client(ctx) as client:
        node = client.get_node(node_id)
    if json_out:
        print_json(to_json(node))
    else:
        console().print(node_view(node, datetime.now(UTC)))


@nodes_app.command("cordon")
def cordon(ctx: typer.Context, node_id: NodeArgument, reason: ReasonOption = "") -> None:
    """Let the node take nothing new; what runs there keeps running."""
    with open_client(ctx) as client:
        _announce(client.cordon_node(node_id, reason), "cordoned")


@nodes_app.command("uncordon")
def uncordon(ctx: typer.Context, node_id: NodeArgument, reason: ReasonOption = "") -> None:
    """Make a cordoned or draining node schedulable again."""
    with open_client(ctx) as client:
        _announce(client.uncordon_node(node_id, reason), "uncordoned")


@nodes_app.command("drain")
def drain(ctx: typer.Context, node_id: NodeArgument, reason: ReasonOption = "") -> None:
    """Take nothing new and move ranks off at the next committed checkpoint."""
    with open_client(ctx) as client:
        _announce(client.drain_node(node_id, reason), "draining")


@nodes_app.command("revoke")
def revoke(ctx: typer.Context, node_id: NodeArgument, reason: ReasonOption = "") -> None:
    """Revoke the node's certificates (admin): its stream closes now, it is cordoned,
    and it joins again only with a new join token."""
    with open_client(ctx) as client:
        _announce(client.revoke_node(node_id, reason), "revoked")


@nodes_app.command("set-role")
def set_role(
    ctx: typer.Context,
    node_id: NodeArgument,
    role: Annotated[Literal["spare", "worker"], typer.Argument(help="The new role.")],
    reason: ReasonOption = "",
) -> None:
    """Make the node a worker or a hot spare."""
    with open_client(ctx) as client:
        node = client.set_node_role(node_id, parse_enum_word(NODE_ROLES, role), reason)
    _announce(node, "updated")


def _nvlink_fault(value: str) -> common_pb2.NvLinkFault:
    link, sep, count = value.partition(":")
    if not sep or not link.strip().isdigit() or not count.strip().isdigit():
        raise typer.BadParameter(
            f"{value!r} is not LINK:COUNT, e.g. 2:100", param_hint="--nvlink-errors"
        )
    return common_pb2.NvLinkFault(link=int(link), crc_errors=int(count))


def _port_and(value: str, option: str, what: str, example: str) -> tuple[str, str]:
    port, sep, number = value.rpartition(":")
    if not sep or not port.strip() or not number.strip():
        raise typer.BadParameter(f"{value!r} is not PORT:{what}, e.g. {example}", param_hint=option)
    return port.strip(), number.strip()


def _port_count(value: str, option: str) -> common_pb2.PortCount:
    port, count = _port_and(value, option, "COUNT", "mlx5_0/1:4")
    if not count.isdigit() or int(count) < 1:
        raise typer.BadParameter(f"{value!r}: COUNT must be 1 or more", param_hint=option)
    return common_pb2.PortCount(port=port, count=int(count))


def _port_rate(value: str, option: str) -> common_pb2.PortRate:
    port, rate = _port_and(value, option, "GBPS", "mlx5_0/1:200")
    try:
        gbps = float(rate)
    except ValueError:
        gbps = -1.0
    if not gbps > 0:
        raise typer.BadParameter(f"{value!r}: GBPS must be a rate above 0", param_hint=option)
    return common_pb2.PortRate(port=port, rate_gbps=gbps)


def _fault(gpu: int, option: str, field: str, value: object) -> common_pb2.Fault:
    """The Fault for the one option given: `field` is a Fault field, or "host.<field>"."""
    fault = common_pb2.Fault(gpu_index=gpu)
    target: Any = fault
    if field.startswith("host."):
        target, field = fault.host, field.removeprefix("host.")
    if field == "nvlink_errors":
        fault.nvlink_errors.CopyFrom(_nvlink_fault(str(value)))
    elif field in ("link_flap", "link_errors"):
        getattr(target, field).CopyFrom(_port_count(str(value), option))
    elif field == "link_degraded":
        target.link_degraded.CopyFrom(_port_rate(str(value), option))
    elif isinstance(value, common_pb2.PcieFault):
        target.pcie.CopyFrom(value)
    else:
        setattr(target, field, value)
    return fault


@nodes_app.command("inject-fault")
def inject_fault(
    ctx: typer.Context,
    node_id: NodeArgument,
    gpu: Annotated[
        int,
        typer.Option(
            "--gpu", min=0, help="GPU index on the node (the GPU faults', and --oom's rank's)."
        ),
    ] = 0,
    xid: Annotated[int | None, typer.Option("--xid", min=0, help="Report this Xid.")] = None,
    ecc_double_bit: Annotated[
        int | None, typer.Option("--ecc-double-bit", min=1, help="Add double-bit ECC errors.")
    ] = None,
    pending_row_remap: Annotated[
        bool, typer.Option("--pending-row-remap", help="Mark a row remap pending.")
    ] = False,
    gpu_lost: Annotated[
        bool, typer.Option("--gpu-lost", help="The GPU falls off the bus.")
    ] = False,
    thermal_throttle: Annotated[
        bool, typer.Option("--thermal-throttle", help="Throttle the GPU for heat.")
    ] = False,
    nvlink_errors: Annotated[
        str | None,
        typer.Option("--nvlink-errors", metavar="LINK:COUNT", help="Add NVLink CRC errors."),
    ] = None,
    slow: Annotated[
        float | None, typer.Option("--slow", metavar="MULT", help="Multiply step times (> 1).")
    ] = None,
    sdc: Annotated[
        bool,
        typer.Option(
            "--sdc", help="The rank on the GPU flips one bit of its weights at its next step."
        ),
    ] = False,
    nan: Annotated[
        bool,
        typer.Option(
            "--nan", help="The rank on the GPU gets a NaN loss and gradients at its next step."
        ),
    ] = False,
    hang: Annotated[
        bool,
        typer.Option(
            "--hang", help="The rank on the GPU blocks at its next step, outside any collective."
        ),
    ] = False,
    fail_preflight: Annotated[
        bool, typer.Option("--fail-preflight", help="The node's next preflight fails.")
    ] = False,
    clear: Annotated[
        bool, typer.Option("--clear", help="Clear the GPU's injected faults.")
    ] = False,
    link_down: Annotated[
        str | None,
        typer.Option("--link-down", metavar="PORT", help="Host: the port (mlx5_0/1) goes down."),
    ] = None,
    link_up: Annotated[
        str | None,
        typer.Option("--link-up", metavar="PORT", help="Host: the port is up at its full rate."),
    ] = None,
    link_flap: Annotated[
        str | None,
        typer.Option(
            "--link-flap", metavar="PORT:COUNT", help="Host: the port goes down and up COUNT times."
        ),
    ] = None,
    link_errors: Annotated[
        str | None,
        typer.Option(
            "--link-errors", metavar="PORT:COUNT", help="Host: the port's error counters grow."
        ),
    ] = None,
    link_degraded: Annotated[
        str | None,
        typer.Option(
            "--link-degraded",
            metavar="PORT:GBPS",
            help="Host: the port runs slower; the node's ranks step slower with it.",
        ),
    ] = None,
    oom: Annotated[
        bool,
        typer.Option("--oom", help="Host: the kernel kills the rank on --gpu for memory."),
    ] = False,
    disk_full: Annotated[
        bool, typer.Option("--disk-full", help="Host: the daemons' disks read as full.")
    ] = False,
    disk_restored: Annotated[
        bool, typer.Option("--disk-restored", help="Host: the daemons' disks read as they are.")
    ] = False,
    pcie_aer: Annotated[
        int | None,
        typer.Option(
            "--pcie-aer", min=1, metavar="COUNT", help="Host: fatal AER errors on the GPU."
        ),
    ] = None,
    pcie_degraded: Annotated[
        bool, typer.Option("--pcie-degraded", help="Host: the GPU's PCIe link halves its width.")
    ] = False,
    host_clear: Annotated[
        bool, typer.Option("--host-clear", help="Host: undo every injected host fault.")
    ] = False,
    edac_corrected: Annotated[
        int | None,
        typer.Option("--edac-corrected", min=1, metavar="N", help="Host: corrected memory errors."),
    ] = None,
    edac_uncorrected: Annotated[
        int | None,
        typer.Option(
            "--edac-uncorrected", min=1, metavar="N", help="Host: uncorrected memory errors."
        ),
    ] = None,
    memory_pressure: Annotated[
        float | None,
        typer.Option(
            "--memory-pressure",
            min=0,
            max=100,
            metavar="PCT",
            help="Host: PSI full avg10 (0 ends).",
        ),
    ] = None,
    disk_read_only: Annotated[
        bool, typer.Option("--disk-read-only", help="Host: the daemons' disks read read-only.")
    ] = False,
    pcie_nonfatal: Annotated[
        int | None,
        typer.Option("--pcie-nonfatal", min=1, metavar="N", help="Host: non-fatal AER on the GPU."),
    ] = None,
    pcie_correctable: Annotated[
        int | None,
        typer.Option(
            "--pcie-correctable", min=1, metavar="N", help="Host: correctable AER on the GPU."
        ),
    ] = None,
    nic_pcie_degraded: Annotated[
        bool,
        typer.Option("--nic-pcie-degraded", help="Host: the NIC's PCIe link at half width/speed."),
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Inject exactly one fault on a node: on a GPU, or on the host around the GPUs (host
    faults need the simulated host backend)."""
    # Option -> (Fault field, value); unset flags are None so "given" is simply "not None".
    options: dict[str, tuple[str, object]] = {
        "--xid": ("xid", xid),
        "--ecc-double-bit": ("ecc_double_bit", ecc_double_bit),
        "--pending-row-remap": ("pending_row_remap", pending_row_remap or None),
        "--gpu-lost": ("gpu_lost", gpu_lost or None),
        "--thermal-throttle": ("thermal_throttle", thermal_throttle or None),
        "--nvlink-errors": ("nvlink_errors", nvlink_errors),
        "--slow": ("slow_multiplier", slow),
        "--sdc": ("sdc", sdc or None),
        "--nan": ("nan", nan or None),
        "--hang": ("hang", hang or None),
        "--fail-preflight": ("fail_preflight", fail_preflight or None),
        "--clear": ("clear", clear or None),
        "--link-down": ("host.link_down", link_down),
        "--link-up": ("host.link_up", link_up),
        "--link-flap": ("host.link_flap", link_flap),
        "--link-errors": ("host.link_errors", link_errors),
        "--link-degraded": ("host.link_degraded", link_degraded),
        "--oom": ("host.oom", oom or None),
        "--disk-full": ("host.disk_full", True if disk_full else None),
        "--disk-restored": ("host.disk_full", False if disk_restored else None),
        "--pcie-aer": ("host.pcie_aer", pcie_aer),
        "--pcie-degraded": ("host.pcie_degraded", pcie_degraded or None),
        "--host-clear": ("host.clear", host_clear or None),
        "--edac-corrected": ("host.edac_corrected", edac_corrected),
        "--edac-uncorrected": ("host.edac_uncorrected", edac_uncorrected),
        "--memory-pressure": ("host.memory_pressure_percent", memory_pressure),
        "--disk-read-only": ("host.disk_read_only", disk_read_only or None),
        "--pcie-nonfatal": ("host.pcie", common_pb2.PcieFault(nonfatal=pcie_nonfatal or 0)),
        "--pcie-correctable": (
            "host.pcie",
            common_pb2.PcieFault(correctable=pcie_correctable or 0),
        ),
        "--nic-pcie-degraded": ("host.pcie", common_pb2.PcieFault(role="nic", degraded=True)),
    }
    given_pcie = {
        "--pcie-nonfatal": pcie_nonfatal,
        "--pcie-correctable": pcie_correctable,
        "--nic-pcie-degraded": nic_pcie_degraded or None,
    }
    given = [
        option
        for option, (_, value) in options.items()
        if (given_pcie.get(option, value)) is not None
    ]
    if len(given) != 1:
        got = ", ".join(given) if given else "none"
        raise typer.BadParameter(
            f"give exactly one of {', '.join(options)} (got {got})", param_hint="fault kind"
        )
    field, value = options[given[0]]
    fault = _fault(gpu, given[0], field, value)
    with open_client(ctx) as client:
        response = client.inject_fault(node_id, fault)
    if json_out:
        print_json(to_json(response))
    else:
        on = "" if field.startswith("host.") and field != "host.oom" else f" gpu {gpu}"
        typer.echo(f"sent {given[0]} to node {node_id}{on} (command {response.command_id})")
