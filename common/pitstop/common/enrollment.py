"""A node's enrollment: trade a one-time join token for a certificate, and renew it.

Whichever of a node's daemons starts first with the join token (the checkpoint daemon
or the agent, sharing one identity directory) makes the key pair there, sends a
certificate request and the token to the scheduler's EnrollmentService over TLS
(checking the scheduler against the cluster CA certificate it was given) and keeps the
certificate that comes back; the other finds the node enrolled. The private key never
leaves the node. Renewal is authenticated by the certificate the node still holds.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from pitstop.common.tls import NodeIdentity, TlsError, channel_options, open_channel
from pitstop.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)


class EnrollmentError(RuntimeError):
    """The node cannot get a certificate; the message says what to do."""


def enroll(identity: NodeIdentity, scheduler: str, join_token: str, ca_file: Path) -> None:
    """Trade `join_token` for a certificate, unless the node already holds a valid one."""
    if identity.enrolled:
        return
    if not join_token:
        raise EnrollmentError(
            f"node {identity.node_id} has no certificate in {identity.directory}: give a join "
            "token (--join-token, or PITSTOP_AGENT_JOIN_TOKEN / PITSTOP_CHECKPOINTD_JOIN_TOKEN; "
            "an admin makes one with `pitstop token create --node-id ...`)"
        )
    try:
        ca = ca_file.read_bytes()
    except OSError as exc:
        raise EnrollmentError(
            f"ca_file {ca_file}: {exc.strerror}; copy the scheduler's tls/ca.crt here"
        ) from exc
    identity.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    request = agent_pb2.JoinRequest(
        join_token=join_token, node_id=identity.node_id, csr_pem=identity.request().decode()
    )
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(scheduler, credentials, options=channel_options()) as channel:
        try:
            answer = agent_pb2_grpc.EnrollmentServiceStub(channel).Join(request, timeout=30)
        except grpc.RpcError as exc:
            raise EnrollmentError(
                f"enrollment of node {identity.node_id} at {scheduler} refused: "
                f"{exc.code().name} {exc.details()}"
            ) from exc
    _keep(identity, answer)
    log.info("node %s enrolled: certificate in %s", identity.node_id, identity.cert_path)


async def renew(identity: NodeIdentity, scheduler: str) -> None:
    """A new key and certificate now, authenticated by the current certificate."""
    request = agent_pb2.RenewRequest(csr_pem=identity.request().decode())
    async with open_channel(scheduler, identity, to_scheduler=True, aio=True) as channel:
        answer = await agent_pb2_grpc.EnrollmentServiceStub(channel).Renew(request, timeout=30)
    _keep(identity, answer)
    log.info(
        "node %s: certificate renewed, valid until %s",
        identity.node_id,
        identity.certificate().not_valid_after_utc,
    )


def _keep(identity: NodeIdentity, answer: agent_pb2.JoinResponse) -> None:
    try:
        identity.store(
            answer.certificate_pem.encode(), answer.ca_certificate_pem.encode(), answer.node_port
        )
    except (TlsError, ValueError) as exc:
        raise EnrollmentError(f"the scheduler's certificate cannot be used: {exc}") from exc
