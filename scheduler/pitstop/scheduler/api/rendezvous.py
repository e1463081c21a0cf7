"""RendezvousService: torchrun's ``--rdzv-backend=pitstop`` keeps its state here."""

from __future__ import annotations

import grpc

from pitstop.scheduler.services import rendezvous as rendezvous_service
from pitstop.scheduler.store import Store
from pitstop.v1 import rendezvous_pb2


class RendezvousServicer:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def GetState(  # noqa: N802 (gRPC method names)
        self, request: rendezvous_pb2.GetRendezvousStateRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.GetRendezvousStateResponse:
        async with self.store.read() as session:
            current = await rendezvous_service.get_state(session, request.run_id)
        if current is None:
            return rendezvous_pb2.GetRendezvousStateResponse(found=False)
        return rendezvous_pb2.GetRendezvousStateResponse(
            found=True, state=current.state, token=current.token
        )

    async def SetState(  # noqa: N802
        self, request: rendezvous_pb2.SetRendezvousStateRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.SetRendezvousStateResponse:
        async with self.store.write() as session:
            outcome = await rendezvous_service.set_state(
                session, request.run_id, request.state, request.token
            )
        current = outcome.current
        if current is None:
            # Nothing stored and nothing set: an empty token, the proto's "none seen".
            return rendezvous_pb2.SetRendezvousStateResponse(stored=False)
        return rendezvous_pb2.SetRendezvousStateResponse(
            state=current.state, token=current.token, stored=outcome.stored
        )
