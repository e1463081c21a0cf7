"""Every RPC declares a role; domain errors and store outages map to the right codes."""

from __future__ import annotations

import errno
import hashlib

import grpc
import psycopg
import pytest
import sqlalchemy.exc
from google.protobuf import descriptor_pool
from redis.exceptions import ConnectionError as RedisConnectionError

from pitstop.scheduler import errors
from pitstop.scheduler.auth import Caller, TokenBook, authorize, required_role
from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.domain import Role
from pitstop.scheduler.interceptors import status_for
from pitstop.v1 import (
    agent_pb2,
    checkpoint_pb2,
    jobs_pb2,
    nodes_pb2,
    rank_pb2,
    rendezvous_pb2,
)

FILES = (agent_pb2, checkpoint_pb2, jobs_pb2, nodes_pb2, rank_pb2, rendezvous_pb2)


def all_methods() -> list[str]:
    names = []
    for module in FILES:
        for service in module.DESCRIPTOR.services_by_name.values():
            names.extend(f"/{service.full_name}/{m.name}" for m in service.methods)
    return names


def test_the_api_has_every_service_of_the_design() -> None:
    services = {m.split("/")[1] for m in all_methods()}
    assert services == {
        "pitstop.v1.JobService",
        "pitstop.v1.ProjectService",
        "pitstop.v1.NodeService",
        "pitstop.v1.EventService",
        "pitstop.v1.TokenService",
        "pitstop.v1.AgentService",
        "pitstop.v1.EnrollmentService",
        "pitstop.v1.CheckpointService",
        "pitstop.v1.CheckpointCatalogService",
        "pitstop.v1.RankControl",
        "pitstop.v1.RendezvousService",
    }


@pytest.mark.parametrize("method", all_methods())
def test_every_rpc_declares_a_role(method: str) -> None:
    assert required_role(method) not in (None, Role.UNSPECIFIED)


def test_non_pitstop_services_are_public_and_unknown_pitstop_methods_are_refused() -> None:
    assert required_role("/grpc.health.v1.Health/Check") is None
    assert required_role("/pitstop.v1.JobService/Nope") is Role.UNSPECIFIED
    assert descriptor_pool.Default().FindServiceByName("pitstop.v1.JobService")


def test_roles_nest_for_people_but_not_for_agents() -> None:
    book = TokenBook(
        [
            ApiToken(token="v" * 20, role=Role.VIEWER, name="ro"),
            ApiToken(token="o" * 20, role=Role.OPERATOR, name="ops"),
            ApiToken(token="a" * 20, role=Role.ADMIN, name="root"),
        ]
    )
    viewer = book.caller_for([("authorization", "Bearer " + "v" * 20)])
    admin = book.caller_for([("authorization", "Bearer " + "a" * 20)])
    authorize(viewer, "/pitstop.v1.JobService/Get", Role.VIEWER)
    with pytest.raises(errors.PermissionDenied, match="needs role operator"):
        authorize(viewer, "/pitstop.v1.JobService/Submit", Role.OPERATOR)
    authorize(admin, "/pitstop.v1.JobService/Submit", Role.OPERATOR)
    with pytest.raises(errors.PermissionDenied):
        authorize(admin, "/pitstop.v1.AgentService/Connect", Role.AGENT)
    with pytest.raises(errors.PermissionDenied, match="declares no role"):
        authorize(admin, "/pitstop.v1.X/Y", Role.UNSPECIFIED)


def test_tokens_are_checked() -> None:
    book = TokenBook([ApiToken(token="s" * 20, role=Role.ADMIN)])
    with pytest.raises(errors.Unauthenticated, match="no credential"):
        book.caller_for([])
    with pytest.raises(errors.Unauthenticated, match="Bearer"):
        book.caller_for([("authorization", "Basic abc")])
    with pytest.raises(errors.Unauthenticated, match="unknown token"):
        book.caller_for([("authorization", "Bearer " + "x" * 20)])
    assert TokenBook([]).caller_for([]).roles >= {Role.ADMIN, Role.AGENT}
    assert isinstance(book.caller_for([("authorization", "Bearer " + "s" * 20)]), Caller)


def test_a_configured_hash_authenticates_its_token_and_tls_keeps_agents_to_certificates() -> None:
    secret = "k" * 24
    hashed = ApiToken(sha256=hashlib.sha256(secret.encode()).hexdigest(), role=Role.AGENT)
    assert "k" * 24 not in repr(hashed)
    plain = TokenBook([hashed]).caller_for([("authorization", f"Bearer {secret}")])
    assert Role.AGENT in plain.roles
    # With TLS on, the agent role is a node certificate's: no token, and no open API, has it.
    secure = TokenBook([hashed], nodes_by_certificate=True)
    assert Role.AGENT not in secure.caller_for([("authorization", f"Bearer {secret}")]).roles
    assert Role.AGENT not in TokenBook([], nodes_by_certificate=True).caller_for([]).roles
    with pytest.raises(ValueError, match="either token"):
        ApiToken(token=secret, sha256=hashed.sha256, role=Role.ADMIN)
    with pytest.raises(ValueError, match="either token"):
        ApiToken(role=Role.ADMIN)


def _dbapi_error(orig: Exception) -> sqlalchemy.exc.DBAPIError:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, orig)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidArgument("spec.tp", 3, "fix"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("job", "j-1"), grpc.StatusCode.NOT_FOUND),
        (errors.FailedPrecondition("no"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.PermissionDenied("no"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.Unauthenticated("no"), grpc.StatusCode.UNAUTHENTICATED),
        (_dbapi_error(psycopg.OperationalError("down")), grpc.StatusCode.UNAVAILABLE),
        (sqlalchemy.exc.TimeoutError("pool"), grpc.StatusCode.UNAVAILABLE),
        (RedisConnectionError("down"), grpc.StatusCode.UNAVAILABLE),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), grpc.StatusCode.UNAVAILABLE),
        (_dbapi_error(psycopg.errors.DeadlockDetected("deadlock")), grpc.StatusCode.ABORTED),
        (_dbapi_error(psycopg.errors.UniqueViolation("dup")), grpc.StatusCode.INTERNAL),
        (ValueError("bug"), grpc.StatusCode.INTERNAL),
        (KeyError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_codes(exc: Exception, code: grpc.StatusCode) -> None:
    got, message = status_for(exc)
    assert got == code
    if code == grpc.StatusCode.INTERNAL:
        assert "bug" not in message  # internals stay in the log
    if code == grpc.StatusCode.UNAVAILABLE:
        assert "unreachable" in message


def test_invalid_argument_message_names_field_value_and_fix() -> None:
    err = errors.InvalidArgument("spec.checkpoint.keep_in_memory", 0, "keep at least 1")
    assert str(err) == "spec.checkpoint.keep_in_memory: 0 is invalid: keep at least 1"
