"""API tokens without a server: names, roles, the lock-out rules, the in-memory token
book (issued tokens, expiry to the second, withdrawal, the open API) and the table."""

from __future__ import annotations

import datetime as dt
import hashlib
import io

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError
from rich.console import Console

from pitstop.client.render_tokens import api_tokens_table, token_expiry, token_revocation
from pitstop.scheduler import errors
from pitstop.scheduler.auth import TokenBook, current_caller, require_project
from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.domain import IssuedToken, Role
from pitstop.scheduler.services.api_tokens import (
    PREFIX,
    check_admins_remain,
    check_first_token,
    check_name,
    issuable_role,
)
from pitstop.v1 import common_pb2, nodes_pb2

NOW = dt.datetime(2026, 11, 26, 12, 0, 0, tzinfo=dt.UTC)
SECRET = PREFIX + "s" * 43


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def issued(name: str, role: Role, token: str, expires_at: dt.datetime | None) -> IssuedToken:
    return IssuedToken(name, role, hashlib.sha256(token.encode()).hexdigest(), expires_at)


@pytest.mark.parametrize("name", ["alice", "ci-deploy", "a", "bob.smith@corp", "x_1", "9" * 64])
def test_good_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "-alice", ".x", "a b", "x" * 65, "al/ice", "élodie"])
def test_bad_names_name_the_field_the_value_and_the_fix(name: str) -> None:
    with pytest.raises(errors.InvalidArgument) as refused:
        check_name(name)
    assert refused.value.field == "name"
    assert refused.value.value == name
    assert "1-64 letters, digits" in str(refused.value)


@pytest.mark.parametrize(
    ("value", "role"),
    [
        (common_pb2.ROLE_VIEWER, Role.VIEWER),
        (common_pb2.ROLE_OPERATOR, Role.OPERATOR),
        (common_pb2.ROLE_ADMIN, Role.ADMIN),
    ],
)
def test_people_roles_can_be_issued(value: int, role: Role) -> None:
    assert issuable_role(value) is role


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (common_pb2.ROLE_AGENT, "'agent'"),
        (common_pb2.ROLE_UNSPECIFIED, "'unspecified'"),
        (common_pb2.ROLE_PUBLIC, "'public'"),
        (99, "99"),
    ],
)
def test_other_roles_are_invalid_arguments(value: int, shown: str) -> None:
    with pytest.raises(errors.InvalidArgument) as refused:
        issuable_role(value)
    message = str(refused.value)
    assert message.startswith(f"role: {shown} is invalid: ")
    assert message.endswith("viewer, operator, admin")
    if value == common_pb2.ROLE_AGENT:
        assert "node certificate" in message


def test_an_open_api_takes_only_an_admin_first() -> None:
    with pytest.raises(errors.FailedPrecondition, match="lock the admins out"):
        check_first_token(Role.VIEWER, api_open=True)
    check_first_token(Role.ADMIN, api_open=True)
    check_first_token(Role.VIEWER, api_open=False)


def test_the_last_admin_token_stays() -> None:
    with pytest.raises(errors.FailedPrecondition, match="'root' is the last admin token"):
        check_admins_remain("root", other_admins=0, configured_admins=0)
    check_admins_remain("root", other_admins=1, configured_admins=0)
    check_admins_remain("root", other_admins=0, configured_admins=1)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> dt.datetime:
        return self.now


def test_an_issued_token_authenticates_with_its_role_until_it_expires() -> None:
    clock = Clock()
    book = TokenBook([], nodes_by_certificate=True, clock=clock)
    book.replace_issued([issued("alice", Role.OPERATOR, SECRET, NOW + dt.timedelta(hours=1))], True)
    caller = book.caller_for(bearer(SECRET))
    assert caller.name == "token:alice"
    assert caller.roles == {Role.OPERATOR, Role.VIEWER}
    # Past its expiry it is refused at once, before any reload removes it.
    clock.now = NOW + dt.timedelta(hours=1)
    with pytest.raises(errors.Unauthenticated, match="'alice' expired at 2026-11-26 13:00:00"):
        book.caller_for(bearer(SECRET))


def test_a_withdrawn_token_is_refused_and_an_admitted_one_honoured_at_once() -> None:
    book = TokenBook([ApiToken(token="c" * 20, role=Role.ADMIN, name="ops")])
    book.admit(issued("alice", Role.VIEWER, SECRET, None))
    assert book.caller_for(bearer(SECRET)).name == "token:alice"
    assert book.issued_names == ["alice"]
    book.withdraw("alice")
    with pytest.raises(errors.Unauthenticated, match="unknown token"):
        book.caller_for(bearer(SECRET))
    assert book.caller_for(bearer("c" * 20)).name == "token:ops"  # configured: untouched


