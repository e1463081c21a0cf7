"""NodeService and EventService."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pitstop.scheduler.api.agent import NODE_ID_RE
from pitstop.scheduler.api.watch import follow_events
from pitstop.scheduler.auth import current_caller
from pitstop.scheduler.convert import (
    event_to_pb,
    node_in_full_to_pb,
    node_roles_from_pb,
    node_states_from_pb,
    node_to_pb,
)
from pitstop.scheduler.errors import InvalidArgument, Unavailable
from pitstop.scheduler.gateway import CommandRouter
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services import enrollment
from pitstop.scheduler.services import events as event_service
from pitstop.scheduler.services import nodes as node_service
from pitstop.scheduler.services.health import health_verdict
from pitstop.scheduler.services.views import node_in_full
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2, common_pb2, nodes_pb2


class NodeServicer:
    def __init__(self, store: Store, hot: HotState, router: CommandRouter) -> None:
        self.store = store
        self.hot = hot
        self.router = router

    async def _live_health(self, node_id: str) -> dict[str, Any] | None:
        return await self.hot.node_health(node_id)

    async def List(  # noqa: N802 (gRPC method names)
        self, request: nodes_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.ListNodesResponse:
        states = node_states_from_pb(request.states)
        roles = node_roles_from_pb(request.roles)
        async with self.store.read() as session:
            nodes = await node_service.list_nodes(session, states=states, roles=roles)
        return nodes_pb2.ListNodesResponse(nodes=[node_to_pb(n) for n in nodes])

    async def Get(  # noqa: N802
        self, request: nodes_pb2.GetNodeRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.Node:
        return node_in_full_to_pb(await node_in_full(self.store, self.hot, request.node_id))

    async def Cordon(  # noqa: N802
        self, request: nodes_pb2.NodeControlRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.Node:
        async with self.store.write() as session:
            node = await node_service.cordon_node(
                session, request.node_id, reason=request.reason, actor=current_caller.get().actor
            )
        return node_to_pb(node)

    async def Uncordon(  # noqa: N802
        self, request: nodes_pb2.NodeControlRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.Node:
        live = await self._live_health(request.node_id) if request.node_id else None
        async with self.store.write() as session:
            node = await node_service.uncordon_node(
                session,
                request.node_id,
                reason=request.reason,
                actor=current_caller.get().actor,
                live_verdict=health_verdict(live) if live else None,
                live_received_at=float(live.get("received_at", 0.0)) if live else 0.0,
            )
        return node_to_pb(node)

    async def Drain(  # noqa: N802
        self, request: nodes_pb2.NodeControlRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.Node:
        async with self.store.write() as session:
            node = await node_service.drain_node(
                session, request.node_id, reason=request.reason, actor=current_caller.get().actor
            )
        return node_to_pb(node)

    async def SetRole(  # noqa: N802
        self, request: nodes_pb2.SetNodeRoleRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.Node:
        if request.role == common_pb2.NODE_ROLE_UNSPECIFIED:
            raise InvalidArgument("role", "unspecified", "use worker or spare")
        (role,) = node_roles_from_pb([request.role], field="role")
        async with self.store.write() as session:
            node = await node_service.set_node_role(
                session,
                request.node_id,
                role,
                reason=request.reason,
                actor=current_caller.get().actor,
            )
        return node_to_pb(node)

    async def InjectFault(  # noqa: N802
        self, request: nodes_pb2.InjectFaultRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.InjectFaultResponse:
        if not request.fault.HasField("kind"):
            raise InvalidArgument(
                "fault.kind", "none", "choose one fault: xid, ecc_double_bit, gpu_lost, ..."
            )
        async with self.store.read() as session:
            node = await node_service.get_node(session, request.node_id)
        if request.fault.gpu_index >= max(len(node.gpus), 1):
            raise InvalidArgument(
                "fault.gpu_index",
                request.fault.gpu_index,
                f"node {node.id} has GPUs 0..{len(node.gpus) - 1}",
            )
        if not node.connected:
            raise Unavailable(f"node {node.id} has no open agent stream; start its agent")
        command_id = await self.router.send(
            node.id, agent_pb2.SchedulerMessage(inject_fault=request.fault)
        )
        if command_id is None:
            raise Unavailable(f"cannot reach the scheduler process holding node {node.id}")
        return nodes_pb2.InjectFaultResponse(command_id=command_id)

    async def Revoke(  # noqa: N802
        self, request: nodes_pb2.NodeControlRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.Node:
        async with self.store.write() as session:
            node = await node_service.revoke_node(
                session, request.node_id, reason=request.reason, actor=current_caller.get().actor
            )
        await self.router.close(node.id, "the node's certificate was revoked")
        return node_to_pb(node)

    async def CreateJoinToken(  # noqa: N802
        self, request: nodes_pb2.CreateJoinTokenRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.CreateJoinTokenResponse:
        if request.node_id and not NODE_ID_RE.fullmatch(request.node_id):
            raise InvalidArgument(
                "node_id", request.node_id, "use letters, digits, '.', '-' or '_' (a host name)"
            )
        seconds = request.ttl_seconds or int(enrollment.DEFAULT_TTL.total_seconds())
        async with self.store.write() as session:
            token, row = await enrollment.create_token(
                session,
                dt.timedelta(seconds=seconds),
                request.node_id,
                actor=current_caller.get().actor,
            )
        response = nodes_pb2.CreateJoinTokenResponse(token=token, node_id=row.node_id)
        response.expires_at.FromDatetime(row.expires_at)
        return response


class EventServicer:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def List(  # noqa: N802
        self, request: nodes_pb2.ListEventsRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.ListEventsResponse:
        async with self.store.read() as session:
            rows = await event_service.list_events(
                session,
                job_id=request.job_id,
                node_id=request.node_id,
                after_id=request.after_event_id,
                limit=request.limit or 100,
            )
        return nodes_pb2.ListEventsResponse(events=[event_to_pb(r) for r in rows])

    async def Watch(  # noqa: N802
        self, request: nodes_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.Event]:
        async for event in follow_events(
            self.store,
            job_id=request.job_id,
            node_id=request.node_id,
            after_id=request.after_event_id,
        ):
            yield event
