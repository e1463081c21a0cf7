"""One probe of the checkpoint daemon: grpc.health.v1.Health/Check with a short deadline.

SERVING is an answer, and so is UNIMPLEMENTED: the daemon's gRPC server answered, it
only serves no health service. A dead daemon gives UNAVAILABLE, a hung one
DEADLINE_EXCEEDED."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pitstop.common.tls import NodeIdentity, open_channel

PROBE_DEADLINE_SECONDS = 0.5


class HealthProbe:
    """Probes the daemon at `address` (with the node's `token` and TLS `identity`)."""

    def __init__(self, address: str, token: str, identity: NodeIdentity | None) -> None:
        self.address = address
        self._identity = identity
        self._deadline = PROBE_DEADLINE_SECONDS
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel: Any = None

    async def probe(self) -> tuple[str | None, bool]:
        """(None when the daemon answered, else why not in words; whether nothing could
        be reached at the address at all, so that a daemon may be started there)."""
        if self._channel is None:
            self._channel = open_channel(self.address, self._identity, aio=True)
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(), timeout=self._deadline, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None, False  # its server answered; it serves no health service
            why = self._describe(exc)
            unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE
        else:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return None, False
            why = f"it reports {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            unreachable = False
        # The next probe gets a fresh channel: it connects at once instead of waiting out
        # the old channel's reconnect backoff, so a daemon that is back is seen at once.
        await self.close()
        return why, unreachable

    def _describe(self, exc: grpc.aio.AioRpcError) -> str:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {self._deadline:g} s"
        # "failed to connect to all addresses; ...: Connection refused" -> the last part.
        detail = (exc.details() or "").rsplit(": ", 1)[-1]
        return f"{code.name}: {detail}" if detail else str(code.name)

    async def close(self) -> None:
        """Close the channel; the next probe opens a fresh one."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()
