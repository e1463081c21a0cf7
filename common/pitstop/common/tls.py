"""The cluster's certificates: a CA the scheduler keeps, node identities the nodes keep.

Every daemon that talks over the network does so over TLS with certificates of one
cluster CA. The scheduler holds the CA (`CertificateAuthority`, `ca.key` never leaves
its state directory) and its own server certificate, named `SCHEDULER_NAME` whatever
address it listens on: clients check that name (`grpc.ssl_target_name_override`), so a
scheduler moves hosts without new certificates, and no node certificate carries it. A
node generates its key pair itself (`NodeIdentity`, `node.key` mode 0600, never sent),
sends a certificate signing request with a one-time join token, and gets back a
short-lived certificate whose common name is its node id; the scheduler tells callers
apart by it. The node renews it, authenticated by the certificate it still holds,
before it expires.

Keys are ECDSA P-256; everything is PEM. The `cryptography` package does all of it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: a rank or a CLI that only opens channels loads
    # no X.509 code (cryptography's import costs a quarter of a second)
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

SCHEDULER_NAME = "pitstop-scheduler"
"""The DNS name in the scheduler's certificate, checked by every client of it."""
PEER_NAME = "pitstop-node"
"""A DNS name every node certificate carries: what a node's checkpoint daemon is checked
for by its clients (its buddies, its ranks), whatever its address."""
TLS_DIR_ENV = "PITSTOP_TLS_DIR"
"""The node identity directory a rank (or a daemon beside the agent) uses, when set."""
CA_NAME = "pitstop cluster CA"
NODE_TTL = datetime.timedelta(hours=24)
"""How long a node certificate lasts by default; nodes renew at two thirds of it."""
RENEW_AT = 2 / 3
_SKEW = datetime.timedelta(minutes=5)  # clocks of different machines differ a little


class TlsError(ValueError):
    """A certificate, key or request that cannot be used; the message says why."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by this user only, atomically (never a half-written key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(partial, path)


def load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TlsError(f"{path} is not an EC private key")
    return key


def certificate_request(key: ec.EllipticCurvePrivateKey, node_id: str) -> bytes:
    """A PEM certificate signing request for `node_id`'s key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def common_name(cert: x509.Certificate) -> str:
    from cryptography.x509.oid import NameOID

    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _serial(now: datetime.datetime) -> int:
    """A serial number that carries its issue time to the microsecond (the high bits)
    above 64 random bits: X.509's validity times have whole seconds only, too coarse to
    tell a certificate revoked in one second from one issued again in the same second."""
    return (int(now.timestamp() * 1_000_000) << 64) | secrets.randbits(64)


def issued_at(cert: x509.Certificate) -> datetime.datetime:
    """When `cert` was issued, to the microsecond (from its serial; for a certificate
    not made here, its validity start less the allowance for clock skew)."""
    micros = cert.serial_number >> 64
    if micros:
        return datetime.datetime.fromtimestamp(micros / 1_000_000, datetime.UTC)
    return cert.not_valid_before_utc + _SKEW


def _builder(
    subject: str, public_key: ec.EllipticCurvePublicKey, issuer: x509.Name, ttl: datetime.timedelta
) -> x509.CertificateBuilder:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(_serial(now))
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + ttl)
    )