def test_a_reload_replaces_the_issued_tokens() -> None:
    book = TokenBook([])
    book.replace_issued([issued("alice", Role.VIEWER, SECRET, None)], True)
    book.replace_issued([issued("bob", Role.ADMIN, "b" * 20, None)], True)
    assert book.issued_names == ["bob"]
    with pytest.raises(errors.Unauthenticated):
        book.caller_for(bearer(SECRET))


def test_configured_and_issued_tokens_carry_their_projects_into_the_caller() -> None:
    configured = ApiToken(token="c" * 20, role=Role.OPERATOR, name="ci", projects=["nlp"])
    book = TokenBook([configured, ApiToken(token="d" * 20, role=Role.ADMIN, name="ops")])
    book.replace_issued(
        [
            IssuedToken(
                "alice",
                Role.OPERATOR,
                hashlib.sha256(SECRET.encode()).hexdigest(),
                None,
                ("vision", "speech"),
            ),
        ],
        True,
    )
    alice = book.caller_for(bearer(SECRET))
    assert alice.projects == {"vision", "speech"}
    assert alice.may_act_in("speech")
    assert not alice.may_act_in("nlp")
    ci = book.caller_for(bearer("c" * 20))
    assert ci.projects == {"nlp"}
    ops = book.caller_for(bearer("d" * 20))
    assert ops.projects == frozenset()
    assert ops.may_act_in("anything")
    reset = current_caller.set(alice)
    try:
        require_project("vision", "cancel job j-1")
        with pytest.raises(errors.PermissionDenied) as denied:
            require_project("nlp", "cancel job j-2")
    finally:
        current_caller.reset(reset)
    message = str(denied.value)
    assert "token:alice may not cancel job j-2" in message
    assert "speech, vision" in message
    assert "'nlp'" in message
    assert "--project nlp" in message


@pytest.mark.parametrize("project", ["Vision", "team_a", ""])
def test_a_configured_token_with_a_bad_project_name_is_refused_at_start(project: str) -> None:
    with pytest.raises(ValidationError, match=r"projects\[1\]: .* is invalid"):
        ApiToken(token="c" * 20, role=Role.VIEWER, projects=["ok", project])


def test_the_api_is_open_until_a_token_exists_and_never_again_after() -> None:
    book = TokenBook([])
    assert book.open
    book.replace_issued([], any_issued=False)
    assert book.open
    assert Role.ADMIN in book.caller_for([]).roles
    book.replace_issued([], any_issued=True)  # every issued token revoked or expired
    assert not book.open
    with pytest.raises(errors.Unauthenticated, match="no credential"):
        book.caller_for([])
    book.replace_issued([], any_issued=False)  # a stale read cannot reopen it
    assert not book.open
    assert not TokenBook([ApiToken(token="c" * 20, role=Role.VIEWER)]).open


def _timestamp(at: dt.datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(at)
    return ts


def test_the_tokens_table_shows_source_expiry_and_revocation() -> None:
    configured = nodes_pb2.ApiToken(
        name="ops", role=common_pb2.ROLE_ADMIN, source=nodes_pb2.API_TOKEN_SOURCE_CONFIG
    )
    alice = nodes_pb2.ApiToken(
        name="alice",
        role=common_pb2.ROLE_VIEWER,
        source=nodes_pb2.API_TOKEN_SOURCE_API,
        created_at=_timestamp(NOW - dt.timedelta(days=2)),
        created_by="token:ops",
        expires_at=_timestamp(NOW - dt.timedelta(days=1)),
    )
    bob = nodes_pb2.ApiToken(
        name="bob",
        role=common_pb2.ROLE_OPERATOR,
        source=nodes_pb2.API_TOKEN_SOURCE_API,
        created_at=_timestamp(NOW - dt.timedelta(hours=1)),
        created_by="token:ops",
        revoked_at=_timestamp(NOW),
        revoked_by="token:root",
    )
    assert token_expiry(configured, NOW) == "never"
    assert token_expiry(alice, NOW) == "2026-11-25T12:00:00Z (expired)"
    assert token_revocation(alice) == "-"
    assert token_revocation(bob) == "2026-11-26T12:00:00Z by token:root"
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(
        api_tokens_table([configured, alice, bob], NOW)
    )
    lines = out.getvalue().splitlines()
    assert lines[0].split() == [
        "NAME", "ROLE", "SOURCE", "CREATED", "CREATED", "BY", "EXPIRES", "REVOKED", "PROJECTS"
    ]  # fmt: skip
    assert lines[1].split() == ["ops", "admin", "config", "-", "-", "never", "-", "all"]
    assert lines[2].split()[:5] == ["alice", "viewer", "api", "2026-11-24T12:00:00Z", "token:ops"]
    assert lines[3].split()[-4:] == ["2026-11-26T12:00:00Z", "by", "token:root", "all"]
