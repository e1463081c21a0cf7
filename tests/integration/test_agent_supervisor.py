"""RankSupervisor with real rank processes (tests/integration/fake_rank.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kit.dirs import short_tempdir
from kit.forking import ForkServerProcess
from kit.ranks import NODE, ExitLog, RankNotices, start_command, wait_gone
from pitstop.agent.forkserver import ForkServerClient
from pitstop.agent.supervisor import STANDBY_NICE, RankSupervisor
from pitstop.rankside.rankclient import RANK_KEY_ENV
from pitstop.v1 import agent_pb2


@pytest.fixture
def exits() -> ExitLog:
    return ExitLog()


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ForkServerProcess]:
    """A fork server for this module's fake ranks (nothing to preload: they import no
    torch)."""
    with (
        short_tempdir("ps-fork-") as folder,
        ForkServerProcess(folder / "fork.sock", "", dict(os.environ)) as server,
    ):
        yield server


@pytest.fixture(params=["fresh", "forked"])
async def supervisor(
    request: pytest.FixtureRequest, short_dir: Path, tmp_path: Path, exits: ExitLog
) -> AsyncIterator[RankSupervisor]:
    """The supervisor starting fresh processes, and the same forking them from a fork
    server: every test holds both ways."""
    fork_server = None
    if request.param == "forked":
        server: ForkServerProcess = request.getfixturevalue("fork_server")
        fork_server = ForkServerClient(server.socket_path)
    supervisor = RankSupervisor(
        NODE,
        short_dir / "agent.sock",
        tmp_path / "logs",
        exits,
        checkpointd_address="ckpt:7070",
        fork_server=fork_server,
    )
    yield supervisor
    await supervisor.shutdown(grace_seconds=1.0)
    if fork_server is not None:
        await fork_server.close()


async def test_starts_this_nodes_ranks_with_the_torch_environment(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog, tmp_path: Path
) -> None:
    command = start_command(
        "job-env",
        notices,
        "--hold",
        ranks=((0, NODE, 3), (1, "n2", 0), (2, NODE, 5)),
        env={"FAKE_RANK_EXTRA": "yes", "RANK": "overridden by the agent"},
        working_dir=str(tmp_path),
        rendezvous_address="10.1.2.3:29511",
        restore_step=40,
    )

    assert await supervisor.start_ranks(command) == [0, 2]
    first, third = await notices.next(0), await notices.next(2)

    assert first["env"] == {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29511",
        "CUDA_VISIBLE_DEVICES": "3",
        "PITSTOP_JOB_ID": "job-env",
        "PITSTOP_GENERATION": "1",
        "PITSTOP_NODE_ID": NODE,
        "PITSTOP_AGENT_SOCKET": str(supervisor.socket_path),
        "PITSTOP_RESTORE_STEP": "40",
        "PITSTOP_CHECKPOINTD": "ckpt:7070",
        "PITSTOP_STANDBY": None,
        "FAKE_RANK_EXTRA": "yes",
    }
    assert (third["env"]["RANK"], third["env"]["CUDA_VISIBLE_DEVICES"]) == ("2", "5")
    assert first["cwd"] == str(tmp_path)
    running = supervisor.running()
    assert [(r.job_id, r.generation, r.rank, r.pid) for r in running] == [
        ("job-env", 1, 0, first["pid"]),
        ("job-env", 1, 2, third["pid"]),
    ]

    # The same command again starts nothing new.
    assert await supervisor.start_ranks(command) == [0, 2]
    assert [r.pid for r in supervisor.running()] == [first["pid"], third["pid"]]

    os.kill(first["pid"], signal.SIGKILL)
    killed = await exits.next()
    assert (killed.job_id, killed.generation, killed.rank) == ("job-env", 1, 0)
    assert (killed.signal, killed.exit_code) == (9, 0)
    assert [r.rank for r in supervisor.running()] == [2]

    stopped = await supervisor.stop_ranks(agent_pb2.StopRanks(job_id="job-env", grace_seconds=5))
    assert stopped == [2]
    # Reported before stop_ranks returned.
    terminated = exits.queue.get_nowait()
    assert (terminated.rank, terminated.signal) == (2, signal.SIGTERM)
    assert supervisor.running() == []
    assert (tmp_path / "logs" / "job-env" / "rank-0.log").exists()


async def test_a_process_is_let_in_from_the_moment_it_exists(
    supervisor: RankSupervisor, notices: RankNotices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank (forked, it runs at once) may call the agent's socket before the
    supervisor has read its pid: its key is accepted from the moment it exists, for a
    rank and a standby alike. (A rank refused there exits 1, and its job restarts.)"""
    accepted: list[bool] = []

    def observed(start: Any) -> Any:
        async def started(*args: Any, **kwargs: Any) -> Any:
            process = await start(*args, **kwargs)  # it runs; its pid is not recorded yet
            env = kwargs["env"] if "env" in kwargs else args[1]
            if process is not None:
                accepted.append(supervisor.started(env[RANK_KEY_ENV]))
            return process

        return started

    if supervisor.fork_server is not None:
        monkeypatch.setattr(
            supervisor.fork_server, "launch", observed(supervisor.fork_server.launch)
        )
    else:
        monkeypatch.setattr(
            asyncio, "create_subprocess_exec", observed(asyncio.create_subprocess_exec)
        )
    await supervisor.start_ranks(start_command("job-key", notices, "--hold"))
    standby = start_command("job-key", notices, "--hold", ranks=(), standby_gpus=[1])
    await supervisor.start_standbys(standby)
    assert accepted == [True, True]
    assert not supervisor.started("not-a-key")
    assert not supervisor.started("")


