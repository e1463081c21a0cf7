"""LocalEndpoint: RankControl over a real Unix socket, with real rank processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kit.dirs import short_tempdir
from kit.forking import ForkServerProcess
from kit.ranks import NODE, TIMEOUT, ExitLog, RankNotices, start_command
from pitstop.agent.forkserver import ForkServerClient
from pitstop.agent.gpu import FaultNotSupported, SimulatedBackend, open_backend
from pitstop.agent.local import LocalEndpoint
from pitstop.agent.steps import StepSummarizer
from pitstop.agent.supervisor import RankSupervisor
from pitstop.rankside.rankclient import RANK_KEY_METADATA, RankControlClient
from pitstop.v1 import agent_pb2, common_pb2, rank_pb2, rank_pb2_grpc


@dataclass
class Agent:
    endpoint: LocalEndpoint
    supervisor: RankSupervisor
    steps: StepSummarizer
    exits: ExitLog
    stub: Any
    socket_path: Path


@contextlib.asynccontextmanager
async def open_agent(
    short_dir: Path, tmp_path: Path, fork_server: ForkServerClient | None = None
) -> AsyncIterator[Agent]:
    socket_path = short_dir / "agent.sock"
    backend = open_backend("sim:2", NODE)
    exits = ExitLog()
    supervisor = RankSupervisor(
        NODE, socket_path, tmp_path / "logs", exits, "127.0.0.1:7070", fork_server=fork_server
    )
    steps = StepSummarizer()
    # The test's own calls stand in for a process the agent started: they carry a key
    # the supervisor takes besides those of the processes it really started.
    started = supervisor.started
    supervisor.started = lambda key: key == TEST_KEY or started(key)  # type: ignore[method-assign]
    endpoint = LocalEndpoint(socket_path, backend, supervisor, steps, "127.0.0.1:7070")
    await endpoint.start()
    channel = grpc.aio.insecure_channel(f"unix:{socket_path}")
    stub = Keyed(rank_pb2_grpc.RankControlStub(channel), TEST_KEY)
    try:
        yield Agent(endpoint, supervisor, steps, exits, stub, socket_path)
    finally:
        await supervisor.shutdown(grace_seconds=1.0)
        await channel.close()
        await endpoint.stop()
        backend.close()
        if fork_server is not None:
            await fork_server.close()


@pytest.fixture
async def agent(short_dir: Path, tmp_path: Path) -> AsyncIterator[Agent]:
    async with open_agent(short_dir, tmp_path) as agent:
        yield agent


TEST_KEY = "the-test-is-a-process-the-agent-started"


class Keyed:
    """A RankControl stub whose every call carries `key` as the rank key."""

    def __init__(self, stub: Any, key: str) -> None:
        self._stub, self._key = stub, key

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        metadata = ((RANK_KEY_METADATA, self._key),)
        return lambda request, **options: method(request, metadata=metadata, **options)


async def test_only_processes_the_agent_started_may_call(
    agent: Agent, notices: RankNotices
) -> None:
    """The socket is 0600; beyond that, a process of the same user that the agent did not
    start (it has no rank key, or a wrong one) is refused, while a rank the agent
    started attaches with the key it was given."""
    socket = f"unix:{agent.socket_path}"
    attach = rank_pb2.AttachRequest(job_id="job-key", rank=0)
    async with grpc.aio.insecure_channel(socket) as plain:
        refused = await rpc_error(rank_pb2_grpc.RankControlStub(plain).Attach(attach))
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "only from the processes it started" in (refused.details() or "")
    async with grpc.aio.insecure_channel(socket) as guessing:
        stub = Keyed(rank_pb2_grpc.RankControlStub(guessing), "guessed")
        refused = await rpc_error(stub.Attach(attach))
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (agent.socket_path.stat().st_mode & 0o777) == 0o600

    await agent.supervisor.start_ranks(start_command("job-key", notices, "--attach", "--hold"))
    ready = await notices.next(0)  # the rank attached with its own key
    assert ready["checkpointd"] == "127.0.0.1:7070"


def slow(gpu_index: int, multiplier: float) -> rank_pb2.LocalFaultRequest:
    return rank_pb2.LocalFaultRequest(
        fault=common_pb2.Fault(gpu_index=gpu_index, slow_multiplier=multiplier)
    )


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_a_rank_attaches_reports_steps_and_obeys_commands(
    agent: Agent, notices: RankNotices
) -> None:
    await agent.stub.InjectFault(slow(1, 1.3))
    agent.endpoint.set_generation("job-run", 4, 17)
    command = start_command(
        "job-run",
        notices,
        "--attach",
        "--steps=3",
        "--step-seconds=0.5",
        "--wait-commands",
        "--result=final_weights_sha256=abc",
        ranks=((0, NODE, 1),),
        generation=4,
    )
    await agent.supervisor.start_ranks(command)

    ready = await notices.next(0)
    assert ready["slow_multiplier"] == pytest.approx(1.3)
    assert (ready["generation"], ready["restore_step"]) == (4, 17)
    assert ready["checkpointd"] == "127.0.0.1:7070"
    (summary,) = agent.steps.drain()
    assert (summary.job_id, summary.generation, summary.ranks) == ("job-run", 4, 1)
    assert (summary.slowest_step, summary.newest_step, summary.samples) == (3, 3, 3)
    assert summary.time.seconds > 0
    assert [(r.rank, r.step) for r in agent.supervisor.running()] == [(0, 3)]

    assert await agent.endpoint.wait_command_stream("job-run", 0, TIMEOUT)
    pause = rank_pb2.RankCommand(command_id=7, pause=agent_pb2.PauseJob(job_id="job-run"))
    assert await agent.endpoint.send_command("job-run", 0, pause)
    ack = await agent.endpoint.wait_ack(7, TIMEOUT)
    assert ack is not None
    assert (ack.job_id, ack.rank, ack.ok, ack.step) == ("job-run", 0, True, 3)
    assert (await notices.next(0))["kind"] == "pause"

    stop = rank_pb2.RankCommand(command_id=8, stop=agent_pb2.StopRanks(job_id="job-run"))
    assert await agent.endpoint.send_command("job-run", 0, stop)
    assert await agent.endpoint.wait_ack(8, TIMEOUT) is not None
    exited = await agent.exits.next()
    assert (exited.exit_code, exited.signal) == (0, 0)
    assert dict(exited.result) == {"final_weights_sha256": "abc"}


async def test_a_forked_rank_that_calls_at_once_is_known_200_times_of_200(
    short_dir: Path, tmp_path: Path, notices: RankNotices
) -> None:
    """A rank forked from a warm fork server runs at once and may call Attach before the
    supervisor has its pid: the agent knows it as its rank from before its process
    exists. 200 ranks, 20 at a time, each attaching the moment it starts (its client
    preloaded): every one attaches and exits 0, none is refused (it would exit 1)."""
    preload = "pitstop.rankside.rankclient"
    with (
        short_tempdir("ps-fork-") as folder,
        ForkServerProcess(folder / "fork.sock", preload, dict(os.environ)) as server,
    ):
        async with open_agent(short_dir, tmp_path, ForkServerClient(server.socket_path)) as agent:
            for batch in range(10):
                job_id = f"job-race-{batch}"
                ranks = tuple((rank, NODE, rank % 2) for rank in range(20))
                command = start_command(job_id, notices, "--attach", ranks=ranks)
                assert len(await agent.supervisor.start_ranks(command)) == 20
                exited = [await agent.exits.next() for _ in ranks]
                failed = [(e.rank, e.exit_code, e.stderr_tail) for e in exited if e.exit_code]
                assert not failed, failed
                assert sorted(e.rank for e in exited) == list(range(20))
                assert {e.job_id for e in exited} == {job_id}


async def test_a_new_command_stream_replaces_the_old_and_gets_what_is_unacked(
    agent: Agent, notices: RankNotices
) -> None:
    await agent.supervisor.start_ranks(start_command("job-cmd", notices, "--hold"))
    ready = await notices.next(0)
    request = rank_pb2.CommandStreamRequest(job_id="job-cmd", rank=0)
    step = rank_pb2.StepReport(
        job_id="job-cmd", rank=0, generation=1, sample=agent_pb2.StepSample(step=5)
    )
    assert not await agent.endpoint.send_command("job-cmd", 0, rank_pb2.RankCommand(command_id=1))

    first = agent.stub.Commands(request)
    assert await agent.endpoint.wait_command_stream("job-cmd", 0, TIMEOUT)
    resume = rank_pb2.RankCommand(command_id=21, resume=agent_pb2.ResumeJob(job_id="job-cmd"))
    assert await agent.endpoint.send_command("job-cmd", 0, resume)
    assert (await first.read()) == resume
    assert (await agent.stub.ReportStep(step)).command_pending

    second = agent.stub.Commands(request)
    assert await asyncio.wait_for(first.read(), TIMEOUT) is grpc.aio.EOF
    assert (await second.read()) == resume  # not acknowledged yet: sent again

    await agent.stub.Acknowledge(
        rank_pb2.RankAck(job_id="job-cmd", rank=0, command_id=21, ok=True, step=5)
    )
    ack = await agent.endpoint.wait_ack(21, TIMEOUT)
    assert ack is not None
    assert ack.step == 5
    assert not (await agent.stub.ReportStep(step)).command_pending
    for seconds, nanos in ((2**40, 0), (0, -1), (0, 10**9)):
        wrong = rank_pb2.StepReport()
        wrong.CopyFrom(step)
        wrong.sample.time.seconds, wrong.sample.time.nanos = seconds, nanos
        error = await rpc_error(agent.stub.ReportStep(wrong))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sample.time={seconds}s {nanos}ns" in error.details()
        assert "years 1 and 9999" in error.details()
    assert await agent.endpoint.wait_ack(99, 0.01) is None
    with pytest.raises(ValueError, match="command_id 0"):
        await agent.endpoint.send_command("job-cmd", 0, rank_pb2.RankCommand())

    # A rank that re-formed in a newer generation is reported there.
    step.generation = 2
    await agent.stub.ReportStep(step)
    assert [(r.generation, r.step) for r in agent.supervisor.running()] == [(2, 5)]

    # What a rank's process left unacknowledged does not reach its restarted successor.
    orphaned = rank_pb2.RankCommand(command_id=31, pause=agent_pb2.PauseJob(job_id="job-cmd"))
    assert await agent.endpoint.send_command("job-cmd", 0, orphaned)
    assert (await second.read()) == orphaned
    os.kill(ready["pid"], signal.SIGKILL)
    await agent.exits.next()
    await agent.supervisor.start_ranks(start_command("job-cmd", notices, "--hold", generation=2))
    await notices.next(0)
    assert not (await agent.stub.ReportStep(step)).command_pending
    third = agent.stub.Commands(request)
    assert await asyncio.wait_for(second.read(), TIMEOUT) is grpc.aio.EOF
    fresh = rank_pb2.RankCommand(command_id=32, resume=agent_pb2.ResumeJob(job_id="job-cmd"))
    assert await agent.endpoint.send_command("job-cmd", 0, fresh)
    assert (await third.read()) == fresh
    third.cancel()


async def test_standby_blocks_until_a_rank_is_assigned(agent: Agent) -> None:
    call = asyncio.ensure_future(
        agent.stub.Standby(rank_pb2.StandbyRequest(job_id="job-spare", pid=os.getpid()))
    )
    assert await agent.endpoint.wait_standby("job-spare", TIMEOUT)
    assert agent.endpoint.standby_count == 1
    assert not call.done()
    assignment = rank_pb2.StandbyAssignment(
        reconfigure=agent_pb2.Reconfigure(job_id="job-spare", generation=2),
        rank=5,
        local_rank=0,
        gpu_index=1,
    )

    assert await agent.endpoint.assign_standby("job-spare", assignment)

    assert await asyncio.wait_for(call, TIMEOUT) == assignment
    assert agent.endpoint.standby_count == 0
    assert not await agent.endpoint.assign_standby("job-spare", assignment)
    # The adopted rank attaches on the GPU it was given.
    await agent.stub.InjectFault(slow(1, 1.5))
    attached = await agent.stub.Attach(rank_pb2.AttachRequest(job_id="job-spare", rank=5))
    assert attached.slow_multiplier == pytest.approx(1.5)
    assert attached.generation == 0  # set_generation never called for this job

    # Stopping the endpoint ends a waiting standby call at once, not after the grace.
    waiting = asyncio.ensure_future(
        agent.stub.Standby(rank_pb2.StandbyRequest(job_id="job-spare", pid=os.getpid()))
    )
    assert await agent.endpoint.wait_standby("job-spare", TIMEOUT)
    await agent.endpoint.stop(grace=TIMEOUT)
    error = await rpc_error(waiting)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "the agent is stopping; retry",
    )


async def test_errors_map_to_status_codes(agent: Agent) -> None:
    unknown: list[Any] = [
        agent.stub.Attach(rank_pb2.AttachRequest(job_id="job-x", rank=3)),
        agent.stub.ReportStep(rank_pb2.StepReport(job_id="job-x", rank=3)),
        agent.stub.Acknowledge(rank_pb2.RankAck(job_id="job-x", rank=3, command_id=1)),
        agent.stub.ReportResult(rank_pb2.RankResult(job_id="job-x", rank=3)),
        agent.stub.Commands(rank_pb2.CommandStreamRequest(job_id="job-x", rank=3)).read(),
    ]
    for call in unknown:
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "rank 3 of job 'job-x'" in error.details()

    invalid: list[tuple[Any, str]] = [
        (agent.stub.Attach(rank_pb2.AttachRequest(rank=0)), "job_id is empty"),
        (agent.stub.Standby(rank_pb2.StandbyRequest()), "job_id is empty"),
        (agent.stub.InjectFault(slow(9, 1.3)), "GPU index 9"),
        (agent.stub.InjectFault(slow(0, -1.0)), "slow multiplier -1.0"),
        (agent.stub.InjectFault(rank_pb2.LocalFaultRequest()), "names no kind"),
    ]
    for call, message in invalid:
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details()


async def test_a_run_record_is_passed_on_and_one_that_cannot_be_kept_is_refused(
    agent: Agent, notices: RankNotices
) -> None:
    """ReportRunRecord hands a held rank's record to the agent's link (on_run_record);
    a record the scheduler would refuse is refused here, naming the field, and never
    passed on (on the scheduler stream it would cost the node that stream)."""
    passed: list[agent_pb2.RunRecord] = []
    agent.endpoint.on_run_record = passed.append
    await agent.supervisor.start_ranks(start_command("job-rec", notices, "--hold"))
    await notices.next(0)
    record = agent_pb2.RunRecord(
        job_id="job-rec",
        generation=1,
        code=agent_pb2.CodeVersion(git_commit="a" * 40, working_dir="/src"),
        environment=agent_pb2.EnvironmentVersion(torch="2.13.0", env={"SEED": "1"}),
        data_digest="d" * 64,
        start_step=5,
    )
    await agent.stub.ReportRunRecord(record)
    assert passed == [record]

    bad: list[tuple[agent_pb2.RunRecord, str]] = [
        (agent_pb2.RunRecord(job_id="job-rec", data_source="x" * 4097), "data_source"),
        (
            agent_pb2.RunRecord(job_id="job-rec", code=agent_pb2.CodeVersion(working_dir="a\x00")),
            "code.working_dir",
        ),
        (
            agent_pb2.RunRecord(
                job_id="job-rec", environment=agent_pb2.EnvironmentVersion(env={"K": "\x00"})
            ),
            "environment.env",
        ),
    ]
    for request, field in bad:
        error = await rpc_error(agent.stub.ReportRunRecord(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in error.details()
        assert "at most 4096 characters and no NUL" in error.details()
    unknown = await rpc_error(agent.stub.ReportRunRecord(agent_pb2.RunRecord(job_id="job-x")))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert passed == [record]


class NoFaultBackend(SimulatedBackend):
    def inject_fault(self, fault: common_pb2.Fault) -> None:
        raise FaultNotSupported("this backend injects nothing")


async def test_fault_injection_can_be_refused(agent: Agent, short_dir: Path) -> None:
    unsupported = LocalEndpoint(
        short_dir / "nf.sock", NoFaultBackend(NODE, 1), agent.supervisor, StepSummarizer()
    )
    disabled = LocalEndpoint(
        short_dir / "off.sock",
        agent.endpoint.backend,
        agent.supervisor,
        StepSummarizer(),
        allow_fault_injection=False,
    )
    expected = [
        (
            unsupported,
            grpc.StatusCode.FAILED_PRECONDITION,
            "cannot inject this fault here: this backend injects nothing",
        ),
        (disabled, grpc.StatusCode.PERMISSION_DENIED, "fault injection is disabled"),
    ]
    for endpoint, code, message in expected:
        await endpoint.start()
        try:
            async with grpc.aio.insecure_channel(f"unix:{endpoint.socket_path}") as channel:
                stub = Keyed(rank_pb2_grpc.RankControlStub(channel), TEST_KEY)
                error = await rpc_error(stub.InjectFault(slow(0, 1.3)))
        finally:
            await endpoint.stop()
        assert error.code() == code
        assert message in error.details()


async def test_the_socket_is_private_and_only_stale_files_are_replaced(
    agent: Agent, short_dir: Path
) -> None:
    assert stat.S_IMODE(agent.socket_path.stat().st_mode) == 0o600

    def endpoint(path: Path) -> LocalEndpoint:
        return LocalEndpoint(path, agent.endpoint.backend, agent.supervisor, StepSummarizer())

    with pytest.raises(RuntimeError, match="another process serves"):
        await endpoint(agent.socket_path).start()

    stale = short_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(stale))  # closing leaves the file behind, as a crashed agent does
    replacement = endpoint(stale)
    await replacement.start()
    await replacement.stop()
    assert not stale.exists()

    regular = short_dir / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(ValueError, match="not a socket"):
        await endpoint(regular).start()
    with pytest.raises(ValueError, match="107 bytes"):
        await endpoint(short_dir / ("x" * 120)).start()


def test_rank_client_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PITSTOP_AGENT_SOCKET", raising=False)
    assert RankControlClient.from_env() is None

    monkeypatch.setenv("PITSTOP_AGENT_SOCKET", "/tmp/agent.sock")
    monkeypatch.setenv("PITSTOP_JOB_ID", "job-env")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK=''"):
        RankControlClient.from_env()

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("PITSTOP_GENERATION", "7")
    with RankControlClient.from_env() as client:  # type: ignore[union-attr]
        assert (client.job_id, client.rank, client.generation) == ("job-env", 3, 7)
