"""Run the example job on a local cluster and fail its nodes on a schedule: what `make
demo` shows and what bench/recovery.py measures.

A fault is due at a step; once the job reaches it, the driver picks a node of the job
(not the one failed last) and fails it: ``xid`` injects a fatal Xid (79, fallen off the
bus) through the scheduler, ``node_kill`` is kill -9 of the node's agent, checkpoint
daemon and ranks, ``agent_hang`` stops the agent (SIGSTOP) so its heartbeats cease while
its stream stays open, ``node_freeze`` stops every process of the node (SIGSTOP: its
agent, checkpoint daemon and ranks), as a host that lost power or its network is to the
others (no connection resets; peers blocked on its ranks wait), and ``rank_kill`` is
kill -9 of one rank. Failed nodes come back
as hot spares once the job has moved off them, so a long run can fail many times.

Nothing here waits without a deadline. A job that makes no step for `STALL_TIMEOUT` s,
or is not over by its overall deadline (:func:`run_deadline`), ends the run with
:class:`JobStuck`, whose message holds the job's recent events: what the scheduler last
decided and why. The reference run dies with the process that started it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import (
    DEFAULT_TIMEOUT,
    STOP_TIMEOUT,
    ClusterError,
    LocalCluster,
    free_port,
    holding_a_rank,
)
from pitstop.client.signals import dying_with_parent
from pitstop.common.codeversion import code_version
from pitstop.v1 import common_pb2, jobs_pb2

FaultKind = Literal["xid", "node_kill", "agent_hang", "node_freeze", "rank_kill", "app_xid"]
FAULT_KINDS: tuple[FaultKind, ...] = (
    "xid",
    "node_kill",
    "agent_hang",
    "node_freeze",
    "rank_kill",
    "app_xid",
)
FATAL_XID = 79
APPLICATION_XID = 13
"""Graphics engine exception: the rank on that GPU dies, the GPU and the node stay."""
STEP_LINE = re.compile(rb'^\{"rank": \d+, "step": (\d+), ', re.MULTILINE)
TERMINAL = (
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
)
STALL_TIMEOUT = 90.0
"""Seconds a job may go without a new step before the run gives up on it. Starting the
ranks (importing torch) and a recovery's fallback restart (30 s) fit well inside."""
REFERENCE_TIMEOUT = 600.0
"""Seconds the fault-free reference run may take."""
EVENTS_SHOWN = 15
"""How many of the job's newest events a stuck run prints."""


@dataclass(frozen=True)
class Fault:
    at_step: int
    kind: FaultKind


@dataclass
class Injected:
    fault: Fault
    node_id: str
    at: float  # epoch seconds
    step: int  # the job's step when it was injected


@dataclass
class Run:
    job: jobs_pb2.Job
    injected: list[Injected] = field(default_factory=list)
    seconds: float = 0.0
    record: jobs_pb2.JobRecord | None = None
    """The job's experiment record as it ended (None when it could not be read)."""


def example_command(steps: int, step_seconds: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pitstop.trainer.example",
        "--steps",
        str(steps),
        "--step-seconds",
        str(step_seconds),
        "--log-every",
        "1",
        *extra,
    ]


MESH_3D = {"dp": 2, "pp": 2, "tp": 2}
"""The 3D example's shape in these runs: 8 ranks, a TP pair on each 2-GPU node."""
MODEL_3D = ("--layers", "2", "--microbatches", "4")
"""The 3D example's model in these runs: one block a stage, four microbatches a step, two
a replica through 1F1B at dp 2 (every kind of parallelism still; 0.4 s a step on 2
shared cores, the example's default model 1.2 s)."""


def example3d_command(steps: int, step_seconds: float = 0.0, log_every: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pitstop.trainer.example3d",
        *MODEL_3D,
        "--steps",
        str(steps),
        "--step-seconds",
        str(step_seconds),
        "--log-every",
        str(log_every),
    ]


def example3d_spec(name: str, *, steps: int, step_seconds: float, spares: int) -> jobs_pb2.JobSpec:
    """The 3D example (tp = pp = dp = 2) on four 2-GPU nodes, a snapshot every step; a
    lost node's TP pair moves to a 2-GPU spare together."""
    return jobs_pb2.JobSpec(
        name=name,
        command=example3d_command(steps, step_seconds),
        dp=MESH_3D["dp"],
        pp=MESH_3D["pp"],
        tp=MESH_3D["tp"],
        gpus_per_node=2,
        min_dp=MESH_3D["dp"],
        spares=spares,
        standby_processes=True,
        max_restarts=1000,
        env={"PYTHONUNBUFFERED": "1"},
    )


