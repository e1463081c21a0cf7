"""The trainer end to end: the example job in real processes, real torch.distributed
(gloo on CPU), a real pitstop-checkpointd, and a test-driven agent endpoint.

The strongest assertion this project has (torchft's): the final weights are bitwise the
same with and without failures. Every test compares the final weights' sha256 with
that of one uninterrupted single-process run. Tests wait on what the processes print
or report, never on a sleep.

The example's processes are forked from a fork server that has imported torch (see
`forks`): they test what the ranks do, not how a Python starts, and a fresh interpreter
spent most of a rank's CPU importing torch. Each forked process is still a process of
its own, with its own torch.distributed group. The standalone run and the overhead
benchmark start afresh (see each).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from kit.forking import ForkClient, ForkedChild, forking
from kit.ports import free_port
from pitstop.checkpointd.slots import remove_stale_segments, segment_prefix
from pitstop.client.launch import checkpointd_command, clean_env
from pitstop.v1 import (
    agent_pb2,
    checkpoint_pb2,
    checkpoint_pb2_grpc,
    common_pb2,
    rank_pb2,
    rank_pb2_grpc,
)

pytest.importorskip("torch")

STEPS = 40
TIMEOUT = 90.0  # a guard against a hang only: a run takes about 10 s alone, and took
# over 30 s beside the fault matrix on the 2-core machine (under pytest-xdist)
EXAMPLE = [sys.executable, "-m", "pitstop.trainer.example", "--steps", str(STEPS)]
# What the fork server imports before it forks (the fault matrix's): what an example's
# process would otherwise import afresh, all but a few tenths of a CPU-second of it.
PRELOAD = "torch,torch.distributed,torch._dynamo,torch.optim,pitstop.trainer"


class Proc:
    """A child process whose output lines (stdout and stderr) the test reads as they
    come: started afresh, or, with `forks`, forked from that fork server."""

    def __init__(
        self, command: list[str], env: dict[str, str], forks: ForkClient | None = None
    ) -> None:
        self.process: subprocess.Popen[str] | ForkedChild
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        if forks is None:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            assert self.process.stdout is not None
            stream: IO[str] = self.process.stdout
        else:
            self.process, stream = fork(forks, command, env)
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                self.lines.put(line.rstrip())
        self.lines.put(None)

    def wait_for(self, holds: Callable[[str], bool], timeout: float = TIMEOUT) -> str:
        """The first line (from now on) for which `holds`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no such line in {timeout}s: {self.seen[-20:]}") from None
            if line is None:
                raise AssertionError(f"exited {self.process.wait()}: {self.seen[-30:]}")
            self.seen.append(line)
            if holds(line):
                return line

    def result(self, key: str = "final_weights_sha256") -> dict[str, Any]:
        """The example's last JSON line carrying `key`, after a clean exit."""
        found = json.loads(self.wait_for(lambda line: f'"{key}"' in line))
        assert self.process.wait(TIMEOUT) == 0, self.seen[-30:]
        return dict(found)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(TIMEOUT)

    def output(self) -> list[str]:
        """Every line it wrote (once it has ended): what a failed test shows of it."""
        while (line := self.lines.get(timeout=TIMEOUT)) is not None:
            self.seen.append(line)
        self.lines.put(None)  # a second call ends at once
        return self.seen


def fork(forks: ForkClient, command: list[str], env: dict[str, str]) -> tuple[ForkedChild, IO[str]]:
    """Fork `command` there, its output into a FIFO rather than a file: the test reads
    each line as it comes, as from a pipe. The test holds a write end of its own until
    the child has exited, so the output ends at the child's exit (as a pipe's does), not
    before the child has opened the FIFO."""
    folder = Path(tempfile.mkdtemp(prefix="pitstop-trainer-"))
    fifo = folder / "output"
    os.mkfifo(fifo, 0o600)
    reading = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # no writer yet: returns at once
    holding = os.open(fifo, os.O_WRONLY)
    os.set_blocking(reading, True)
    try:
        child = forks.launch(command, env, fifo)
    except BaseException:
        os.close(reading)
        os.close(holding)
        shutil.rmtree(folder, ignore_errors=True)
        raise

    def release() -> None:  # the child's exit is known (reaped by the fork server)
        child.wait()
        os.close(holding)
        shutil.rmtree(folder, ignore_errors=True)

    threading.Thread(target=release, daemon=True).start()
    return child, open(reading)  # Proc._read closes it


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if not k.startswith("MASTER_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    env.update(PYTHONUNBUFFERED="1", PITSTOP_COLLECTIVE_TIMEOUT="10", **extra)
    return env


def start_ranks(
    forks: ForkClient, world: int, args: list[str] | None = None, **extra: str
) -> list[Proc]:
    port = str(free_port())
    return [
        Proc(
            EXAMPLE + (args or []),
            base_env(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                CUDA_VISIBLE_DEVICES=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                **extra,
            ),
            forks,
        )
        for rank in range(world)
    ]


def step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError):
        return -1


