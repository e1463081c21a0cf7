"""AgentService.Connect: one bidirectional stream per node.

The first message must be Register; sequence numbers must increase by one. Heartbeats
land in Redis (liveness deadline, live health), never in a PostgreSQL write per beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format

from pitstop.scheduler.convert import NODE_ROLE_TO_PB, NODE_STATE_TO_PB, node_roles_from_pb
from pitstop.scheduler.errors import FailedPrecondition, InvalidArgument
from pitstop.scheduler.gateway import AgentGateway
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.jobspec import check_text
from pitstop.scheduler.services import nodes as node_service
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2

log = logging.getLogger(__name__)


class AgentServicer:
    def __init__(
        self, store: Store, hot: HotState, gateway: AgentGateway, heartbeat_interval: float
    ) -> None:
        self.store = store
        self.hot = hot
        self.gateway = gateway
        self.heartbeat_interval = heartbeat_interval

    async def Connect(  # noqa: N802 (gRPC method name)
        self,
        requests: AsyncIterator[agent_pb2.AgentMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[agent_pb2.SchedulerMessage]:
        first = await anext(aiter(requests), None)
        if first is None:
            return
        node_id = await self._register(first)
        queue = self.gateway.attach(node_id)
        reader = asyncio.create_task(self._read(node_id, first.seq, requests), name=node_id)
        try:
            yield agent_pb2.SchedulerMessage(registered=await self._registered(node_id))
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    reader.result()  # re-raise a protocol error; else the agent hung up
                    return
                item = getter.result()
                if self.gateway.is_close(item):
                    return
                yield item
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if self.gateway.detach(node_id, queue):
                with contextlib.suppress(Exception):
                    async with self.store.write() as session:
                        await node_service.mark_disconnected(session, node_id)

    async def _register(self, message: agent_pb2.AgentMessage) -> str:
        if message.WhichOneof("body") != "register":
            raise FailedPrecondition(
                "the first message on an agent stream must be Register; reconnect and send it"
            )
        if message.seq != 1:
            raise InvalidArgument("seq", message.seq, "a stream's first message has seq 1")
        reg = message.register
        if not reg.node_id:
            raise InvalidArgument("register.node_id", "", "set the agent's node_id")
        check_text("register.node_id", reg.node_id, max_len=253)
        if reg.requested_role:
            node_roles_from_pb([reg.requested_role], field="register.requested_role")
        async with self.store.write() as session:
            node, _created = await node_service.register_node(
                session, reg, now=dt.datetime.now(dt.UTC)
            )
        return node.id

    async def _registered(self, node_id: str) -> agent_pb2.Registered:
        async with self.store.read() as session:
            node = await node_service.get_node(session, node_id)
        return agent_pb2.Registered(
            node_id=node.id,
            heartbeat_interval_seconds=self.heartbeat_interval,
            role=NODE_ROLE_TO_PB[node.role],
            state=NODE_STATE_TO_PB[node.state],
        )

    async def _read(
        self, node_id: str, seq: int, requests: AsyncIterator[agent_pb2.AgentMessage]
    ) -> None:
        async for message in requests:
            if message.seq != seq + 1:
                log.warning("node %s: seq %d after %d; closing stream", node_id, message.seq, seq)
                raise InvalidArgument(
                    "seq", message.seq, f"expected {seq + 1}: sequence numbers increase by one"
                )
            seq = message.seq
            await self._handle(node_id, message)

    async def _handle(self, node_id: str, message: agent_pb2.AgentMessage) -> None:
        kind = message.WhichOneof("body")
        if kind == "heartbeat":
            health: dict[str, Any] = json_format.MessageToDict(
                message.heartbeat.health, preserving_proto_field_name=True
            )
            await self.hot.record_heartbeat(
                node_id, 3 * self.heartbeat_interval, json.dumps(health)
            )
        elif kind == "register":
            raise FailedPrecondition("Register is only valid as a stream's first message")
        else:
            # Xids, step times, exits and acks are acted on by the health and recovery
            # loops; until those run, they are logged so nothing vanishes silently.
            log.info("node %s: %s received", node_id, kind)
