"""A hand-driven agent stream: what an agent says to the scheduler, said by the test."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import grpc

from kit.ports import free_port
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2

LIVE_HOST = f"127.0.0.1:{free_port()}"
"""A checkpoint daemon address where nothing listens: the node's host answers at once,
refusing, as a live host does (a stream that ends is judged without the probe's wait)."""


class AgentStream:
    """A hand-driven agent stream: Register on open, then whatever the test sends. Its
    host is up (LIVE_HOST) unless `checkpointd_address` says otherwise."""

    def __init__(
        self,
        channel: grpc.Channel,
        node_id: str,
        gpus: int = 8,
        zone: str = "z1",
        block: str = "b1",
        rack: str = "r1",
        role: str = "worker",
        checkpointd_address: str = LIVE_HOST,
        recent_exits: Sequence[agent_pb2.RankExited] = (),
    ) -> None:
        self._outbox: queue.Queue[agent_pb2.AgentMessage | None] = queue.Queue()
        self.seq = 0
        self.node_id = node_id
        register = agent_pb2.Register(
            node_id=node_id,
            inventory=common_pb2.Inventory(
                hostname=node_id,
                driver_version="sim",
                gpu_backend="sim",
                checkpointd_address=checkpointd_address,
                gpus=[
                    common_pb2.GpuInfo(
                        index=i,
                        uuid=f"GPU-{node_id}-{i}",
                        name="Simulated H100",
                        memory_bytes=80 << 30,
                    )
                    for i in range(gpus)
                ],
            ),
            labels=common_pb2.TopologyLabels(zone=zone, block=block, rack=rack),
            requested_role=common_pb2.NODE_ROLE_SPARE if role == "spare" else 0,
            recent_exits=recent_exits,
        )
        self.send(register=register)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        self.responses = stub.Connect(iter(self._outbox.get, None))
        self.registered = next(self.responses).registered

    def send(self, **body: Any) -> None:
        self.seq += 1
        self._outbox.put(agent_pb2.AgentMessage(seq=self.seq, **body))

    def send_raw(self, message: agent_pb2.AgentMessage) -> None:
        self._outbox.put(message)

    def next_command(self, timeout: float = 10.0) -> agent_pb2.SchedulerMessage:
        result: Future[agent_pb2.SchedulerMessage] = Future()

        def pull() -> None:
            try:
                result.set_result(next(self.responses))
            except BaseException as exc:  # handed to the waiting test
                result.set_exception(exc)

        threading.Thread(target=pull, daemon=True).start()
        return result.result(timeout)

    def acked_start(self, timeout: float = 30.0) -> agent_pb2.StartRanks:
        """The next StartRanks the node gets (other commands passed over), acknowledged
        as an agent that started the ranks does."""
        while True:
            message = self.next_command(timeout=timeout)
            if message.WhichOneof("body") == "start_ranks":
                self.send(ack=agent_pb2.CommandAck(command_id=message.command_id, ok=True))
                return message.start_ranks

    def cut(self) -> None:
        """End the stream as a dead agent or a cut network does: the call reset, no end
        of stream sent by the agent, so the scheduler asks the node's host why."""
        self.responses.cancel()
        self._outbox.put(None)

    def close(self) -> None:
        """End the stream as an agent does (its end of stream), and wait for the
        scheduler's end of it."""
        self._outbox.put(None)
        with contextlib.suppress(grpc.RpcError, StopIteration):
            for _ in self.responses:
                pass
