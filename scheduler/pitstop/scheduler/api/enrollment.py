"""EnrollmentService: a join token for a node certificate, and its renewal."""

from __future__ import annotations

import datetime as dt

import grpc

from pitstop.common.tls import CertificateAuthority, TlsError, cert_pem
from pitstop.scheduler.api.agent import NODE_ID_RE
from pitstop.scheduler.auth import current_caller
from pitstop.scheduler.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from pitstop.scheduler.services import enrollment
from pitstop.scheduler.services import events as event_service
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2


class EnrollmentServicer:
    """Signs nodes' certificate requests with the cluster CA (`ca` None: TLS is off)."""

    def __init__(self, store: Store, ca: CertificateAuthority | None, ttl: dt.timedelta) -> None:
        self.store, self.ca, self.ttl = store, ca, ttl
        self.node_port = 0
        """Where nodes connect with their certificates; set once the port is bound."""

    def _signed(self, csr_pem: str, node_id: str) -> agent_pb2.JoinResponse:
        assert self.ca is not None
        try:
            cert = self.ca.issue_node(csr_pem.encode(), node_id, self.ttl)
        except TlsError as exc:
            raise InvalidArgument("csr_pem", csr_pem[:40], str(exc)) from exc
        return agent_pb2.JoinResponse(
            certificate_pem=cert_pem(cert).decode(),
            ca_certificate_pem=self.ca.pem.decode(),
            node_port=self.node_port,
        )

    def _tls(self) -> CertificateAuthority:
        if self.ca is None:
            raise FailedPrecondition(
                "this scheduler runs without TLS (insecure, as asked): there is nothing to "
                "enroll for; start it with tls enabled, or run the node without a join token"
            )
        return self.ca

    async def Join(  # noqa: N802
        self, request: agent_pb2.JoinRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.JoinResponse:
        self._tls()
        if not NODE_ID_RE.fullmatch(request.node_id):
            raise InvalidArgument(
                "node_id", request.node_id, "use letters, digits, '.', '-' or '_' (a host name)"
            )
        if not request.join_token:
            raise InvalidArgument("join_token", "", "give the token `pitstop token create` made")
        signed = self._signed(request.csr_pem, request.node_id)  # a bad CSR uses no token
        async with self.store.write() as session:
            await enrollment.use_token(session, request.join_token, request.node_id)
            event_service.record_event(
                session,
                "node.enrolled",
                actor=f"node:{request.node_id}",
                node_id=request.node_id,
                reason="certificate issued for a join token",
            )
        return signed

    async def Renew(  # noqa: N802
        self, request: agent_pb2.RenewRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.JoinResponse:
        self._tls()
        caller = current_caller.get()
        if not caller.node_id:
            raise PermissionDenied("Renew needs the node's current certificate (mutual TLS)")
        async with self.store.read() as session:
            await enrollment.check_not_revoked(session, caller.node_id, caller.issued_at)
        return self._signed(request.csr_pem, caller.node_id)
