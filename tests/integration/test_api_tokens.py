"""API tokens issued, listed and revoked against real scheduler processes (TLS on, a
database of their own, as in test_enrollment.py).

An admin issues a token through the CLI or the client; the scheduler stores only its
hash, honours it at once, refuses it on the very next call after a revocation, past its
expiry, and in every other scheduler process on the same database within a second.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
from typer.testing import CliRunner, Result

from kit.schedulers import SchedulerProcess, tls_scheduler
from kit.stores import StoreUrls, unique
from kit.waits import wait_until
from pitstop.client.cli import app
from pitstop.client.client import PitstopClient
from pitstop.client.errors import PitstopError
from pitstop.v1 import common_pb2, jobs_pb2

ADMIN = "admin-token-0123456789"
ADMIN_HASH = hashlib.sha256(ADMIN.encode()).hexdigest()
# A second scheduler process sees a revocation within its reload period (0.5 s) plus a
# query. The tests wait for the refusal up to this bound, which only guards a hang: a
# process that never reloaded would accept the token for ever.
PROPAGATION_SECONDS = 30.0


@pytest.fixture(scope="module")
def secure(
    stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SchedulerProcess]:
    scheduler = tls_scheduler(
        stores,
        tmp_path_factory.mktemp("tokens"),
        [{"sha256": ADMIN_HASH, "role": "admin", "name": "ops"}],
    )
    try:
        yield scheduler
    finally:
        scheduler.stop()


def client(scheduler: SchedulerProcess, token: str | None = ADMIN) -> PitstopClient:
    assert scheduler.ca is not None
    credentials = grpc.ssl_channel_credentials(root_certificates=scheduler.ca.read_bytes())
    # One attempt: a refusal is what these tests look at, and UNAVAILABLE is not retried.
    return PitstopClient(scheduler.address, token, credentials=credentials, max_attempts=1)


def pitstop(scheduler: SchedulerProcess, *args: str, token: str = ADMIN) -> Result:
    assert scheduler.ca is not None
    common = ["--server", scheduler.address, "--ca-cert", str(scheduler.ca), "--token", token]
    # Wide enough that a table row is one line.
    runner = CliRunner(env={"COLUMNS": "200"})
    return runner.invoke(app, [*common, *args], catch_exceptions=False)


def refusal(call: Callable[[], object]) -> PitstopError:
    with pytest.raises(PitstopError) as refused:
        call()
    return refused.value


def refuses(scheduler: SchedulerProcess, token: str) -> bool:
    """Whether `scheduler` answers UNAUTHENTICATED to a call with `token`."""
    with client(scheduler, token) as viewer:
        try:
            viewer.list_jobs()
        except PitstopError as error:
            if error.code != grpc.StatusCode.UNAUTHENTICATED:
                raise
            return True
    return False


def issue(scheduler: SchedulerProcess, role: str = "viewer", *extra: str) -> tuple[str, str]:
    """A new API token through the CLI: its name and the token."""
    name = unique(role)
    made = pitstop(scheduler, "token", "create", "--role", role, "--name", name, *extra)
    assert made.exit_code == 0, made.stderr
    assert "shown only now" in made.stderr
    return name, made.stdout.strip()


def test_an_admin_issues_a_viewer_token_that_reads_but_cannot_cancel(
    secure: SchedulerProcess,
) -> None:
    name, token = issue(secure, "viewer", "--ttl", "30d")
    assert token.startswith("pst_api_")
    with client(secure, token) as viewer:
        viewer.list_jobs()  # honoured on the very next call: no reload awaited
        denied = refusal(lambda: viewer.cancel_job("job-of-anyone", "curious"))
        assert denied.code == grpc.StatusCode.PERMISSION_DENIED
        assert f"token:{name} has viewer" in denied.details
        assert refusal(viewer.list_api_tokens).code == grpc.StatusCode.PERMISSION_DENIED
    with client(secure) as admin:
        events = admin.list_events(after_event_id=-1, limit=1000)
    created = [e for e in events if e.kind == "token.created" and e.attributes.get("token") == name]
    assert [(e.actor, e.attributes["role"]) for e in created] == [("token:ops", "viewer")]


def test_token_list_shows_issued_and_configured_tokens_and_never_a_hash(
    secure: SchedulerProcess,
) -> None:
    name, token = issue(secure, "operator")
    listed = pitstop(secure, "token", "list", "--json")
    assert listed.exit_code == 0, listed.stderr
    records = {r["name"]: r for r in json.loads(listed.stdout)}
    assert records["ops"]["source"] == "API_TOKEN_SOURCE_CONFIG"
    assert records["ops"]["role"] == "ROLE_ADMIN"
    assert records[name]["source"] == "API_TOKEN_SOURCE_API"
    assert records[name]["role"] == "ROLE_OPERATOR"
    assert records[name]["created_by"] == "token:ops"
    assert "expires_at" not in records[name]  # no --ttl: it never expires
    table = pitstop(secure, "token", "list")
    assert table.exit_code == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines()]
    ops_row = next(row for row in rows if row[0] == "ops")
    assert ops_row[:3] == ["ops", "admin", "config"]
    row = next(row for row in rows if row[0] == name)
    assert row[1:3] == ["operator", "api"]
    assert row[5:] == ["never", "-", "all"]  # no expiry, not revoked, every project
    digest = hashlib.sha256(token.encode()).hexdigest()
    for output in (listed.stdout, table.stdout):
        assert ADMIN_HASH not in output
        assert digest not in output
        assert token not in output


def test_a_revoked_token_is_refused_on_the_very_next_call(secure: SchedulerProcess) -> None:
    name, token = issue(secure, "viewer")
    assert not refuses(secure, token)
    revoked = pitstop(secure, "token", "revoke", name)
    assert revoked.exit_code == 0, revoked.stderr
    assert f"revoked API token {name} (viewer)" in revoked.stdout
    assert refuses(secure, token)
    again = pitstop(secure, "token", "revoke", name, "--json")  # a no-op, the same record
    assert again.exit_code == 0, again.stderr
    record = json.loads(again.stdout)
    assert record["revoked_by"] == "token:ops"
    with client(secure) as admin:
        events = admin.list_events(after_event_id=-1, limit=1000)
    revocations = [e for e in events if e.kind == "token.revoked"]
    assert [e.actor for e in revocations if e.attributes.get("token") == name] == ["token:ops"]


def test_an_expired_token_is_refused(secure: SchedulerProcess) -> None:
    with client(secure) as admin:
        made = admin.create_api_token(unique("brief"), common_pb2.ROLE_VIEWER, ttl_seconds=1)
    expires = made.record.expires_at.ToDatetime().timestamp()
    assert expires - made.record.created_at.ToDatetime().timestamp() == pytest.approx(1.0)
    wait_until(
        lambda: refuses(secure, made.token),
        "the change to reach the scheduler",
        PROPAGATION_SECONDS,
        poll=0.02,
    )
    assert time.time() >= expires - 0.05  # refused for its expiry, not before
    listed = pitstop(secure, "token", "list")
    row = next(line for line in listed.stdout.splitlines() if made.record.name in line)
    assert "(expired)" in row


def test_another_scheduler_process_refuses_a_revoked_token(
    secure: SchedulerProcess, tmp_path: Path
) -> None:
    # Same PostgreSQL and Redis, a CA of its own (the test's clients trust each one's).
    second = SchedulerProcess(tmp_path, "second", dict(secure.env))
    try:
        name, token = issue(secure, "viewer")
        wait_until(
            lambda: not refuses(second, token),
            "the change to reach the scheduler",
            PROPAGATION_SECONDS,
            poll=0.02,
        )
        with client(secure) as admin:
            admin.revoke_api_token(name)
        wait_until(
            lambda: refuses(second, token),
            "the change to reach the scheduler",
            PROPAGATION_SECONDS,
            poll=0.02,
        )
    finally:
        second.stop()


def test_the_database_holds_only_the_hash(secure: SchedulerProcess) -> None:
    name, token = issue(secure, "admin")
    with psycopg.connect(secure.env["PITSTOP_DATABASE_URL"]) as db:
        rows = db.execute("select * from api_tokens").fetchall()
        (stored,) = db.execute(
            "select digest, role, created_by from api_tokens where name = %s", (name,)
        ).fetchall()
    assert stored == (hashlib.sha256(token.encode()).hexdigest(), "admin", "token:ops")
    secret = token.removeprefix("pst_api_")
    assert all(secret not in str(row) for row in rows)


def test_bad_requests_name_the_field_the_value_and_the_fix(secure: SchedulerProcess) -> None:
    taken, _ = issue(secure, "viewer")
    with client(secure) as admin:
        agent = refusal(lambda: admin.create_api_token(unique("a"), common_pb2.ROLE_AGENT))
        empty = refusal(lambda: admin.create_api_token("", common_pb2.ROLE_VIEWER))
        unset = refusal(lambda: admin.create_api_token(unique("u"), common_pb2.ROLE_UNSPECIFIED))
        duplicate = refusal(lambda: admin.create_api_token(taken, common_pb2.ROLE_ADMIN))
        configured = refusal(lambda: admin.create_api_token("ops", common_pb2.ROLE_VIEWER))
        revoke_configured = refusal(lambda: admin.revoke_api_token("ops"))
        unknown = refusal(lambda: admin.revoke_api_token("nobody-here"))
    assert agent.code == grpc.StatusCode.INVALID_ARGUMENT
    assert agent.details.startswith("role: 'agent' is invalid: the agent role comes only from")
    assert "use viewer, operator, admin" in agent.details
    assert empty.code == grpc.StatusCode.INVALID_ARGUMENT
    assert empty.details.startswith("name: '' is invalid: give 1-64 letters")
    assert unset.code == grpc.StatusCode.INVALID_ARGUMENT
    assert unset.details.startswith("role: 'unspecified' is invalid: use viewer")
    assert duplicate.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"API token name {taken!r} is taken by a viewer token" in duplicate.details
    assert "choose another name" in duplicate.details
    assert configured.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'ops' is taken by a token in the scheduler's config file" in configured.details
    assert revoke_configured.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "remove it from the config file" in revoke_configured.details
    assert unknown.code == grpc.StatusCode.NOT_FOUND
    assert "'nobody-here' not found; pitstop token list" in unknown.details
    # The CLI refuses a join token's option with an API token, and a name without a role.
    for args in (["--role", "viewer", "--name", "x", "--node-id", "n"], ["--name", "x"]):
        result = pitstop(secure, "token", "create", *args)
        assert result.exit_code == 2, result.stdout


def test_an_open_api_takes_an_admin_first_and_never_reopens(
    stores: StoreUrls, tmp_path: Path
) -> None:
    scheduler = tls_scheduler(stores, tmp_path, [])
    try:
        with client(scheduler, None) as anyone:
            first = refusal(lambda: anyone.create_api_token("alice", common_pb2.ROLE_VIEWER))
            assert first.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "first token must be an admin's" in first.details
            assert "lock the admins out" in first.details
            root = anyone.create_api_token("root", common_pb2.ROLE_ADMIN)
            # Closed from the very next call: no token, no access.
            assert refusal(anyone.list_jobs).code == grpc.StatusCode.UNAUTHENTICATED
        with client(scheduler, root.token) as admin:
            assert [t.name for t in admin.list_api_tokens()] == ["root"]
            created = [e for e in admin.list_events(after_event_id=-1) if e.kind == "token.created"]
            assert [e.actor for e in created] == ["user:anonymous"]
            last = refusal(lambda: admin.revoke_api_token("root"))
            assert last.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "'root' is the last admin token" in last.details
        # Every issued token gone (here: expired), the API stays closed: an expiry must
        # not hand the cluster to whoever can reach it.
        with psycopg.connect(scheduler.env["PITSTOP_DATABASE_URL"]) as db:
            db.execute("update api_tokens set expires_at = now() - interval '1 minute'")
        wait_until(
            lambda: refuses(scheduler, root.token),
            "the change to reach the scheduler",
            PROPAGATION_SECONDS,
            poll=0.02,
        )
        with client(scheduler, None) as anyone:
            assert refusal(anyone.list_jobs).code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        scheduler.stop()


def test_a_token_limited_to_a_project_reaches_only_its_jobs(secure: SchedulerProcess) -> None:
    """A token of project "vision" submits, cancels and reads the records of vision's
    jobs; for another project's job each is PERMISSION_DENIED, naming both projects. A
    token without projects reaches both. `token list` shows the limit."""
    name, vision = issue(secure, "operator", "--project", "vision")

    def spec(project: str) -> jobs_pb2.JobSpec:
        return jobs_pb2.JobSpec(name=unique(project), project=project, command=["x"])

    with client(secure) as admin:
        theirs = admin.submit_job(spec("nlp"))
    with client(secure, vision) as limited:
        ours = limited.submit_job(spec("vision"))
        assert limited.job_record(ours.id).job_id == ours.id
        limited.cancel_job(ours.id, "done with it")
        for call in (
            lambda: limited.submit_job(spec("nlp")),
            lambda: limited.cancel_job(theirs.id, "not mine"),
            lambda: limited.pause_job(theirs.id, "not mine"),
            lambda: limited.resume_job(theirs.id, "not mine"),
            lambda: limited.job_record(theirs.id),
        ):
            denied = refusal(call)
            assert denied.code == grpc.StatusCode.PERMISSION_DENIED, denied
            assert f"token:{name}" in denied.details
            assert "vision" in denied.details
            assert "'nlp'" in denied.details
        # Listing and showing jobs stays a viewer's right, whatever the project.
        assert limited.get_job(theirs.id).spec.project == "nlp"
    with client(secure) as admin:
        assert admin.job_record(theirs.id).job_id == theirs.id
        assert admin.get_job(ours.id).state == common_pb2.JOB_STATE_CANCELLED
        # The refusals changed nothing: nlp's job still waits, and no second one exists.
        assert admin.get_job(theirs.id).state == common_pb2.JOB_STATE_PENDING
        nlp = [j for j in admin.list_jobs(page_size=1000) if j.spec.project == "nlp"]
        assert [j.id for j in nlp] == [theirs.id]
    listed = pitstop(secure, "token", "list", "--json")
    assert listed.exit_code == 0, listed.stderr
    (row,) = [t for t in json.loads(listed.stdout) if t["name"] == name]
    assert row["projects"] == ["vision"]


def test_quota_set_and_list_through_the_cli(secure: SchedulerProcess) -> None:
    project = unique("q").replace("_", "-").lower()
    done = pitstop(secure, "quota", "set", project, "--gpus", "16")
    assert done.exit_code == 0, done.stderr
    assert f"project {project}: GPU quota 16" in done.stdout
    listed = pitstop(secure, "quota", "list", "--json")
    (row,) = [p for p in json.loads(listed.stdout) if p["name"] == project]
    assert row["gpu_quota"] == 16
    assert row.get("unlimited", False) is False
    assert pitstop(secure, "quota", "set", project, "--unlimited").exit_code == 0
    listed = pitstop(secure, "quota", "list", "--json")
    (row,) = [p for p in json.loads(listed.stdout) if p["name"] == project]
    assert row["unlimited"] is True
    with client(secure) as admin:
        events = admin.list_events(after_event_id=-1, limit=1000)
    changes = [
        (e.attributes["from"], e.attributes["to"])
        for e in events
        if e.kind == "project.quota_set" and e.attributes.get("project") == project
    ]
    assert changes == [("", "16"), ("16", "")]
    both = pitstop(secure, "quota", "set", project)
    assert both.exit_code != 0
    assert "--gpus N, or --unlimited" in both.output
    bad = pitstop(secure, "quota", "set", "Bad_Name", "--gpus", "1")
    assert bad.exit_code != 0
    assert "project" in bad.output
    assert "INVALID_ARGUMENT" in bad.output
    _, viewer = issue(secure, "viewer")
    refused = pitstop(secure, "quota", "set", project, "--gpus", "1", token=viewer)
    assert refused.exit_code != 0
    assert "PERMISSION_DENIED" in refused.output


def test_an_issued_token_without_projects_reaches_every_project(
    secure: SchedulerProcess,
) -> None:
    """No --project: the token submits, cancels and reads records in any project."""
    _, anywhere = issue(secure, "operator")
    with client(secure, anywhere) as operator:
        for project in ("vision", "nlp"):
            job = operator.submit_job(
                jobs_pb2.JobSpec(name=unique(project), project=project, command=["x"])
            )
            assert operator.job_record(job.id).job_id == job.id
            # Past the project check: no agent runs it, so the state is what refuses.
            paused = refusal(lambda: operator.pause_job(job.id, "not now"))  # noqa: B023
            resumed = refusal(lambda: operator.resume_job(job.id, "not now"))  # noqa: B023
            for held in (paused, resumed):
                assert held.code == grpc.StatusCode.FAILED_PRECONDITION, held
            assert operator.cancel_job(job.id, "done").state == common_pb2.JOB_STATE_CANCELLED


def test_token_create_names_its_projects_and_refuses_bad_ones(secure: SchedulerProcess) -> None:
    name = unique("two")
    made = pitstop(
        secure, "token", "create", "--role", "viewer", "--name", name,
        "--project", "speech", "--project", "vision", "--project", "speech",
    )  # fmt: skip
    assert made.exit_code == 0, made.stderr
    assert "limited to project(s) speech, vision" in made.stderr
    with client(secure) as admin:
        (record,) = [t for t in admin.list_api_tokens() if t.name == name]
    assert list(record.projects) == ["speech", "vision"]
    table = pitstop(secure, "token", "list")
    (row,) = [line for line in table.stdout.splitlines() if line.split()[:1] == [name]]
    assert row.rstrip().endswith("speech, vision")
    bad = pitstop(
        secure, "token", "create", "--role", "viewer", "--name", unique("bad"),
        "--project", "ok", "--project", "Not_A_Project",
    )  # fmt: skip
    assert bad.exit_code != 0
    assert "INVALID_ARGUMENT" in bad.output
    assert "projects[1]" in bad.output
    assert "Traceback" not in bad.output
    join = pitstop(secure, "token", "create", "--project", "vision")
    assert join.exit_code != 0
    assert "--project limits an API token" in join.output


def test_quota_list_shows_a_table_of_quota_use_and_waiting_jobs(
    secure: SchedulerProcess,
) -> None:
    """A project with a job but no quota row is listed unlimited, its job pending (no
    agent runs here); one with a quota row and no job shows its quota."""
    waiting, capped = (unique(p).replace("_", "-").lower() for p in ("w", "c"))
    with client(secure) as admin:
        admin.submit_job(jobs_pb2.JobSpec(name=unique("j"), project=waiting, command=["x"]))
        admin.set_quota(capped, 0)
    table = pitstop(secure, "quota", "list")
    assert table.exit_code == 0, table.stderr
    lines = table.stdout.splitlines()
    header = next(line for line in lines if "PROJECT" in line)
    assert header.split()[:5] == ["PROJECT", "QUOTA", "IN", "USE", "PENDING"]
    rows = {line.split()[0]: line.split()[1:4] for line in lines if line.split()[:1]}
    assert rows[waiting] == ["unlimited", "0", "1"]
    assert rows[capped] == ["0", "0", "0"]
    assert "token:ops" in next(line for line in lines if line.split()[:1] == [capped])
