"""The node's identity for mutual TLS: enroll once with a join token, renew in place.

With `tls` on, the agent keeps its key and certificate in `<state_dir>/tls`
(`pitstop.tls.NodeIdentity`). At start, without a valid certificate, it makes a key
pair here, sends a certificate request and the join token to the scheduler's
EnrollmentService (over TLS, checking the scheduler against the cluster CA certificate
it was given: `ca_file`), and keeps the certificate that comes back. Every channel to
the scheduler then presents that certificate. A background task renews it at two
thirds of its life, authenticated by the certificate itself: the open stream keeps
going, new connections use the new certificate; no restart.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from pitstop.tls import NodeIdentity, TlsError, channel_options, open_channel
from pitstop.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

RETRY_SECONDS = 30.0
"""Wait after a failed renewal before trying again (the old certificate still works)."""


class EnrollmentError(RuntimeError):
    """The node cannot get a certificate; the message says what to do."""


def identity_for(state_dir: Path, node_id: str) -> NodeIdentity:
    return NodeIdentity(state_dir / "tls", node_id)


def enroll(identity: NodeIdentity, scheduler: str, join_token: str, ca_file: Path) -> None:
    """Trade `join_token` for a certificate, unless the node already holds a valid one."""
    if identity.enrolled:
        return
    if not join_token:
        raise EnrollmentError(
            f"node {identity.node_id} has no certificate in {identity.directory}: give a join "
            "token (--join-token or PITSTOP_AGENT_JOIN_TOKEN; an admin makes one with "
            "`pitstop token create --node-id ...`)"
        )
    try:
        ca = ca_file.read_bytes()
    except OSError as exc:
        raise EnrollmentError(
            f"ca_file {ca_file}: {exc.strerror}; copy the scheduler's tls/ca.crt here"
        ) from exc
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


def _keep(identity: NodeIdentity, answer: agent_pb2.JoinResponse) -> None:
    try:
        identity.store(
            answer.certificate_pem.encode(), answer.ca_certificate_pem.encode(), answer.node_port
        )
    except (TlsError, ValueError) as exc:
        raise EnrollmentError(f"the scheduler's certificate cannot be used: {exc}") from exc


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


async def keep_renewed(identity: NodeIdentity, scheduler: str, stop: asyncio.Event) -> None:
    """Renew the certificate whenever two thirds of its life are over, until `stop`."""
    while not stop.is_set():
        wait = identity.seconds_to_renewal()
        if wait > 0:
            try:
                await asyncio.wait_for(stop.wait(), timeout=wait)
                return
            except TimeoutError:
                pass
        try:
            await renew(identity, scheduler)
        except (grpc.RpcError, EnrollmentError, OSError) as exc:
            said = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.RpcError) else exc
            log.error(
                "node %s: certificate renewal failed (%s); retrying in %.0fs",
                identity.node_id,
                said,
                RETRY_SECONDS,
            )
            try:
                await asyncio.wait_for(stop.wait(), timeout=RETRY_SECONDS)
                return
            except TimeoutError:
                pass
