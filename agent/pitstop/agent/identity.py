"""The node's identity for mutual TLS: enroll once with a join token, renew in place.

With `tls` on, the agent keeps its key and certificate in `<state_dir>/tls`
(`pitstop.common.tls.NodeIdentity`). At start, without a valid certificate, it makes a key
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

from pitstop.common.enrollment import EnrollmentError, enroll, renew
from pitstop.common.tls import NodeIdentity

__all__ = ["EnrollmentError", "enroll", "identity_for", "keep_renewed", "renew"]

log = logging.getLogger(__name__)

RETRY_SECONDS = 30.0
"""Wait after a failed renewal before trying again (the old certificate still works)."""


def identity_for(state_dir: Path, node_id: str) -> NodeIdentity:
    return NodeIdentity(state_dir / "tls", node_id)


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