async def test_reports_exit_code_result_and_log_tail(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog
) -> None:
    await supervisor.start_ranks(
        start_command("job-exit", notices, "--wait-go", "--exit-code", "3")
    )
    await notices.next(0)
    supervisor.record_step("job-exit", 0, 42)
    supervisor.record_result("job-exit", 0, {"final_weights_sha256": "abc123"})
    assert supervisor.running()[0].step == 42

    await notices.go(0)
    exited = await exits.next()

    assert (exited.rank, exited.exit_code, exited.signal) == (0, 3, 0)
    assert dict(exited.result) == {"final_weights_sha256": "abc123"}
    assert "fake rank 0 exiting with 3\n" in exited.stderr_tail
    assert exited.time.seconds > 0


async def test_stop_kills_a_rank_that_ignores_sigterm_after_the_grace(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog
) -> None:
    command = start_command("job-stubborn", notices, "--ignore-sigterm", "--spawn-child", "--hold")
    await supervisor.start_ranks(command)
    ready = await notices.next(0)

    started = time.monotonic()
    stopped = await supervisor.stop_ranks(
        agent_pb2.StopRanks(job_id="job-stubborn", ranks=[0], grace_seconds=0.3, reason="test")
    )

    assert stopped == [0]
    assert time.monotonic() - started >= 0.3
    assert exits.queue.get_nowait().signal == signal.SIGKILL
    await wait_gone([ready["pid"], ready["child_pid"]])


async def test_shutdown_leaves_no_process(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog
) -> None:
    command = start_command(
        "job-shutdown",
        notices,
        "--ignore-sigterm",
        "--spawn-child",
        "--hold",
        ranks=((0, NODE, 0), (1, NODE, 1)),
    )
    await supervisor.start_ranks(command)
    ready = [await notices.next(0), await notices.next(1)]

    await supervisor.shutdown(grace_seconds=0.2)

    assert sorted([exits.queue.get_nowait().rank, exits.queue.get_nowait().rank]) == [0, 1]
    await wait_gone([pid for notice in ready for pid in (notice["pid"], notice["child_pid"])])
    with pytest.raises(RuntimeError, match="shut down"):
        await supervisor.start_ranks(command)


