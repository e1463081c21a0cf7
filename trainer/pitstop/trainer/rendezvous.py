"""torchrun's ``--rdzv-backend=pitstop``: rendezvous state held by the pitstop scheduler.

For users who keep torchrun::

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=pitstop \\
        --rdzv-endpoint=scheduler.example:50051 --rdzv-id=$RUN_ID train.py

torch's dynamic rendezvous does the protocol; this module gives it a
:class:`RendezvousBackend` whose compare-and-set lives in the scheduler's
``RendezvousService`` (PostgreSQL rows, so the state survives a scheduler restart), and
the c10d store its agents share. ``--rdzv-conf`` keys:

``token``
    bearer token with the agent role; default ``$PITSTOP_TOKEN`` (prefer the
    variable: a command line is visible to every user of the host).
``tls_dir``
    a node identity (the agent's ``<state_dir>/tls``): mutual TLS with the node's
    certificate to the scheduler's node port, as every node of a secure cluster talks;
    default ``$PITSTOP_TLS_DIR``, which the agent gives the processes it starts. With TLS
    on, the agent role comes only from a node certificate, never from a token.
``ca_cert``
    PEM file that signs the scheduler's certificate (server TLS, with ``token``); without
    it or ``tls_dir`` the channel is plaintext.
``rpc_timeout``
    seconds one call to the scheduler may take, retries on UNAVAILABLE included
    (default 10).
``read_timeout``
    seconds a c10d store operation may wait (default 60, as torch's c10d backend).
``store_connect_timeout``
    seconds to reach the published c10d store before declaring it stale (default 10).

Decisions:

*Keys.* The scheduler keeps each rendezvous' records under ``<run id>`` (torch's state)
and ``<run id>/c10d-store`` (the shared store's address) and refuses any other ``/``, so
a run id with ``/`` is refused here before any call: ``a/c10d-store`` would otherwise
name run ``a``'s store record as its own state.

*Tokens* are opaque strings the scheduler issues, bound to the record they name, passed
through untouched: a token of another run's record is refused by the scheduler
(:class:`RendezvousError`). A token this backend did not issue (not a non-empty ``str``)
can never match, so it is answered with the current state and False without a write.

*Envelope.* The scheduler stores bytes opaquely; this backend wraps torch's bytes in
``b"PSRZ"``, a version byte and a CRC-32 of the payload. Bytes without that header, of
another version or with a wrong checksum raise :class:`RendezvousStateError` before
torch unpickles anything. gRPC carries bytes, so there is no base64 layer.

*The c10d store.* torch's handler needs one store that every agent reaches, before the
first round. The scheduler does not host one; instead the first agent to arrive hosts a
:class:`TCPStore` on a free port of its own address (``--local-addr``, else its FQDN,
as torch's own rank-0 store) and publishes ``host:port`` by compare-and-set under
``<run id>/c10d-store``; later agents connect to it. A published store that cannot be
reached is one left by an earlier run of the same id: the first agent to notice replaces
it with its own, under the stale token, so only one replacement wins. As with torch's
c10d backend the store lives as long as its host's agent; if that node is lost, the job
fails and is restarted under a new run id.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

# Public path; torch's __init__ re-exports these from _C without marking them exported.
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from pitstop.common.tls import TLS_DIR_ENV, NodeIdentity, open_channel
from pitstop.v1 import rendezvous_pb2, rendezvous_pb2_grpc

log = logging.getLogger(__name__)

BACKEND_NAME = "pitstop"
DEFAULT_PORT = 50051  # the scheduler's default port
TOKEN_ENV = "PITSTOP_TOKEN"
RECORD_SEPARATOR = "/"  # the scheduler's: <run id>/<record>
STORE_KEY_SUFFIX = RECORD_SEPARATOR + "c10d-store"
MAX_KEY = 253  # the scheduler's limit on a record key
MAX_RUN_ID = MAX_KEY - len(STORE_KEY_SUFFIX)

_MAGIC = b"PSRZ"
_VERSION = 1
_HEADER = struct.Struct(">4sBI")  # magic, version, CRC-32 of the payload
# Each lost race means another agent just published a store; one more read finds it.
_STORE_ATTEMPTS = 3
_SERVICE = rendezvous_pb2.DESCRIPTOR.services_by_name["RendezvousService"].full_name
# A scheduler restart or failover is seconds of UNAVAILABLE; gRPC retries within the
# call's deadline. A SetState whose answer was lost is retried with the old token and
# answered "not stored" with our own state: torch then re-reads and sees its change.
_RETRY_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": _SERVICE}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def encode_envelope(payload: bytes) -> bytes:
    """``payload`` as this backend stores it: magic, version, CRC-32, payload."""
    return _HEADER.pack(_MAGIC, _VERSION, zlib.crc32(payload)) + payload


def decode_envelope(blob: bytes, key: str) -> bytes:
    """The payload of a stored ``blob``; RendezvousStateError when it is not one this
    backend wrote intact. ``key`` names the record in the message."""
    fix = f"start the job under a new --rdzv-id (the record {key!r} cannot be used)"
    if len(blob) < _HEADER.size:
        raise RendezvousStateError(
            f"rendezvous record {key!r} is {len(blob)} bytes, shorter than the "
            f"{_HEADER.size}-byte pitstop header; {fix}"
        )
    magic, version, checksum = _HEADER.unpack_from(blob)
    if magic != _MAGIC:
        raise RendezvousStateError(
            f"rendezvous record {key!r} starts with {magic!r}, not {_MAGIC!r}: it was not "
            f"written by the pitstop backend; {fix}"
        )
    if version != _VERSION:
        raise RendezvousStateError(
            f"rendezvous record {key!r} has envelope version {version}; this pitstop reads "
            f"version {_VERSION}: run the same pitstop version on every node"
        )
    payload = blob[_HEADER.size :]
    if zlib.crc32(payload) != checksum:
        raise RendezvousStateError(f"rendezvous record {key!r} fails its checksum; {fix}")
    return payload


def check_run_id(run_id: str) -> None:
    """Raise ValueError unless ``run_id`` can name a rendezvous of this backend: the
    scheduler would take ``a/c10d-store`` for run ``a``'s store record. Its length is
    the scheduler's to check."""
    if not run_id:
        raise ValueError("the rendezvous id is empty; give torchrun --rdzv-id")
    if RECORD_SEPARATOR in run_id:
        raise ValueError(
            f"--rdzv-id {run_id!r} contains {RECORD_SEPARATOR!r}, which the pitstop backend "
            "reserves to name a rendezvous' records; use another character, e.g. '-'"
        )


