"""Mutual TLS and enrollment against a real scheduler process with TLS on.

A node gets a certificate only for a valid one-time join token; the scheduler then knows
the caller by its certificate and lets it act only as itself. People's clients use
server TLS and bearer tokens; no token makes a caller an agent.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
from cryptography import x509
from google.protobuf import timestamp_pb2

from kit.events import follow_events, wait_for
from kit.schedulers import SchedulerProcess, tls_scheduler
from kit.stores import StoreUrls, unique
from pitstop.agent.identity import EnrollmentError, enroll, identity_for
from pitstop.client.client import PitstopClient
from pitstop.client.errors import PitstopError
from pitstop.client.launch import agent_command, clean_env
from pitstop.common.tls import channel_options, common_name, load_key, node_credentials
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2, jobs_pb2, jobs_pb2_grpc

ADMIN = "admin-token-0123456789"
VIEWER = "viewer-token-0123456789"


@pytest.fixture(scope="module")
def secure(
    stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SchedulerProcess]:
    admin_hash = hashlib.sha256(ADMIN.encode()).hexdigest()
    scheduler = tls_scheduler(
        stores,
        tmp_path_factory.mktemp("tls"),
        [
            {"sha256": admin_hash, "role": "admin", "name": "ops"},
            {"token": VIEWER, "role": "viewer", "name": "watcher"},
        ],
    )
    try:
        yield scheduler
    finally:
        scheduler.stop()


def ca_file(scheduler: SchedulerProcess) -> Path:
    assert scheduler.ca is not None
    return scheduler.ca


def admin(scheduler: SchedulerProcess, token: str = ADMIN) -> PitstopClient:
    ca = ca_file(scheduler).read_bytes()
    return PitstopClient(
        scheduler.address, token, credentials=grpc.ssl_channel_credentials(root_certificates=ca)
    )


def register(node_id: str) -> agent_pb2.AgentMessage:
    started = timestamp_pb2.Timestamp()
    started.GetCurrentTime()
    return agent_pb2.AgentMessage(
        seq=1,
        register=agent_pb2.Register(
            node_id=node_id,
            inventory=common_pb2.Inventory(gpus=[common_pb2.GpuInfo(index=0, uuid=f"G-{node_id}")]),
            agent_started_at=started,
        ),
    )


def connect(channel: grpc.Channel, node_id: str) -> agent_pb2.SchedulerMessage:
    """Register as `node_id` on a fresh agent stream; the scheduler's first answer."""
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    return next(stub.Connect(iter([register(node_id)]), timeout=10))


def node_channel(scheduler: SchedulerProcess, root: Path, node_id: str) -> grpc.Channel:
    """A channel presenting `node_id`'s certificate, enrolled with a fresh token."""
    with admin(scheduler) as client:
        token = client.create_join_token(600, node_id).token
    identity = identity_for(root / node_id, node_id)
    enroll(identity, scheduler.address, token, ca_file(scheduler))
    assert identity.node_address(scheduler.address) == scheduler.node_address
    return grpc.secure_channel(
        scheduler.node_address, node_credentials(identity), options=channel_options()
    )