def example_spec(
    name: str, *, dp: int, steps: int, step_seconds: float, spares: int
) -> jobs_pb2.JobSpec:
    """The example GPT job, one rank per node, an in-memory snapshot every step."""
    return jobs_pb2.JobSpec(
        name=name,
        command=example_command(steps, step_seconds),
        dp=dp,
        gpus_per_node=1,
        min_dp=dp,
        spares=spares,
        standby_processes=True,  # the spares hold the example, imported and waiting
        max_restarts=1000,
        # The default 30 s collective timeout: ranks abandon a collective whose peer is
        # gone at once (pitstop.trainer.group.abandon), they never wait it out.
        env={"PYTHONUNBUFFERED": "1"},
    )


def run_deadline(steps: int, step_seconds: float, faults: int) -> float:
    """Seconds a run of `steps` steps paced at `step_seconds` with `faults` failures may
    take in all before it counts as stuck: generous (a loaded 2-core machine steps
    at about a third of the pace), since the stall deadline catches a job that stops."""
    return 120.0 + steps * (3 * step_seconds + 0.5) + 60.0 * faults


class ReferenceRun:
    """The example run alone, started now, beside the cluster: the fault-free
    final-weights hash a run must end with (told to skip the batches of `skipped`, as a
    job that rolled them back did). `three_d`: the 3D example's 8 ranks
    (`MESH_3D`, `MODEL_3D`) as one gloo world on loopback, as torchrun would start them.
    A context manager that kills it on exit; it also dies with this process, whatever
    kills that."""

    def __init__(self, steps: int, *, three_d: bool = False, skipped: Sequence[int] = ()) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
        if skipped:  # the batches a job's checks rolled back and skipped: skipped here too
            env["PITSTOP_SKIP_STEPS"] = ",".join(str(step) for step in sorted(skipped))
        if not three_d:
            self._procs = [self._start(example_command(steps, 0.0), env)]
            return
        world = MESH_3D["dp"] * MESH_3D["pp"] * MESH_3D["tp"]
        mesh = {f"PITSTOP_{axis.upper()}": str(size) for axis, size in MESH_3D.items()}
        mesh.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        self._procs = []
        try:
            for rank in range(world):
                command = example3d_command(steps, log_every=0)
                self._procs.append(self._start(command, {**env, **mesh, "RANK": str(rank)}))
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            dying_with_parent(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self._procs[0].pid

    def final_hash(self, timeout: float = REFERENCE_TIMEOUT) -> str:
        """The run's final-weights hash, waiting up to `timeout` s for it to end
        (RuntimeError when it fails or takes longer; it is killed then)."""
        deadline = time.monotonic() + timeout
        outputs = []
        for proc in self._procs:
            try:
                out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise RuntimeError(
                    f"the fault-free reference run (pid {proc.pid}) did not end within "
                    f"{timeout:.0f} s"
                ) from None
            if proc.returncode != 0:
                self.stop()
                raise RuntimeError(
                    f"the fault-free reference run (pid {proc.pid}) exited {proc.returncode}"
                )
            outputs.append(out)
        hashes = {
            str(json.loads(out.strip().splitlines()[-1])["final_weights_sha256"]) for out in outputs
        }
        if len(hashes) != 1:
            raise RuntimeError(f"the fault-free reference run's ranks disagree: {sorted(hashes)}")
        return hashes.pop()

    def stop(self) -> None:
        """Kill the run if it still goes; reap it."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=STOP_TIMEOUT)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def format_event(event: common_pb2.Event) -> str:
    """One event as a line: time, kind, what it concerns, state change, reason."""
    at = dt.datetime.fromtimestamp(event.time.ToMicroseconds() / 1e6).strftime("%H:%M:%S.%f")
    who = " ".join(filter(None, [event.job_id, event.node_id]))
    change = f" {event.from_state} -> {event.to_state}" if event.to_state else ""
    reason = f": {event.reason}" if event.reason else ""
    return f"{at[:-3]} {event.kind} {who}{change}{reason}"


class JobStuck(TimeoutError):
    """The job stopped stepping, or did not end by its deadline. The message says which
    and lists the job's recent events (what the scheduler last decided and why)."""

    def __init__(self, what: str, job: jobs_pb2.Job, events: Sequence[str]) -> None:
        self.job = job
        self.events = list(events)
        state = common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
        lines = [
            f"{what}: job {job.id} is {state} at step {job.current_step}"
            + (f" ({job.reason})" if job.reason else "")
            + "; what the scheduler last decided:",
            *(f"  {line}" for line in self.events),
        ]
        super().__init__("\n".join(lines))


class Driver:
    """Submits a job, fails its nodes as its steps reach each fault, restores failed
    nodes as spares, and returns when the job ends. Use it as a context manager (or
    call :meth:`close`) to close its connections."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        on_step: Callable[[jobs_pb2.Job], None] | None = None,
        on_event: Callable[[common_pb2.Event], None] | None = None,
        on_fault: Callable[[Injected], None] | None = None,
        on_problem: Callable[[str], None] | None = None,
        seed: int = 0,
        spacing: int = 0,
        stall_timeout: float = STALL_TIMEOUT,
        poll: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        ready: Callable[[jobs_pb2.Job, Fault], bool] | None = None,
    ) -> None:
        self.cluster = cluster
        self.client = cluster.client(timeout=30.0)
        self.on_step = on_step or (lambda _job: None)
        self.on_event = on_event or (lambda _event: None)
        self.on_fault = on_fault or (lambda _injected: None)
        self.on_problem = on_problem or (lambda _message: None)
        self.random = random.Random(seed)
        self.spacing = spacing
        self.stall_timeout = stall_timeout
        self.poll = poll
        self.clock = clock
        # A fault that is due waits until this says the job is ready for it (a benchmark
        # that fails a job every few seconds waits for what a job failing every few hours
        # would have: its warm standby). It may wait for ever: the run's timeout ends it.
        self.ready = ready or (lambda _job, _fault: True)
        self.failed: list[str] = []  # nodes to bring back as spares once free
        self.problems: list[str] = []  # what went wrong beside the job (a node not back)
        self._restoring: list[threading.Thread] = []
        self._read: dict[Path, int] = {}
        self._newest = 0
        self._stepped = False  # a step line was read since the last look

    def close(self) -> None:
        """Close the scheduler connection (ends the event watch)."""
        self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def newest_step(self, job_id: str) -> int:
        """The newest step any rank has logged: the ranks' own progress, ahead of what
        the scheduler has heard (step reports travel in per-node batches)."""
        for path in self.cluster.state_dir.glob(f"nodes/*/agent/ranks/{job_id}/rank-*.log"):
            offset = self._read.get(path, 0)
            with path.open("rb") as log:
                log.seek(offset)
                chunk = log.read()
            complete = chunk.rfind(b"\n") + 1
            self._read[path] = offset + complete
            for match in STEP_LINE.finditer(chunk[:complete]):
                self._stepped = True
                self._newest = max(self._newest, int(match.group(1)))
        return self._newest

    def run(
        self, spec: jobs_pb2.JobSpec, faults: Sequence[Fault], *, timeout: float | None = None
    ) -> Run:
        """Run the job to its end with `faults`. JobStuck when it makes no step for
        `stall_timeout` s or is not over after `timeout` s (default: :func:`run_deadline`
        from the spec's --steps and --step-seconds)."""
        if timeout is None:
            timeout = run_deadline(*_pace(spec), len(faults))
        started = self.clock()
        # The code this side runs (the scenario's own tree), for the job's record.
        job = self.client.submit_job(spec, code=code_version(os.getcwd()))
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(job.id, stop), daemon=True)
        watcher.start()
        pending = sorted(faults, key=lambda f: f.at_step)
        run = Run(job)
        last_victim = ""
        last_step, progressed = -1, started
        ended = False
        try:
            while True:
                job = self.client.get_job(job.id)
                self.on_step(job)
                if job.state in TERMINAL:
                    break
                newest = self.newest_step(job.id)
                now = self.clock()
                if self._stepped or job.current_step != last_step:
                    self._stepped, last_step, progressed = False, job.current_step, now
                if now - progressed > self.stall_timeout:
                    raise self._stuck(f"no step for {now - progressed:.0f} s", job)
                if now - started > timeout:
                    raise self._stuck(f"not over after {timeout:.0f} s", job)
                stepping = job.state == common_pb2.JOB_STATE_RUNNING
                due = pending[0].at_step if pending else 0
                if run.injected:  # never two failures closer than `spacing` steps
                    due = max(due, run.injected[-1].step + self.spacing)
                if pending and stepping and newest >= due and self.ready(job, pending[0]):
                    fault = pending.pop(0)
                    nodes = sorted({a.node_id for a in job.rank_map.ranks} - {last_victim})
                    victim = self.random.choice(nodes)
                    injected = self.inject(job, fault, victim)
                    run.injected.append(injected)
                    self.on_fault(injected)
                    last_victim = victim
                if stepping:
                    self.restore_spares(job)
                time.sleep(self.poll)  # a poll of the job's step: the condition is the step
            ended = True
        finally:
            stop.set()
            # A run that ended lets the nodes coming back finish (each restart has its
            # own deadline); one that failed or was interrupted does not wait: bringing
            # the cluster down stops them.
            limit = (STOP_TIMEOUT + DEFAULT_TIMEOUT) if ended else 0.0
            deadline = time.monotonic() + limit
            for worker in self._restoring:
                worker.join(timeout=max(deadline - time.monotonic(), 0.0))
        run.job, run.seconds = job, self.clock() - started
        with contextlib.suppress(PitstopError):
            run.record = self.client.job_record(job.id)
        return run

    def recent_events(self, job_id: str, limit: int = EVENTS_SHOWN) -> list[str]:
        """The job's newest events as lines, and those of its nodes; a line saying so
        when the scheduler does not answer."""
        try:
            events = self.client.list_events(job_id=job_id, after_event_id=-1, limit=limit)
            nodes = [
                e
                for e in self.client.list_events(after_event_id=-1, limit=4 * limit)
                if e.node_id and not e.job_id
            ][-limit // 2 :]
        except PitstopError as exc:
            return [f"(the scheduler did not answer: {exc})"]
        merged = sorted({e.id: e for e in [*events, *nodes]}.values(), key=lambda e: e.id)
        return [format_event(e) for e in merged] or ["(no events)"]

    def _stuck(self, what: str, job: jobs_pb2.Job) -> JobStuck:
        return JobStuck(what, job, self.recent_events(job.id) + self.problems)

    def inject(self, job: jobs_pb2.Job, fault: Fault, node_id: str) -> Injected:
        injected = Injected(fault, node_id, time.time(), self.newest_step(job.id))
        if fault.kind == "xid":
            self.client.inject_fault(node_id, common_pb2.Fault(gpu_index=0, xid=FATAL_XID))
        elif fault.kind == "app_xid":
            self.client.inject_fault(node_id, common_pb2.Fault(gpu_index=0, xid=APPLICATION_XID))
        elif fault.kind == "node_kill":
            self.cluster.kill_node(node_id, signal.SIGKILL, wait=False)
        elif fault.kind == "agent_hang":
            agents = [p for p in self.cluster.node_processes(node_id) if p.kind == "agent"]
            if not agents:
                raise ClusterError(f"{node_id} has no agent to hang")
            os.kill(agents[0].pid, signal.SIGSTOP)
        elif fault.kind == "node_freeze":
            self.cluster.kill_node(node_id, signal.SIGSTOP, wait=False)
        else:
            pids = holding_a_rank(self.cluster.rank_pids(node_id))  # not a standby beside
            if pids:
                os.kill(min(pids), signal.SIGKILL)
        if fault.kind not in ("rank_kill", "app_xid"):  # those leave the node as it was
            self.failed.append(node_id)
        return injected

    def restore_spares(self, job: jobs_pb2.Job) -> None:
        """A failed node the job no longer uses comes back as a hot spare (in the
        background: the next failure does not wait for it)."""
        in_use = {a.node_id for a in job.rank_map.ranks}
        for node_id in [n for n in self.failed if n not in in_use]:
            self.failed.remove(node_id)
            worker = threading.Thread(target=self._bring_back, args=(node_id,), daemon=True)
            worker.start()
            self._restoring.append(worker)

    def _bring_back(self, node_id: str) -> None:
        try:
            self.cluster.kill_node(node_id, signal.SIGKILL)  # a hung agent is not thawed
            self.cluster.restart_node(node_id, wait=True)
            self.client.set_node_role(node_id, common_pb2.NODE_ROLE_SPARE, "back as a spare")
        except (ClusterError, PitstopError) as exc:
            # The run goes on with one spare fewer; the cluster going down ends up here too.
            message = f"{node_id} did not come back as a spare: {exc}"
            self.problems.append(message)
            self.on_problem(message)

    def _watch(self, job_id: str, stop: threading.Event) -> None:
        try:
            for event in self.client.watch_events():
                if stop.is_set():
                    return
                if event.job_id == job_id or event.node_id:
                    self.on_event(event)
        except Exception:  # the stream ends with the cluster; the run is judged by the job
            return


def _pace(spec: jobs_pb2.JobSpec) -> tuple[int, float]:
    """--steps and --step-seconds of an example command (defaults: 200 steps, unpaced)."""
    args = list(spec.command)

    def value(flag: str, default: str) -> str:
        return args[args.index(flag) + 1] if flag in args[:-1] else default

    try:
        return int(value("--steps", "200")), float(value("--step-seconds", "0"))
    except ValueError:
        return 200, 0.0