def _stub(channel: grpc.Channel) -> Any:
    # The generated *_pb2_grpc modules carry no types; keep that Any in one place.
    return rendezvous_pb2_grpc.RendezvousServiceStub(channel)


class _Records:
    """Compare-and-set records in the scheduler, keyed by name, payloads enveloped."""

    def __init__(
        self,
        channel: grpc.Channel,
        target: str,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
    ) -> None:
        self._stub = _stub(channel)
        self._target = target
        self._metadata = metadata
        self._timeout = timeout

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(
                request, timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise RendezvousConnectionError(
                    f"cannot reach the pitstop scheduler at {self._target} ({code.name}: "
                    f"{details}); check --rdzv-endpoint and that the scheduler is up"
                ) from exc
            raise RendezvousError(
                f"the pitstop scheduler at {self._target} refused {method} ({code.name}: {details})"
            ) from exc

    def get(self, key: str) -> tuple[bytes, str] | None:
        """The payload stored under ``key`` and its token, or None."""
        response = self._call("GetState", rendezvous_pb2.GetRendezvousStateRequest(run_id=key))
        if not response.found:
            return None
        return decode_envelope(response.state, key), response.token

    def compare_set(
        self, key: str, payload: bytes, token: str | None
    ) -> tuple[bytes, str, bool] | None:
        """Store ``payload`` if ``token`` names the stored version (None: if nothing is
        stored). Returns what is stored afterwards, its token and whether it is ours;
        None when nothing is stored."""
        response = self._call(
            "SetState",
            rendezvous_pb2.SetRendezvousStateRequest(
                run_id=key, state=encode_envelope(payload), token=token or ""
            ),
        )
        if response.stored:
            return payload, response.token, True
        if not response.token:
            return None
        return decode_envelope(response.state, key), response.token, False


class PitstopRendezvousBackend(RendezvousBackend):
    """torch's rendezvous state for one run id, held by the pitstop scheduler at the
    other end of ``channel`` (``target`` names it in errors). Calls send ``token`` as a
    bearer token and each take at most ``rpc_timeout`` seconds."""

    def __init__(
        self,
        run_id: str,
        channel: grpc.Channel,
        *,
        target: str,
        token: str | None = None,
        rpc_timeout: float = 10.0,
    ) -> None:
        check_run_id(run_id)
        self._run_id = run_id
        self._channel = channel
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.records = _Records(channel, target, metadata, rpc_timeout)

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def run_id(self) -> str:
        return self._run_id

    def close(self) -> None:
        """Close the channel to the scheduler."""
        self._channel.close()

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        return self.records.get(self._run_id)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is not None and not (isinstance(token, str) and token):
            # Not a token we issued, so it matches nothing: answer as for a stale one.
            current = self.get_state()
            return None if current is None else (*current, False)
        return self.records.compare_set(self._run_id, state, token)


def _float_param(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--rdzv-conf {key}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"--rdzv-conf {key}={raw!r} must be a positive number of seconds")
    return value


def _channel(target: str, params: RendezvousParameters) -> grpc.Channel:
    options = [("grpc.service_config", _RETRY_CONFIG), ("grpc.enable_retries", 1)]
    tls_dir = params.get("tls_dir") or os.environ.get(TLS_DIR_ENV, "")
    if tls_dir:
        identity = NodeIdentity(Path(tls_dir), "")
        channel: grpc.Channel = open_channel(target, identity, to_scheduler=True, options=options)
        return channel
    ca_cert = params.get("ca_cert")
    if not ca_cert:
        return grpc.insecure_channel(target, options=options)
    with open(ca_cert, "rb") as pem:
        credentials = grpc.ssl_channel_credentials(root_certificates=pem.read())
    return grpc.secure_channel(target, credentials, options=options)


def _parse_store_address(payload: bytes, key: str) -> tuple[str, int]:
    host, _, port = payload.decode("utf-8", errors="replace").rpartition(":")
    if not host or not port.isdigit():
        raise RendezvousStateError(
            f"rendezvous record {key!r} holds {payload!r}, not a host:port; start the job "
            "under a new --rdzv-id"
        )
    return host, int(port)


def _shared_store(
    records: _Records, key: str, local_addr: str, read_timeout: float, connect_timeout: float
) -> TCPStore:
    """Join the c10d store published under ``key``, or host and publish one."""
    for _ in range(_STORE_ATTEMPTS):
        published = records.get(key)
        stale_token: str | None = None
        if published is not None:
            host, port = _parse_store_address(published[0], key)
            try:
                store = TCPStore(
                    host, port, is_master=False, timeout=dt.timedelta(seconds=connect_timeout)
                )
            except (RuntimeError, TimeoutError, ValueError) as exc:
                log.warning(
                    "the c10d store %s:%d published for rendezvous %r is unreachable (%s); "
                    "taking over as its host",
                    host,
                    port,
                    key,
                    exc,
                )
                stale_token = published[1]
            else:
                store.set_timeout(dt.timedelta(seconds=read_timeout))
                return store
        hosted = TCPStore(local_addr, 0, is_master=True, timeout=dt.timedelta(seconds=read_timeout))
        outcome = records.compare_set(key, f"{local_addr}:{hosted.port}".encode(), stale_token)
        if outcome is not None and outcome[2]:
            log.info("this agent hosts the c10d store of %r at %s:%d", key, local_addr, hosted.port)
            return hosted
        # Another agent published first; ours closes when dropped and we join theirs.
    raise RendezvousConnectionError(
        f"no c10d store for {key!r} after {_STORE_ATTEMPTS} attempts: agents keep replacing "
        "each other's; check that every node can reach the others' --local-addr"
    )


def create_backend(params: RendezvousParameters) -> tuple[PitstopRendezvousBackend, Store]:
    """The backend for ``params`` (torchrun's rdzv arguments) and the c10d store its
    agents share, hosted by the first agent to arrive (see the module docstring)."""
    run_id = params.run_id
    check_run_id(run_id)
    if len(run_id) > MAX_RUN_ID:
        raise ValueError(
            f"--rdzv-id {run_id!r} is {len(run_id)} characters; the pitstop backend takes "
            f"at most {MAX_RUN_ID}: use a shorter id"
        )
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    read_timeout = _float_param(params, "read_timeout", 60.0)
    connect_timeout = _float_param(params, "store_connect_timeout", 10.0)
    backend = PitstopRendezvousBackend(
        run_id,
        _channel(target, params),
        target=target,
        token=params.get("token") or os.environ.get(TOKEN_ENV),
        rpc_timeout=_float_param(params, "rpc_timeout", 10.0),
    )
    try:
        store = _shared_store(
            backend.records,
            run_id + STORE_KEY_SUFFIX,
            params.local_addr or socket.getfqdn(),
            read_timeout,
            connect_timeout,
        )
    except BaseException:
        backend.close()
        raise
    return backend, store


def create_pitstop_handler(params: RendezvousParameters) -> RendezvousHandler:
    """A torch dynamic-rendezvous handler over the pitstop backend."""
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def torchrun_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point. torch calls the entry point's object with no
    arguments and registers what it returns as the handler creator, so this is a factory
    of :func:`create_pitstop_handler`, not the creator itself."""
    return create_pitstop_handler