@pytest.fixture
def processes() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()
    for number, proc in enumerate(started):  # pytest shows it for a failed test only
        print(
            f"== process {number}, exit {proc.process.returncode}", *proc.output()[-60:], sep="\n"
        )


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkClient]:
    """A fork server with torch imported (in the environment of `base_env`, which its
    children's start-up variables equal), and this module's connection to it: the
    example's processes are forked from it, each in milliseconds instead of a fresh
    Python's import of torch. Whatever it forked dies when the connection closes."""
    with forking(PRELOAD, base_env()) as client:
        yield client


@pytest.fixture(scope="module")
def reference(forks: ForkClient) -> str:
    """The final weights of one uninterrupted single-process run (forked: a fresh
    interpreter's run must match it, see test_a_standalone_run_is_reproducible)."""
    proc = Proc(EXAMPLE, base_env(), forks)
    try:
        return str(proc.result()["final_weights_sha256"])
    finally:
        proc.kill()


@pytest.fixture
def checkpointd() -> Iterator[str]:
    """A real pitstop-checkpointd, without a scheduler; its address."""
    node_id = f"trainer-{uuid.uuid4().hex[:6]}"
    state_dir = Path(tempfile.mkdtemp(prefix="pitstop-trainer-"))
    command = checkpointd_command(
        node_id=node_id,
        host="127.0.0.1",
        port=0,
        scheduler="",
        state_dir=state_dir,
        as_module=True,
        extra=[
            *("--memory-budget-bytes", str(256 << 20)),
            *("--keep-in-memory", "4", "--flush-every-steps", "1000"),
        ],
    )
    daemon = Proc(command, base_env())
    try:
        line = daemon.wait_for(lambda line: "listening on" in line)
        yield line.split("listening on ")[1].split()[0]
    finally:
        daemon.process.terminate()
        daemon.process.wait(TIMEOUT)
        remove_stale_segments(segment_prefix(node_id))
        shutil.rmtree(state_dir, ignore_errors=True)


def common_step(address: str, job_id: str, ranks: range) -> int:
    """The newest step every rank holds in checkpointd's memory: what the scheduler
    would commit."""
    with grpc.insecure_channel(address) as channel:
        listed = checkpoint_pb2_grpc.CheckpointServiceStub(channel).ListShards(
            checkpoint_pb2.ListShardsRequest(job_id=job_id), timeout=TIMEOUT
        )
    held = [
        {s.header.key.step for s in listed.shards if s.header.key.rank == rank} for rank in ranks
    ]
    return max(set.intersection(*held))


def test_the_example_job_spec_is_valid() -> None:
    from pitstop.client.jobspec import load_job_spec
    from pitstop.scheduler.jobspec import validate_job_spec

    path = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "gpt-tiny.yaml"
    spec = validate_job_spec(load_job_spec(path))
    assert list(spec.command[:3]) == ["python", "-m", "pitstop.trainer.example"]
    assert (spec.dp, spec.gpus_per_node, spec.checkpoint.snapshot_every_steps) == (4, 1, 1)


def test_a_standalone_run_is_reproducible(reference: str, processes: list[Proc]) -> None:
    """Started afresh, as a user runs it: a fresh interpreter ends with the weights of
    the forked reference run, which every other test compares with."""
    processes.append(Proc(EXAMPLE, base_env()))
    assert processes[0].result()["final_weights_sha256"] == reference


def test_two_ranks_give_the_single_process_weights(
    reference: str, processes: list[Proc], forks: ForkClient
) -> None:
    processes += start_ranks(forks, 2)
    assert [p.result()["final_weights_sha256"] for p in processes] == [reference] * 2