async def test_a_newer_generation_replaces_the_older_one(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog
) -> None:
    await supervisor.start_ranks(start_command("job-gen", notices, "--hold", generation=1))
    await notices.next(0)

    await supervisor.start_ranks(start_command("job-gen", notices, "--hold", generation=2))

    old = await exits.next()
    assert (old.generation, old.signal) == (1, signal.SIGTERM)
    assert (await notices.next(0))["env"]["PITSTOP_GENERATION"] == "2"
    assert [(r.rank, r.generation) for r in supervisor.running()] == [(0, 2)]
    with pytest.raises(ValueError, match="stale"):
        await supervisor.start_ranks(start_command("job-gen", notices, generation=1))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"command": []}, "command is empty"),
        ({"job_id": ""}, "job_id"),
        ({"job_id": "../up"}, "job_id"),
        ({"rendezvous_address": "no-port"}, "host:port"),
        ({"working_dir": "/nonexistent/pitstop"}, "working_dir"),
    ],
)
async def test_rejects_a_command_it_cannot_run(
    supervisor: RankSupervisor, notices: RankNotices, change: dict[str, object], message: str
) -> None:
    command = start_command("job-bad", notices)
    for name, value in change.items():
        if isinstance(value, list):
            del getattr(command, name)[:]
        else:
            setattr(command, name, value)
    with pytest.raises(ValueError, match=message):
        await supervisor.start_ranks(command)
    assert supervisor.running() == []


async def test_rejects_a_rank_map_with_nothing_for_this_node(
    supervisor: RankSupervisor, notices: RankNotices
) -> None:
    command = start_command("job-elsewhere", notices, ranks=((0, "n2", 0), (1, "n3", 0)))
    with pytest.raises(ValueError, match="node 'n1'"):
        await supervisor.start_ranks(command)


async def test_a_missing_program_is_a_clear_error(
    supervisor: RankSupervisor, notices: RankNotices
) -> None:
    command = start_command("job-missing", notices)
    command.command[0] = "/nonexistent/python"
    with pytest.raises(ValueError, match="cannot run '/nonexistent/python'"):
        await supervisor.start_ranks(command)
    assert supervisor.running() == []


async def test_a_standby_process_waits_unreported_then_is_supervised_as_the_rank_it_adopts(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog, tmp_path: Path
) -> None:
    command = start_command(
        "job-standby", notices, "--hold", ranks=(), standby_gpus=[2], env={"FAKE_RANK_EXTRA": "x"}
    )
    assert await supervisor.start_standbys(command) == [2]
    ready = await notices.next(0)
    assert ready["env"] == {
        "RANK": None,
        "WORLD_SIZE": None,
        "LOCAL_RANK": None,
        "LOCAL_WORLD_SIZE": None,
        "MASTER_ADDR": None,
        "MASTER_PORT": None,
        "CUDA_VISIBLE_DEVICES": "2",
        "PITSTOP_JOB_ID": "job-standby",
        "PITSTOP_GENERATION": "1",
        "PITSTOP_NODE_ID": NODE,
        "PITSTOP_AGENT_SOCKET": str(supervisor.socket_path),
        "PITSTOP_RESTORE_STEP": None,
        "PITSTOP_CHECKPOINTD": "ckpt:7070",
        "PITSTOP_STANDBY": "1",
        "FAKE_RANK_EXTRA": "x",
    }
    listed = [(r.job_id, r.pid, r.standby) for r in supervisor.running()]
    assert listed == [("job-standby", ready["pid"], True)]
    assert await supervisor.start_standbys(command) == [2]  # again: nothing new starts
    assert [r.pid for r in supervisor.running()] == [ready["pid"]]
    assert supervisor.standby_pid("job-standby", 2) == ready["pid"]
    assert supervisor.standby_pid("job-standby", 0) is None
    # It imports at a low priority, and the rank it becomes runs at the normal one (as
    # root: raising priority needs CAP_SYS_NICE).
    assert os.getpriority(os.PRIO_PROCESS, ready["pid"]) == STANDBY_NICE

    assert supervisor.adopt("job-standby", 2, rank=3, generation=4) == ready["pid"]
    assert supervisor.standby_pid("job-standby", 2) is None
    assert supervisor.adopt("job-standby", 2, rank=3, generation=4) is None  # taken
    niceness = 0 if os.geteuid() == 0 else STANDBY_NICE
    assert os.getpriority(os.PRIO_PROCESS, ready["pid"]) == niceness
    adopted = [(r.rank, r.generation, r.standby, r.pid) for r in supervisor.running()]
    assert adopted == [(3, 4, False, ready["pid"])]
    log = tmp_path / "logs" / "job-standby" / "rank-3.log"
    assert log.read_text().startswith("--- pitstop: standby on GPU 2 starting at")

    os.kill(ready["pid"], signal.SIGKILL)
    exited = await exits.next()  # reported as the rank it became
    assert (exited.job_id, exited.rank, exited.generation, exited.signal) == (
        "job-standby",
        3,
        4,
        signal.SIGKILL,
    )