@pytest.mark.parametrize("port", ["api", "nodes"])
def test_a_plaintext_client_gets_only_a_handshake_failure(
    secure: SchedulerProcess, port: str
) -> None:
    address = secure.address if port == "api" else secure.node_address
    with grpc.insecure_channel(address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.List(jobs_pb2.ListJobsRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_node_port_takes_no_client_without_a_certificate(secure: SchedulerProcess) -> None:
    tls = grpc.ssl_channel_credentials(root_certificates=ca_file(secure).read_bytes())
    channel = grpc.secure_channel(secure.node_address, tls, options=channel_options())
    with channel, pytest.raises(grpc.RpcError) as refused:
        connect(channel, "nocert")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed


def test_a_node_without_a_certificate_cannot_connect_even_with_an_admin_token(
    secure: SchedulerProcess,
) -> None:
    ca = ca_file(secure).read_bytes()
    tls = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(secure.address, tls, options=channel_options()) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        calls = stub.Connect(
            iter([register("nocert")]), metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=10
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(calls)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs role agent" in refused.value.details()


def test_a_join_token_enrolls_one_node_once(secure: SchedulerProcess, tmp_path: Path) -> None:
    node_id = unique("enr")
    with admin(secure) as client:
        made = client.create_join_token(600, "")
    assert made.token.startswith("pst_join_")
    first = identity_for(tmp_path / "a", node_id)
    enroll(first, secure.address, made.token, ca_file(secure))
    cert = first.certificate()
    assert common_name(cert) == node_id
    assert cert.not_valid_after_utc - dt.datetime.now(dt.UTC) <= dt.timedelta(hours=24)
    assert (first.key_path.stat().st_mode & 0o777) == 0o600
    # The private key never left the node: the certificate is for the key made there.
    assert cert.public_key() == load_key(first.key_path).public_key()
    with pytest.raises(EnrollmentError, match="already used"):
        enroll(
            identity_for(tmp_path / "b", unique("enr")), secure.address, made.token, ca_file(secure)
        )
    # Only the hash is stored.
    digest = hashlib.sha256(made.token.encode()).hexdigest()
    with psycopg.connect(secure.env["PITSTOP_DATABASE_URL"]) as db:
        rows = db.execute("select digest, used_by from join_tokens").fetchall()
    assert (digest, node_id) in rows
    assert all(made.token not in str(row) for row in rows)


def test_an_expired_or_another_nodes_token_is_refused(
    secure: SchedulerProcess, tmp_path: Path
) -> None:
    with admin(secure) as client:
        expired = client.create_join_token(600, "").token
        theirs = client.create_join_token(600, "node-b").token
    with psycopg.connect(secure.env["PITSTOP_DATABASE_URL"]) as db:
        db.execute(
            "update join_tokens set expires_at = now() - interval '1 minute' where digest = %s",
            (hashlib.sha256(expired.encode()).hexdigest(),),
        )
    with pytest.raises(EnrollmentError, match="expired at"):
        enroll(identity_for(tmp_path / "x", "node-x"), secure.address, expired, ca_file(secure))
    with pytest.raises(EnrollmentError, match="is for node 'node-b', not 'node-a'"):
        enroll(identity_for(tmp_path / "a", "node-a"), secure.address, theirs, ca_file(secure))
    # Refused, the token is still good for its own node.
    enroll(identity_for(tmp_path / "b", "node-b"), secure.address, theirs, ca_file(secure))


def test_a_node_certificate_acts_only_as_its_node(secure: SchedulerProcess, tmp_path: Path) -> None:
    one, two = unique("n1"), unique("n2")
    with node_channel(secure, tmp_path, one) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            connect(channel, two)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"certificate names node '{one}'" in refused.value.details()
        assert connect(channel, one).registered.node_id == one
        # A node certificate is no person's: it cannot list jobs.
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            jobs.List(jobs_pb2.ListJobsRequest(), timeout=10)
        assert denied.value.code() in (
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED,
        )


def test_a_node_renews_its_certificate_with_the_one_it_holds(
    secure: SchedulerProcess, tmp_path: Path
) -> None:
    import asyncio

    from pitstop.agent.identity import renew

    node_id = unique("renew")
    node_channel(secure, tmp_path, node_id).close()
    identity = identity_for(tmp_path / node_id, node_id)
    before = identity.certificate()
    asyncio.run(renew(identity, secure.address))
    after = identity.certificate()
    assert common_name(after) == node_id
    assert after.serial_number != before.serial_number
    assert after.public_key() != before.public_key()  # a fresh key as well
    node = secure.node_address
    with grpc.secure_channel(node, node_credentials(identity), options=channel_options()) as c:
        assert connect(c, node_id).registered.node_id == node_id


def test_the_agent_daemon_enrolls_with_a_token_and_registers(
    secure: SchedulerProcess, tmp_path: Path
) -> None:
    node_id = unique("agent")
    with admin(secure) as client:
        token = client.create_join_token(600, node_id).token
    events = follow_events(secure.address, ca=ca_file(secure), token=VIEWER)
    env = clean_env()
    agent = subprocess.Popen(
        agent_command(
            fork_server="off",  # fake ranks or none: no zygote to import torch
            node_id=node_id,
            scheduler=secure.address,
            gpus="sim:1",
            state_dir=tmp_path / "agent",
            metrics_port=0,
            tls=True,
            ca_file=ca_file(secure),
            extra=["--join-token", token],
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        registered = wait_for(
            events, lambda e: e.kind == "node.registered" and e.node_id == node_id
        )
        assert registered.node_id == node_id
        cert = x509.load_pem_x509_certificate(
            (tmp_path / "agent" / "tls" / "node.crt").read_bytes()
        )
        assert common_name(cert) == node_id
    finally:
        agent.terminate()
        agent.wait(30)


def test_a_revoked_node_is_cut_off_at_once_and_rejoins_only_with_a_new_token(
    secure: SchedulerProcess, tmp_path: Path
) -> None:
    node_id = unique("rev")
    hang_up = threading.Event()

    def messages() -> Iterator[agent_pb2.AgentMessage]:
        yield register(node_id)
        hang_up.wait(60)  # the agent side stays open; the scheduler must end the stream

    channel = node_channel(secure, tmp_path, node_id)
    try:
        stream = agent_pb2_grpc.AgentServiceStub(channel).Connect(messages(), timeout=60)
        assert next(stream).registered.node_id == node_id
        with admin(secure) as client:
            revoked = client.revoke_node(node_id, "lost laptop")
            assert revoked.state == common_pb2.NODE_STATE_CORDONED
            # The revocation ends the stream (its own 60 s deadline only guards a hang).
            ended: grpc.StatusCode | None = None
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as err:
                ended = err.code()
            assert ended != grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.RpcError) as refused:
                connect(channel, node_id)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "revoked" in refused.value.details()
            events = client.list_events(node_id=node_id)
        assert [e.actor for e in events if e.kind == "node.revoked"] == ["token:ops"]
    finally:
        hang_up.set()
        channel.close()
    # A new token, a new certificate: the node is back (still cordoned until uncordoned).
    again = node_channel(secure, tmp_path / "again", node_id)
    with again:
        assert connect(again, node_id).registered.state == common_pb2.NODE_STATE_CORDONED


def test_a_viewer_cannot_cancel_and_every_event_names_its_actor(secure: SchedulerProcess) -> None:
    with admin(secure, VIEWER) as viewer, pytest.raises(PitstopError) as refused:
        viewer.cancel_job("job-of-anyone", "curious")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "needs role operator" in refused.value.details
    with admin(secure) as client:
        client.create_join_token(60, "")
        events = client.list_events(after_event_id=-1, limit=1000)
    assert any(e.actor == "token:ops" and e.kind == "token.created" for e in events)
    assert [e for e in events if not e.actor or e.actor == "user:anonymous"] == []
