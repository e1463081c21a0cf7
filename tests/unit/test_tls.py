"""The cluster CA and node identities as files: what a node and the scheduler keep."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from pitstop.common.tls import (
    CertificateAuthority,
    NodeIdentity,
    TlsError,
    cert_pem,
    common_name,
    issued_at,
)


def test_a_node_keeps_its_own_key_and_the_certificate_names_it(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    node = NodeIdentity(tmp_path / "node", "gpu-7")
    assert not node.enrolled
    # The request says "gpu-7"; the CA names whom the token was for, whatever it says.
    cert = ca.issue_node(node.request(), "gpu-7")
    node.store(_pem(cert), ca.pem, node_port=50052)
    assert node.enrolled
    assert common_name(node.certificate()) == "gpu-7"
    assert node.node_address("sched.example:50051") == "sched.example:50052"
    assert not node.renew_due()
    assert node.renew_due(dt.datetime.now(dt.UTC) + dt.timedelta(hours=17))
    # A renewal answered with a certificate for another key is not kept; the old one stays.
    node.request()
    theirs = ca.issue_node(NodeIdentity(tmp_path / "other", "gpu-8").request(), "gpu-7")
    with pytest.raises(TlsError, match="not for the key this node made"):
        node.store(_pem(theirs), ca.pem)
    assert node.certificate() == cert


def test_issue_times_tell_apart_certificates_of_one_second(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path)
    before = dt.datetime.now(dt.UTC)
    first = ca.issue_node(NodeIdentity(tmp_path / "a", "n").request(), "n")
    second = ca.issue_node(NodeIdentity(tmp_path / "b", "n").request(), "n")
    assert before <= issued_at(first) < issued_at(second) <= dt.datetime.now(dt.UTC)


def test_a_half_missing_ca_is_refused_not_replaced(tmp_path: Path) -> None:
    CertificateAuthority.load_or_create(tmp_path)
    (tmp_path / "ca.crt").unlink()
    with pytest.raises(TlsError, match=r"only one of ca\.key and ca\.crt"):
        CertificateAuthority.load_or_create(tmp_path)
    with pytest.raises(TlsError, match="csr_pem is not a PEM"):
        CertificateAuthority.load_or_create(tmp_path / "new").issue_node(b"junk", "n")


def _pem(cert: x509.Certificate) -> bytes:
    return cert_pem(cert)
