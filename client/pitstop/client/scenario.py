"""Run the example job on a local cluster and fail its nodes on a schedule: what `make
demo` shows and what bench/recovery.py measures.

A fault is due at a step; once the job reaches it, the driver picks a node of the job
(not the one failed last) and fails it: ``xid`` injects a fatal Xid (79, fallen off the
bus) through the scheduler, ``node_kill`` is kill -9 of the node's agent, checkpoint
daemon and ranks, ``agent_hang`` stops the agent (SIGSTOP) so its heartbeats cease while
its stream stays open, and ``rank_kill`` is kill -9 of one rank. Failed nodes come back
as hot spares once the job has moved off them, so a long run can fail many times.
"""

from __future__ import annotations

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
from typing import Literal

from pitstop.client.localcluster import LocalCluster
from pitstop.v1 import common_pb2, jobs_pb2

FaultKind = Literal["xid", "node_kill", "agent_hang", "rank_kill"]
FAULT_KINDS: tuple[FaultKind, ...] = ("xid", "node_kill", "agent_hang", "rank_kill")
FATAL_XID = 79
STEP_LINE = re.compile(rb'^\{"rank": \d+, "step": (\d+), ', re.MULTILINE)
TERMINAL = (
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
)


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
        # A collective with a lost peer gives up after 5 s, not the default 30 s: the
        # example's steps take well under a second.
        env={"PYTHONUNBUFFERED": "1", "PITSTOP_COLLECTIVE_TIMEOUT": "5"},
    )


def reference_hash(steps: int) -> subprocess.Popen[str]:
    """The example run alone in one process (started now, read with `read_hash`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    return subprocess.Popen(
        [*example_command(steps, 0.0)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def read_hash(proc: subprocess.Popen[str], timeout: float = 600.0) -> str:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the reference run exited {proc.returncode}")
    return str(json.loads(out.strip().splitlines()[-1])["final_weights_sha256"])


class Driver:
    """Submits a job, fails its nodes as its steps reach each fault, restores failed
    nodes as spares, and returns when the job ends."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        on_step: Callable[[jobs_pb2.Job], None] | None = None,
        on_event: Callable[[common_pb2.Event], None] | None = None,
        on_fault: Callable[[Injected], None] | None = None,
        seed: int = 0,
        spacing: int = 0,
    ) -> None:
        self.cluster = cluster
        self.client = cluster.client(timeout=30.0)
        self.on_step = on_step or (lambda _job: None)
        self.on_event = on_event or (lambda _event: None)
        self.on_fault = on_fault or (lambda _injected: None)
        self.random = random.Random(seed)
        self.spacing = spacing
        self.failed: list[str] = []  # nodes to bring back as spares once free
        self._restoring: list[threading.Thread] = []
        self._read: dict[Path, int] = {}
        self._newest = 0

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
                self._newest = max(self._newest, int(match.group(1)))
        return self._newest

    def run(
        self, spec: jobs_pb2.JobSpec, faults: Sequence[Fault], *, timeout: float = 1800.0
    ) -> Run:
        started = time.monotonic()
        job = self.client.submit_job(spec)
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(job.id, stop), daemon=True)
        watcher.start()
        pending = sorted(faults, key=lambda f: f.at_step)
        run = Run(job)
        last_victim = ""
        try:
            while True:
                job = self.client.get_job(job.id)
                self.on_step(job)
                if job.state in TERMINAL:
                    break
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"job {job.id} did not end within {timeout:.0f} s")
                stepping = job.state == common_pb2.JOB_STATE_RUNNING
                due = pending[0].at_step if pending else 0
                if run.injected:  # never two failures closer than `spacing` steps
                    due = max(due, run.injected[-1].step + self.spacing)
                if pending and stepping and self.newest_step(job.id) >= due:
                    fault = pending.pop(0)
                    nodes = sorted({a.node_id for a in job.rank_map.ranks} - {last_victim})
                    victim = self.random.choice(nodes)
                    injected = self.inject(job, fault, victim)
                    run.injected.append(injected)
                    self.on_fault(injected)
                    last_victim = victim
                if stepping:
                    self.restore_spares(job)
                time.sleep(0.1)  # a poll of the job's step: the condition is the step
        finally:
            stop.set()
            for worker in self._restoring:
                worker.join(timeout=120)
        run.job, run.seconds = job, time.monotonic() - started
        return run

    def inject(self, job: jobs_pb2.Job, fault: Fault, node_id: str) -> Injected:
        injected = Injected(fault, node_id, time.time(), self.newest_step(job.id))
        if fault.kind == "xid":
            self.client.inject_fault(node_id, common_pb2.Fault(gpu_index=0, xid=FATAL_XID))
        elif fault.kind == "node_kill":
            self.cluster.kill_node(node_id, signal.SIGKILL, wait=False)
        elif fault.kind == "agent_hang":
            (agent,) = [p for p in self.cluster.node_processes(node_id) if p.kind == "agent"]
            os.kill(agent.pid, signal.SIGSTOP)
        else:
            pids = self.cluster.rank_pids(node_id)
            if pids:
                os.kill(min(pids), signal.SIGKILL)
        if fault.kind != "rank_kill":
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
        self.cluster.kill_node(node_id, signal.SIGKILL)  # a hung agent is not thawed
        self.cluster.restart_node(node_id, wait=True)
        self.client.set_node_role(node_id, common_pb2.NODE_ROLE_SPARE, "back as a spare")

    def _watch(self, job_id: str, stop: threading.Event) -> None:
        try:
            for event in self.client.watch_events():
                if stop.is_set():
                    return
                if event.job_id == job_id or event.node_id:
                    self.on_event(event)
        except Exception:  # the stream ends with the cluster; the run is judged by the job
            return
