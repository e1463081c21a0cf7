"""``pitstop node ...``: inspect nodes, take them out of service, drill faults."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

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


@nodes_app.command("inject-fault")
def inject_fault(
    ctx: typer.Context,
    node_id: NodeArgument,
    gpu: Annotated[int, typer.Option("--gpu", min=0, help="GPU index on the node.")],
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
    clear: Annotated[bool, typer.Option("--clear", help="Clear injected faults.")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Inject exactly one fault on a node's GPU (drills and tests)."""
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
    }
    given = [option for option, (_, value) in options.items() if value is not None]
    if len(given) != 1:
        got = ", ".join(given) if given else "none"
        raise typer.BadParameter(
            f"give exactly one of {', '.join(options)} (got {got})", param_hint="fault kind"
        )
    fault = common_pb2.Fault(gpu_index=gpu)
    field, value = options[given[0]]
    if field == "nvlink_errors":
        fault.nvlink_errors.CopyFrom(_nvlink_fault(str(value)))
    else:
        setattr(fault, field, value)
    with open_client(ctx) as client:
        response = client.inject_fault(node_id, fault)
    if json_out:
        print_json(to_json(response))
    else:
        typer.echo(f"sent {given[0]} to node {node_id} gpu {gpu} (command {response.command_id})")