async def test_a_standby_that_dies_is_not_a_lost_rank_and_a_job_stop_ends_the_others(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog
) -> None:
    command = start_command("job-standbys", notices, "--hold", ranks=(), standby_gpus=[0, 1])
    assert await supervisor.start_standbys(command) == [0, 1]
    pids = sorted([(await notices.next(0))["pid"], (await notices.next(0))["pid"]])
    os.kill(pids[0], signal.SIGKILL)
    await wait_gone([pids[0]])

    stop = agent_pb2.StopRanks(job_id="job-standbys", grace_seconds=5)
    assert await supervisor.stop_ranks(stop) == []  # no rank, but the standby goes
    # Both watchers are done: the killed one's before the stop or awaited by it.
    assert supervisor.running() == []
    await wait_gone([pids[1]])
    assert exits.queue.empty()  # a standby's exit is logged, never reported
    assert supervisor.standby_command("job-standbys") is None


async def test_a_rank_started_on_a_standbys_gpu_replaces_the_standby(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog
) -> None:
    standby = start_command("job-cold", notices, "--hold", ranks=(), standby_gpus=[0])
    await supervisor.start_standbys(standby)
    waiting = await notices.next(0)
    start = start_command("job-cold", notices, "--hold", ranks=((1, NODE, 0), (2, NODE, 1)))
    assert await supervisor.start_ranks(start, only={1}) == [1]
    await wait_gone([waiting["pid"]])
    fresh = await notices.next(1)
    assert fresh["env"]["LOCAL_WORLD_SIZE"] == "2"  # the node's share of the map
    assert [(r.rank, r.standby) for r in supervisor.running()] == [(1, False)]
    assert exits.queue.empty()


async def test_a_stop_at_the_boundary_waits_its_grace_outside_the_lock_and_gpus_are_vacated(
    supervisor: RankSupervisor, notices: RankNotices, exits: ExitLog
) -> None:
    """A preempted job's rank gets its grace to exit on its own (here it never does, so
    it is signalled after it); another job's rank starts on another GPU meanwhile, and a
    job booked onto the preempted rank's GPU starts only once that rank is gone."""
    await supervisor.start_ranks(start_command("job-low", notices, "--hold"))
    await notices.next(0)
    stop = asyncio.create_task(
        supervisor.stop_ranks(
            agent_pb2.StopRanks(job_id="job-low", grace_seconds=1.0, at_boundary=True)
        )
    )
    # Not blocked by the wait: another job's rank on GPU 1 starts at once.
    began = time.monotonic()
    await supervisor.start_ranks(
        start_command("job-other", notices, "--hold", ranks=((0, NODE, 1),))
    )
    assert time.monotonic() - began < 1.0
    assert not stop.done()
    # Booked onto GPU 0: its start waits for job-low's rank to leave.
    await supervisor.start_ranks(start_command("job-high", notices, "--hold"))
    assert stop.done()
    assert await stop == [0]
    gone = exits.queue.get_nowait()
    assert (gone.job_id, gone.signal) == ("job-low", signal.SIGTERM)
    assert {(r.job_id, r.rank) for r in supervisor.running()} == {
        ("job-other", 0),
        ("job-high", 0),
    }