@dataclass
class CertificateAuthority:
    """The cluster CA, kept as `ca.key` (0600) and `ca.crt` in `directory`."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def load_or_create(cls, directory: Path) -> CertificateAuthority:
        """The CA in `directory`, created there (valid ten years) when there is none."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import NameOID

        key_path, cert_path = directory / "ca.key", directory / "ca.crt"
        if key_path.exists() and cert_path.exists():
            return cls(load_key(key_path), x509.load_pem_x509_certificate(cert_path.read_bytes()))
        if key_path.exists() or cert_path.exists():
            raise TlsError(
                f"{directory} holds only one of ca.key and ca.crt: restore the other (every "
                "node's certificate depends on them), or remove both to start a new CA and "
                "enroll every node again"
            )
        key = new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        cert = (
            _builder(CA_NAME, key.public_key(), name, datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        write_private(key_path, key_pem(key))
        cert_path.write_bytes(cert_pem(cert))
        return cls(key, cert)

    @property
    def pem(self) -> bytes:
        return cert_pem(self.cert)

    def issue_node(
        self, csr_pem: bytes, node_id: str, ttl: datetime.timedelta = NODE_TTL
    ) -> x509.Certificate:
        """A certificate for the key in `csr_pem`, named `node_id` (whatever the request
        says: the token, not the request, decides the name); for client and server use
        (a node's checkpoint daemon serves its buddies), DNS name `node_id`."""
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise TlsError(f"csr_pem is not a PEM certificate signing request: {exc}") from exc
        if not csr.is_signature_valid:
            raise TlsError("csr_pem's signature does not match its key")
        public_key = csr.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey):
            raise TlsError("csr_pem must be for an EC (P-256) key")
        return self._sign(
            node_id, public_key, ttl, [x509.DNSName(node_id), x509.DNSName(PEER_NAME)]
        )

    def issue_server(
        self, key: ec.EllipticCurvePrivateKey, hosts: list[str], ttl: datetime.timedelta
    ) -> x509.Certificate:
        """The scheduler's certificate: `SCHEDULER_NAME` and `hosts` (names or IPs)."""
        from cryptography import x509

        names: list[x509.GeneralName] = [x509.DNSName(SCHEDULER_NAME)]
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        return self._sign(SCHEDULER_NAME, key.public_key(), ttl, names)

    def _sign(
        self,
        subject: str,
        public_key: ec.EllipticCurvePublicKey,
        ttl: datetime.timedelta,
        names: list[x509.GeneralName],
    ) -> x509.Certificate:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID

        return (
            _builder(subject, public_key, self.cert.subject, ttl)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )


@dataclass
class NodeIdentity:
    """A node's key, certificate and the cluster CA, as files in `directory`:
    `node.key` (0600, made here), `node.crt`, `ca.crt`."""

    directory: Path
    node_id: str

    @property
    def key_path(self) -> Path:
        return self.directory / "node.key"

    @property
    def cert_path(self) -> Path:
        return self.directory / "node.crt"

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def enrolled(self) -> bool:
        """A key and a certificate for this node id that has not expired."""
        if not (self.key_path.exists() and self.cert_path.exists() and self.ca_path.exists()):
            return False
        cert = self.certificate()
        return common_name(cert) == self.node_id and cert.not_valid_after_utc > _now()

    def certificate(self) -> x509.Certificate:
        from cryptography import x509

        return x509.load_pem_x509_certificate(self.cert_path.read_bytes())

    def request(self) -> bytes:
        """A CSR for a fresh key (kept as `node.key.next` until its certificate comes)."""
        key = new_key()
        write_private(self.directory / "node.key.next", key_pem(key))
        return certificate_request(key, self.node_id)

    @property
    def port_path(self) -> Path:
        return self.directory / "node_port"

    def node_address(self, scheduler: str) -> str:
        """Where this node reaches the scheduler with its certificate: the host it
        enrolled at, on the node port the scheduler named (`scheduler` as it is when
        none was named)."""
        try:
            port = int(self.port_path.read_text())
        except (OSError, ValueError):
            return scheduler
        host = scheduler.rpartition(":")[0]
        return f"{host}:{port}" if host and port else scheduler

    def store(self, certificate: bytes, ca: bytes, node_port: int = 0) -> None:
        """Keep the certificate that answered `request()`: the pending key becomes the key.
        `node_port`: where the scheduler takes nodes' certificates (0: not said)."""
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(certificate)
        pending = self.directory / "node.key.next"
        key = load_key(pending)
        if cert.public_key() != key.public_key():
            raise TlsError("the certificate returned is not for the key this node made")
        if common_name(cert) != self.node_id:
            raise TlsError(f"the certificate returned names {common_name(cert)!r}, not this node")
        self.ca_path.write_bytes(ca)
        if node_port:
            self.port_path.write_text(str(node_port))
        write_private(self.cert_path.with_suffix(".crt.partial"), certificate)
        os.replace(pending, self.key_path)
        os.replace(self.cert_path.with_suffix(".crt.partial"), self.cert_path)

    def renew_due(self, now: datetime.datetime | None = None) -> bool:
        """Two thirds of the certificate's life are over."""
        cert = self.certificate()
        start, end = cert.not_valid_before_utc + _SKEW, cert.not_valid_after_utc
        return (now or _now()) >= start + (end - start) * RENEW_AT

    def seconds_to_renewal(self) -> float:
        cert = self.certificate()
        start, end = cert.not_valid_before_utc + _SKEW, cert.not_valid_after_utc
        return max(0.0, (start + (end - start) * RENEW_AT - _now()).total_seconds())

    def files(self) -> tuple[bytes, bytes, bytes]:
        """(CA certificate, private key, certificate chain) as gRPC's credentials take them."""
        return self.ca_path.read_bytes(), self.key_path.read_bytes(), self.cert_path.read_bytes()


def channel_options(target_name: str = SCHEDULER_NAME) -> list[tuple[str, str]]:
    """Options for a TLS channel that checks the peer's certificate names `target_name`."""
    return [("grpc.ssl_target_name_override", target_name)]


def identity_from_env(env: Mapping[str, str] | None = None) -> NodeIdentity | None:
    """The node identity named by PITSTOP_TLS_DIR (a rank's, set by its agent), if any."""
    directory = (os.environ if env is None else env).get(TLS_DIR_ENV, "")
    return NodeIdentity(Path(directory), "") if directory else None


def node_credentials(identity: NodeIdentity) -> Any:
    """gRPC channel credentials presenting the node's certificate (read now: a renewal
    takes effect on the next channel)."""
    import grpc

    ca, key, cert = identity.files()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def open_channel(
    target: str,
    identity: NodeIdentity | None,
    *,
    to_scheduler: bool = False,
    aio: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> Any:
    """A channel from a node: plaintext without `identity`; with it, mutual TLS
    presenting the node's certificate, to the scheduler's node port (`to_scheduler`:
    `target` is its address as configured) or to a node's checkpoint daemon."""
    import grpc

    if identity is None:
        opened = grpc.aio.insecure_channel if aio else grpc.insecure_channel
        return opened(target, options=list(options) or None)
    if to_scheduler:
        target = identity.node_address(target)
    name = SCHEDULER_NAME if to_scheduler else PEER_NAME
    secure = grpc.aio.secure_channel if aio else grpc.secure_channel
    return secure(target, node_credentials(identity), options=[*options, *channel_options(name)])


def node_server_credentials(identity: NodeIdentity) -> Any:
    """Server credentials for a node's daemon: its certificate, and a client certificate
    of the cluster CA required. Re-read when the certificate file changes (a renewal),
    so the daemon never serves an expired one."""
    import grpc

    def current() -> Any:
        ca, key, cert = identity.files()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    seen = [identity.cert_path.stat().st_mtime_ns]

    def fetch() -> Any:
        mtime = identity.cert_path.stat().st_mtime_ns
        if mtime == seen[0]:
            return None  # unchanged
        seen[0] = mtime
        return current()

    return grpc.dynamic_ssl_server_credentials(current(), fetch, require_client_authentication=True)