def test_every_step_reads_the_same_samples_at_any_world_size(
    reference: str, processes: list[Proc], forks: ForkClient
) -> None:
    """The example's data order is global (pitstop.data): at three ranks, whose shares of
    the four gradient shards are uneven (two, one, one), every step names the samples
    the single process's same step names, and the weights end the same."""
    processes.append(Proc([*EXAMPLE, "--log-every", "1"], base_env(), forks))
    processes += start_ranks(forks, 3, ["--log-every", "1"])
    assert [p.result()["final_weights_sha256"] for p in processes] == [reference] * 4

    def samples(proc: Proc) -> dict[int, str]:
        lines = (json.loads(line) for line in proc.seen if line.startswith('{"rank"'))
        return {said["step"]: said["samples"] for said in lines if "samples" in said}

    alone = samples(processes[0])
    assert sorted(alone) == list(range(1, STEPS + 1)), alone
    assert len(set(alone.values())) == STEPS, alone  # no batch read twice
    for proc in processes[1:]:
        assert samples(proc) == alone


def test_a_restart_from_a_snapshot_is_bitwise_the_same(
    reference: str, processes: list[Proc], checkpointd: str, forks: ForkClient
) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    snapshots = {"PITSTOP_CHECKPOINTD": checkpointd, "PITSTOP_JOB_ID": job}
    first = start_ranks(forks, 2, ["--log-every", "1"], PITSTOP_GENERATION="1", **snapshots)
    processes += first
    for proc in first:
        proc.wait_for(lambda line: step_of(line) >= STEPS // 2)
    for proc in first:
        proc.kill()
    restore = common_step(checkpointd, job, range(2))
    assert STEPS // 2 - 1 <= restore < STEPS
    second = start_ranks(
        forks, 2, PITSTOP_GENERATION="2", PITSTOP_RESTORE_STEP=str(restore), **snapshots
    )
    processes += second
    assert [p.result()["final_weights_sha256"] for p in second] == [reference] * 2


class FakeAgent(rank_pb2_grpc.RankControlServicer):
    """The agent's RankControl endpoint, driven by the test: it records steps, acks and
    results, and sends the commands and standby assignments the test gives it."""

    def __init__(self, checkpointd: str) -> None:
        self.checkpointd = checkpointd
        self.steps: dict[int, int] = {}
        self.samples: dict[int, agent_pb2.StepSample] = {}  # each rank's newest
        self.acks: dict[int, rank_pb2.RankAck] = {}
        self.results: dict[int, dict[str, str]] = {}
        self.run_records: list[agent_pb2.RunRecord] = []
        self.streams: dict[int, queue.Queue[rank_pb2.RankCommand | None]] = {}
        self.standby: queue.Queue[rank_pb2.StandbyAssignment] = queue.Queue()
        self.standby_waiting = 0
        self._changed = threading.Condition()
        self.path = Path(tempfile.mkdtemp(prefix="ps-")) / "agent.sock"
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        rank_pb2_grpc.add_RankControlServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{self.path}")
        self.server.start()

    def Attach(self, request: Any, context: Any) -> Any:  # noqa: N802
        return rank_pb2.AttachResponse(
            generation=request.generation, checkpointd_address=self.checkpointd
        )

    def ReportStep(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._changed:
            self.steps[request.rank] = max(self.steps.get(request.rank, 0), request.sample.step)
            self.samples[request.rank] = request.sample
            self._changed.notify_all()
        return rank_pb2.StepReportResponse()

    def Commands(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        commands: queue.Queue[rank_pb2.RankCommand | None] = queue.Queue()
        with self._changed:
            self.streams[request.rank] = commands
            self._changed.notify_all()
        context.add_callback(lambda: commands.put(None))
        yield from iter(commands.get, None)

    def Acknowledge(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._changed:
            self.acks[request.command_id] = request
            self._changed.notify_all()
        return rank_pb2.RankAckResponse()

    def ReportResult(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._changed:
            self.results[request.rank] = dict(request.result)
            self._changed.notify_all()
        return rank_pb2.RankResultResponse()

    def ReportRunRecord(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._changed:
            self.run_records.append(request)
            self._changed.notify_all()
        return rank_pb2.RunRecordResponse()

    def Standby(self, request: Any, context: Any) -> Any:  # noqa: N802
        with self._changed:
            self.standby_waiting += 1
            self._changed.notify_all()
        return self.standby.get(timeout=2 * TIMEOUT)

    def wait(self, holds: Callable[[], bool], timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not holds():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"not in {timeout}s: steps {self.steps} acks {self.acks}")
                self._changed.wait(left)

    def send(self, rank: int, command_id: int, **body: Any) -> None:
        self.wait(lambda: rank in self.streams)
        self.streams[rank].put(rank_pb2.RankCommand(command_id=command_id, **body))

    def env(self, **extra: str) -> dict[str, str]:
        return {"PITSTOP_AGENT_SOCKET": str(self.path), "PITSTOP_NODE_ID": "n1", **extra}


@pytest.fixture
def agent(checkpointd: str) -> Iterator[FakeAgent]:
    fake = FakeAgent(checkpointd)
    yield fake
    fake.server.stop(None)
    shutil.rmtree(fake.path.parent, ignore_errors=True)  # the socket's private folder


def test_pause_resume_and_stop_act_at_one_boundary(
    agent: FakeAgent, processes: list[Proc], forks: ForkClient
) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    env = agent.env(PITSTOP_JOB_ID=job, PITSTOP_GENERATION="1", PITSTOP_COMMAND_WAIT="0.5")
    processes += start_ranks(forks, 2, ["--steps", "100000", "--peak-flops", "1e12"], **env)
    agent.wait(lambda: min(agent.steps.get(r, 0) for r in range(2)) >= 3)
    # Each step carries the model FLOPs of the rank's tokens and its GPU's peak (MFU).
    import torch

    from pitstop.trainer.example import Job, model_flops_per_token, parse_args

    args = parse_args([])
    model = Job(args, torch.device("cpu")).make_state().model
    per_token = model_flops_per_token(model, args.layers, args.dim, args.context)
    for rank in range(2):
        sample = agent.samples[rank]
        assert sample.tokens == 2 * 4 * 32  # 2 of 4 shards, 4 sequences of 32 tokens
        assert sample.model_flops == sample.tokens * per_token
        assert sample.peak_flops == 1e12
    # Only the chief hears the pause at first: after PITSTOP_COMMAND_WAIT it makes
    # both ranks pause anyway, and rank 1 acknowledges its copy when it comes.
    agent.send(0, 1, pause=agent_pb2.PauseJob(job_id=job))
    agent.wait(lambda: 1 in agent.acks)
    agent.send(1, 2, pause=agent_pb2.PauseJob(job_id=job))
    agent.wait(lambda: 2 in agent.acks)
    paused_at = agent.acks[1].step
    assert agent.acks[1].ok
    assert agent.acks[2].ok
    assert agent.acks[2].step == paused_at  # rank 1 paused at the chief's boundary
    for rank in range(2):
        agent.send(rank, 10 + rank, resume=agent_pb2.ResumeJob(job_id=job))
    agent.wait(lambda: {10, 11} <= set(agent.acks))
    assert agent.acks[10].step == agent.acks[11].step == paused_at
    agent.wait(lambda: min(agent.steps.values()) >= paused_at + 3)
    for rank in range(2):
        agent.send(rank, 20 + rank, stop=agent_pb2.StopRanks(job_id=job))
    stopped = [p.result("stopped_at")["stopped_at"] for p in processes]
    assert stopped[0] == stopped[1] == agent.acks[20].step == agent.acks[21].step


def same_map_reconfigure(job: str, generation: int, restore: int) -> agent_pb2.Reconfigure:
    """Generation `generation` on the same two ranks, node n1 GPUs 0 and 1."""
    rank_map = common_pb2.RankMap(
        generation=generation,
        world_size=2,
        ranks=[
            common_pb2.RankAssignment(rank=r, node_id="n1", gpu_index=r, local_rank=r)
            for r in range(2)
        ],
    )
    return agent_pb2.Reconfigure(
        job_id=job,
        generation=generation,
        rank_map=rank_map,
        rendezvous_address=f"127.0.0.1:{free_port()}",
        restore_step=restore,
        adopted_ranks=[1] if generation == 2 else [],
    )


def test_a_reconfigure_at_a_boundary_rolls_back_bitwise(
    reference: str, agent: FakeAgent, processes: list[Proc], forks: ForkClient
) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    processes += start_ranks(forks, 2, PITSTOP_GENERATION="1", **agent.env(PITSTOP_JOB_ID=job))
    agent.wait(lambda: min(agent.steps.get(r, 0) for r in range(2)) >= 10)
    # Every rank is alive: they agree on the Reconfigure at one boundary, drop the
    # group, roll back from their own snapshots (they ran on) and re-form it.
    restore = common_step(agent.checkpointd, job, range(2))
    reconfigure = same_map_reconfigure(job, 3, restore)
    for rank in range(2):
        agent.send(rank, 30 + rank, reconfigure=reconfigure)
    agent.wait(lambda: {30, 31} <= set(agent.acks))
    assert [agent.acks[30 + r].step for r in range(2)] == [restore] * 2
    assert all(agent.acks[30 + r].ok for r in range(2))
    assert [p.result()["final_weights_sha256"] for p in processes] == [reference] * 2
    # Rank 0 reported what each generation ran: the first from step 0, the new one from
    # the step it rolled back to; with the data digest the example states.
    import torch

    from pitstop.trainer.example import Job, parse_args

    digest = Job(parse_args([]), torch.device("cpu")).data_digest
    records = agent.run_records
    assert [(r.generation, r.rank, r.start_step) for r in records] == [(1, 0, 0), (3, 0, restore)]
    assert [r.data_digest for r in records] == [digest] * 2
    assert all(r.environment.torch == torch.__version__ for r in records)
    assert all(r.code.working_dir for r in records)


def test_a_lost_rank_is_replaced_in_process_bitwise(
    reference: str, agent: FakeAgent, processes: list[Proc], forks: ForkClient
) -> None:
    job = f"job-{uuid.uuid4().hex[:6]}"
    env = agent.env(PITSTOP_JOB_ID=job, PITSTOP_RECONFIGURE_TIMEOUT="20")
    ranks = start_ranks(forks, 2, PITSTOP_GENERATION="1", **env)
    standby = Proc(EXAMPLE, base_env(PITSTOP_STANDBY="1", **env), forks)
    processes += [*ranks, standby]
    agent.wait(lambda: agent.standby_waiting == 1)
    agent.wait(lambda: min(agent.steps.get(r, 0) for r in range(2)) >= STEPS // 2)
    ranks[1].kill()
    restore = common_step(agent.checkpointd, job, range(2))
    reconfigure = same_map_reconfigure(job, 2, restore)
    agent.send(0, 7, reconfigure=reconfigure)
    agent.standby.put(
        rank_pb2.StandbyAssignment(reconfigure=reconfigure, rank=1, local_rank=1, gpu_index=1)
    )
    agent.wait(lambda: 7 in agent.acks)
    assert agent.acks[7].ok, agent.acks[7].error
    assert agent.acks[7].step == restore
    assert ranks[0].result()["final_weights_sha256"] == reference
    assert standby.result()["final_weights_sha256"] == reference
    # The survivor kept its process and rolled back from its own snapshot in memory;
    # the standby took rank 1 and loaded rank 1's shard.
    for proc in (ranks[0], standby):
        assert any(f"restored step {restore} from local" in line for line in proc.seen)
        assert any("joined generation 2" in line for line in proc.seen)
    assert agent.results[0]["final_weights_sha256"] == agent.results[1]["final_weights_sha256"]


def test_the_overhead_benchmark_prints_one_json_line() -> None:
    """Started afresh, as a user runs it: its last line of stdout (apart from stderr,
    which a forked process shares with stdout) is the JSON object."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "bench/overhead.py", "--steps", "10", "--block", "5"]
    result = subprocess.run(
        [*command, "--warmup", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "trainer_overhead"
    assert report["steps_per_variant"] == 10
    assert report["snapshot_stall_ms_median"] > 0
    assert isinstance(report["target_met"], bool)


def test_the_3d_example_as_a_standby_waits_for_a_rank_before_it_needs_a_group(
    processes: list[Proc], forks: ForkClient
) -> None:
    """A standby process of the 3D example has no process group until the agent hands
    it a rank inside `session.restore`: it must get that far (here, with no agent, to
    the session's word that a standby needs one), not stop at the example's own check
    for a group, which once made every 3D standby exit at once."""
    standby = Proc(
        [sys.executable, "-m", "pitstop.trainer.example3d", "--steps", "2"],
        base_env(PITSTOP_STANDBY="1", PITSTOP_JOB_ID="job-standby"),
        forks,
    )
    processes.append(standby)
    returncode = standby.process.wait(TIMEOUT)
    said = "\n".join(standby.output())
    assert returncode != 0, said[-2000:]
    assert "needs a process group" not in said, said[-2000:]
    assert "PITSTOP_STANDBY=1 needs PITSTOP_AGENT_SOCKET" in said, said[-2000:]
