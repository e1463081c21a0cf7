"""Peers in the same run: the example GPT job under plain torchrun, torchft and NVIDIA's
resiliency extension (NVRx), with the two failures every system of bench/recovery.py
meets, in turn:

* ``rank_kill``: kill -9 of one rank's process (the node stays);
* ``node_silent``: a host that dies silently: every process of the node is frozen
  (SIGSTOP: no connection reset, its peers blocked on it wait). The benchmark then plays
  the cluster manager every one of these systems relies on for a lost host (torchx,
  SLURM, Kubernetes): it declares the host dead after --silent-after seconds (by
  when pitstop's own scheduler has lost a silent host, so every system gets the same), starts
  a replacement and, once the job trains at full strength again, kills the frozen
  processes (a host powered off for repair).

Per failure, from the benchmark's own clock at the failure:

* to_progress: until any rank or replica commits a training step again;
* to_full: until the job trains at full strength again (every replica, the whole world);
* lost_gpu: GPU-seconds of the job's own GPUs not doing kept work because of the
  failure. When every worker restarts (torchrun, NVRx, pitstop): every GPU from the
  failure until it trains again, plus the steps since the restore point computed again
  on every GPU (at --step-seconds each). torchft: the survivors' GPUs until their new
  quorum commits a step (a step whose commit failed lies inside that time), and the
  failed slot's until its replacement commits; a step it committed is never run again;
* lost_steps: steps computed again (torchrun, NVRx: the last step before the failure
  minus the step reloaded; torchft: steps whose commit failed).

torchrun (`run_torchrun`) and NVRx (`run_nvrx`, `pip install nvidia-resiliency-ext==
0.4.1`): the example under `torchrun` or NVRx's `ft_launcher`, one launcher per simulated
node (c10d rendezvous at its default keep-alive, --max-restarts), in-job restart: a dead
worker (or, for a silent host, a replacement launcher waiting to join) makes the
launchers restart every worker, which loads the newest torch.save checkpoint (the
example's --save-dir, every --save-every steps). NVRx's workers do not use its rank
monitor client (heartbeats, sections), nor its in-process restart or local checkpoints:
the JSON's `config` says so.

torchft (`run_torchft`, `pip install torchft==0.2.0`): one replica group (one process,
bench/torchft_train.py) per simulated node, a lighthouse (the `torchft_lighthouse`
binary, port 0, started as torchft's README starts it), a `torchft.Manager` over
`ProcessGroupGloo` in each replica, with the timeouts and checkpoint transport of
torchft's own train_ddp.py (the JSON's `config` says each and where it comes from). A
killed replica is started again at once, as torchx or SLURM would (torchft needs an
outside supervisor); it heals from a peer through torchft's live checkpoint transfer
while the survivors go on.

Every replacement here starts cold (a new Python process that imports torch); the JSON's
`config` says so. Each returns {"failures": [...], "seconds": wall, "hash": rank or
replica 0's final weights' hash, "hash_note": ..., "config": ...}, or {"skipped": why}
when its package is missing. A run that breaks down (a process that exits or a step
that never comes) returns the failures it completed with {"error": what}: the caller
goes on with the other systems. Each stops every process it started however it ends.
Alone (progress on stderr, one JSON line on stdout, with each hash compared to a
fault-free run's):

    .venv/bin/python bench/peers.py [--workers 2] [--failures 2] [--every 10]
        [--step-seconds 0.1] [--silent-after 1] [--skip torchrun|torchft|nvrx] [--keep]

(--failures of each kind; the run's steps follow from them.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from pitstop.client.scenario import ReferenceRun, example_command
from pitstop.client.signals import Terminated, dying_with_parent, exit_code, orderly_exit

BIN = Path(sys.executable).parent
TORCHFT_TRAIN = Path(__file__).with_name("torchft_train.py")
# The lighthouse as torchft's README and its SLURM example start it (`--min_replicas 1
# --quorum_tick_ms 100 --join_timeout_ms 10000`); its heartbeat timeout is its default,
# said here because it sets torchft's detection time: a replica whose heartbeat is this
# late is dead, and only then may the survivors form a quorum.
HEARTBEAT_TIMEOUT_MS = 5000
JOIN_TIMEOUT_MS = 10000
QUORUM_TICK_MS = 100
LIGHTHOUSE_SOURCE = "torchft README.md, torchft/examples/slurm/README.md"
WAIT_SECONDS = 300.0  # for any one thing the run must do (a step, a restart)
STOP_SECONDS = 10.0


def say_on_stderr(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# Processes and their output ------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One JSON line a process printed, when it was read and which process printed it."""

    at: float
    source: int  # the index of the process in Processes.started
    fields: dict[str, Any]


class Processes:
    """Every process a run starts, each dying with this one and in a session of its own;
    their JSON stdout lines gathered, stamped, in one list. `stop()` kills them all."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.started: list[subprocess.Popen[str]] = []
        self.lines: list[Line] = []
        self._cond = threading.Condition()
        self._readers: dict[int, threading.Thread] = {}

    def start(self, argv: list[str], log: Path, *, follow: bool = True) -> int:
        """Start `argv` (stderr to `log`); its index in `started`."""
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                dying_with_parent(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if follow else subprocess.DEVNULL,
                stderr=stderr,
                text=True,
                env=self.env,
                start_new_session=True,
            )
        self.started.append(proc)
        source = len(self.started) - 1
        if follow:
            reader = threading.Thread(target=self._read, args=(proc.stdout, source), daemon=True)
            reader.start()
            self._readers[source] = reader
        return source

    def exited(self, source: int) -> int:
        """Wait for the process at `source` to end and its output to be read; its exit
        code (subprocess.TimeoutExpired after WAIT_SECONDS)."""
        code = self.started[source].wait(timeout=WAIT_SECONDS)
        if source in self._readers:
            self._readers[source].join(timeout=STOP_SECONDS)
        return code

    def _read(self, stream: IO[str], source: int) -> None:
        for text in stream:
            try:
                fields = json.loads(text)
            except ValueError:
                continue
            if isinstance(fields, dict):
                with self._cond:
                    self.lines.append(Line(time.time(), source, fields))
                    self._cond.notify_all()

    def count(self) -> int:
        with self._cond:
            return len(self.lines)

    def wait(self, accept: Callable[[Line], bool], what: str, start: int = 0) -> Line:
        """The first line from index `start` on that `accept` takes, waiting up to
        WAIT_SECONDS for it (RuntimeError naming `what` when it does not come)."""
        deadline = time.monotonic() + WAIT_SECONDS
        seen = start
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if accept(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{what}: not seen within {WAIT_SECONDS:.0f} s")
                self._cond.wait(left)

    def between(self, start: float, end: float = float("inf")) -> list[Line]:
        """The lines read from `start` to `end` (wall times)."""
        with self._cond:
            return [line for line in self.lines if start <= line.at <= end]

    def stop(self) -> None:
        """Kill every process still running, with its whole session and every process
        under it (a launcher's workers lead sessions of their own; a frozen one is
        killed too); reap them."""
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    bury([child.pid for child in psutil.Process(proc.pid).children(True)])
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_SECONDS)


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    env["PYTHONUNBUFFERED"] = "1"
    procs = Processes(env)
    try:
        yield procs
    finally:
        procs.stop()


def step_line(
    *,
    above: int = 0,
    sources: Collection[int] | None = None,
    quorum_after: float = 0.0,
    read_after: float = 0.0,
    rank: int | None = None,
) -> Callable[[Line], bool]:
    """A test for a line saying a step was taken: a step over `above`, printed by one of
    `sources` (None: any) or by `rank`, of a quorum ready after `quorum_after` (torchft's
    lines say when), read after `read_after`."""

    def accept(line: Line) -> bool:
        fields = line.fields
        return (
            fields.get("step", -1) > above
            and (sources is None or line.source in sources)
            and (rank is None or fields.get("rank") == rank)
            and fields.get("quorum_at", math.inf) > quorum_after
            and line.at > read_after
        )

    return accept


def has_key(key: str) -> Callable[[Line], bool]:
    return lambda line: key in line.fields


def finished(procs: Processes, sources: list[int], what: str) -> None:
    """Wait for the processes at `sources` to exit 0 (RuntimeError else)."""
    for source in sources:
        code = procs.exited(source)
        if code != 0:
            raise RuntimeError(f"{what} (pid {procs.started[source].pid}) exited {code}")


def broke_down(
    name: str,
    exc: Exception,
    rows: list[dict[str, Any]],
    failures: int,
    started: float,
    config: dict[str, Any],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """A peer's run that broke down (a process exited, a step never came): the failures
    it completed and why it stopped, for the caller to report and go on."""
    say(f"{name}: {exc}; {len(rows)} of {failures} failures completed")
    return {
        "failures": rows,
        "seconds": time.monotonic() - started,
        "error": str(exc),
        "config": config,
    }


def final_hashes(procs: Processes, sources: dict[int, int]) -> dict[int, str]:
    """rank -> the final weights' hash printed by its process at `sources[rank]`."""
    return {
        rank: str(line.fields["final_weights_sha256"])
        for line in procs.between(0)
        for rank, source in sources.items()
        if line.source == source and "final_weights_sha256" in line.fields
    }


def hash_note(hashes: dict[int, str], workers: int) -> str:
    if len(hashes) < workers:
        return f"only ranks {sorted(hashes)} of {workers} printed a final hash"
    if len(set(hashes.values())) > 1:
        return f"the ranks ended with different weights: {hashes}"
    return f"all {workers} ended with the same weights"


# Failures and what they cost -----------------------------------------------------------

KINDS = ("rank_kill", "node_silent")
"""The failures every system meets, in turn."""


def kinds_in_turn(failures: int) -> list[str]:
    """`failures` of each kind, alternating."""
    return [KINDS[i % len(KINDS)] for i in range(len(KINDS) * failures)]


def victim_index(failure: int, workers: int) -> int:
    """Which rank or replica the `failure`-th one hits: each kind meets every one in turn."""
    return (failure // len(KINDS)) % workers


def run_steps(failures: int, every: int) -> int:
    """The steps a peer's run needs for `failures` of each kind every `every` steps,
    with room after the last (a reload may go back up to --save-every steps)."""
    return every * (len(KINDS) * failures + 1) + 60


def freeze(pid: int) -> list[int]:
    """A host dying silently: SIGSTOP `pid` (first, so it starts nothing more) and every
    process under it. The pids stopped."""
    root = psutil.Process(pid)
    root.send_signal(signal.SIGSTOP)
    stopped = [pid]
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGSTOP)
            stopped.append(child.pid)
    return stopped


def bury(pids: list[int]) -> None:
    """The dead host powered off: kill its frozen processes (SIGKILL ends a stopped one)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def lost_gpu_all_restart(
    workers: int, to_full: float, lost_steps: float, step_seconds: float
) -> float:
    """GPU-seconds lost when every worker stops and restarts: every GPU of the job from
    the failure until it trains again, then the steps since the restore point run again
    on every one."""
    return workers * (to_full + lost_steps * step_seconds)


def lost_gpu_survivors_go_on(workers: int, to_progress: float, to_full: float) -> float:
    """GPU-seconds lost when the survivors go on without the failed replica (torchft):
    theirs until their new quorum commits a step, the failed slot's until its
    replacement commits one. Committed steps are never run again."""
    return (workers - 1) * to_progress + to_full


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 0.5), 3),
        "p95": round(percentile(values, 0.95), 3),
        "max": round(max(values), 3) if values else float("nan"),
    }


def by_kind(rows: list[dict[str, Any]], kinds: Collection[str]) -> dict[str, dict[str, Any]]:
    """Per failure kind: how many, and the p50/p95/max of to_progress_s, to_full_s and
    lost_gpu_s, with the mean steps run again."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        mine = [row for row in rows if row["kind"] == kind]
        if not mine:
            continue
        out[kind] = {
            "failures": len(mine),
            "to_progress_s": summary([row["to_progress"] for row in mine]),
            "to_full_s": summary([row["to_full"] for row in mine]),
            "lost_gpu_s": summary([row["lost_gpu"] for row in mine]),
            "steps_lost_per_failure": round(sum(row["lost_steps"] for row in mine) / len(mine), 2),
        }
    return out


def silent_host_config(silent_after: float) -> str:
    return (
        f"node_silent: the node's processes frozen (SIGSTOP); the benchmark, as the "
        f"cluster manager, starts a replacement after {silent_after:g} s (when "
        f"pitstop's scheduler has lost a silent host, at the latest) and kills the "
        f"frozen processes once the job is whole again"
    )


# torchft -------------------------------------------------------------------------------


def run_torchft(
    *,
    workers: int,
    steps: int,
    step_seconds: float,
    failures: int,
    every: int,
    silent_after: float,
    root: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The example under torchft, `workers` replica groups of one process, `failures` of
    each kind (KINDS) in turn, one every `every` steps. {"failures": [rows], "seconds",
    "hash", "hash_note", "config"}; {"skipped": why} without torchft."""
    lighthouse_bin = BIN / "torchft_lighthouse"
    if not lighthouse_bin.exists():
        return {"skipped": f"no {lighthouse_bin}: pip install torchft==0.2.0 (pitstop[bench])"}
    root.mkdir(parents=True, exist_ok=True)
    say(f"torchft: {workers} replica groups, {failures} failures of each kind")
    started = time.monotonic()
    with processes() as procs:
        address = start_lighthouse(procs, lighthouse_bin, root / "torchft-lighthouse.log")
        barrier = root / "torchft-barrier"
        shutil.rmtree(barrier, ignore_errors=True)
        command = ["--steps", str(steps), "--step-seconds", str(step_seconds), "--log-every", "1"]

        def start(replica: int, generation: int) -> int:
            together = ["--barrier", str(barrier), "--replicas", str(workers)]
            argv = [sys.executable, str(TORCHFT_TRAIN), "--replica", str(replica)]
            argv += ["--lighthouse", address, *(together if generation == 0 else []), *command]
            return procs.start(argv, root / f"torchft-{replica}-{generation}.log")

        current = {replica: start(replica, 0) for replica in range(workers)}
        rows: list[dict[str, Any]] = []
        config: dict[str, Any] = {
            "replica_groups": workers,
            "processes_per_group": 1,
            "lighthouse": {
                "min_replicas": 1,
                "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                "join_timeout_ms": JOIN_TIMEOUT_MS,
                "quorum_tick_ms": QUORUM_TICK_MS,
                "source": LIGHTHOUSE_SOURCE,
            },
            "restart": "rank_kill: the killed replica's process started again at once "
            "(torchx, SLURM); it heals from a peer while the survivors go on",
            "silent_host": silent_host_config(silent_after),
            "replacement": "cold: a new process (Python, torch import, Manager)",
        }
        try:
            first = procs.wait(lambda line: "torchft_config" in line.fields, "torchft's config")
            config["replica"] = first.fields["torchft_config"]
            for index, kind in enumerate(kinds_in_turn(failures)):
                rows.append(
                    torchft_failure(
                        procs, current, start, index, kind, every, step_seconds, silent_after
                    )
                )
                row = rows[-1]
                say(
                    f"torchft: {kind} {index + 1} (replica {row['victim']}): training again "
                    f"after {row['to_progress']:.1f} s, whole again after {row['to_full']:.1f} "
                    f"s, {row['lost_gpu']:.1f} GPU-s lost, {row['lost_steps']:.0f} steps run twice"
                )
            finished(procs, list(current.values()), "a torchft replica")
        except (RuntimeError, subprocess.TimeoutExpired, psutil.Error) as exc:  # recorded
            return broke_down("torchft", exc, rows, 2 * failures, started, config, say)
        hashes = final_hashes(procs, current)
    return {
        "failures": rows,
        "seconds": time.monotonic() - started,
        "hash": hashes.get(0, ""),
        "hash_note": hash_note(hashes, workers)
        + "; the gradient exchange keeps the example's shards (an allreduce of per-shard "
        "rows), so a quorum of fewer replicas computes the same global batch",
        "config": config,
    }


def torchft_failure(
    procs: Processes,
    current: dict[int, int],
    start: Callable[[int, int], int],
    index: int,
    kind: str,
    every: int,
    step_seconds: float,
    silent_after: float,
) -> dict[str, Any]:
    """Fail one replica at step `every * (index + 1)` and follow it until the job is
    whole again: its row."""
    workers = len(current)
    target = every * (index + 1)
    procs.wait(step_line(above=target - 1), f"torchft: step {target}")
    # Half a step on: the replicas are computing. Failed as the step line comes, the
    # victim would go before asking for its next quorum, torchft's best case (the
    # survivors wait for the quorum, no step fails).
    time.sleep(step_seconds / 2)
    victim = victim_index(index, workers)
    old = procs.started[current[victim]]
    failed_at = time.time()
    frozen: list[int] = []
    if kind == "rank_kill":
        os.kill(old.pid, signal.SIGKILL)
        old.wait(timeout=STOP_SECONDS)
    else:
        frozen = freeze(old.pid)
        # The cluster manager's deadline for a silent host: a timer, not a wait on torchft.
        time.sleep(max(0.0, failed_at + silent_after - time.time()))
    current[victim] = start(victim, index + 1)
    survivors = {s for r, s in current.items() if r != victim}
    what = f"torchft {kind} {index + 1}"
    again = procs.wait(
        step_line(sources=survivors, quorum_after=failed_at),
        f"{what}: a survivor's step in a quorum formed after the failure",
    )
    back = procs.wait(
        step_line(sources={current[victim]}), f"{what}: the replacement of replica {victim}"
    )
    if frozen:
        bury(frozen)
        old.wait(timeout=STOP_SECONDS)
    redone = {
        line.fields["redo_step"]
        for line in procs.between(failed_at, max(again.at, back.at))
        if "redo_step" in line.fields
    }
    to_progress, to_full = again.at - failed_at, back.at - failed_at
    return {
        "kind": kind,
        "victim": victim,
        "to_progress": to_progress,
        "to_full": to_full,
        "lost_gpu": lost_gpu_survivors_go_on(workers, to_progress, to_full),
        "lost_steps": float(len(redone)),
    }


def start_lighthouse(procs: Processes, binary: Path, log: Path) -> str:
    """Start torchft's lighthouse on a free port; its address."""
    argv = [str(binary), "--bind", "[::]:0", "--min_replicas", "1"]
    argv += [
        f"--heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_MS}",
        f"--join_timeout_ms={JOIN_TIMEOUT_MS}",
        f"--quorum_tick_ms={QUORUM_TICK_MS}",
    ]
    procs.start(argv, log, follow=False)
    deadline = time.monotonic() + WAIT_SECONDS
    marker = "Lighthouse listening on: "
    while time.monotonic() < deadline:
        for text in log.read_text(errors="replace").splitlines():
            if marker in text:
                return text.split(marker, 1)[1].strip()
        if procs.started[-1].poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"torchft's lighthouse never said its address; see {log}")


# torchrun and NVRx: launchers that restart every worker ----------------------------------


def run_torchrun(**run: Any) -> dict[str, Any]:
    """The example under plain torchrun as a torchrun user runs it: launchers of one
    worker, in-job restart from the newest torch.save checkpoint (run_elastic's
    arguments)."""
    described = {"launcher": "torchrun, one agent per simulated node, --nproc-per-node=1"}
    return run_elastic("torchrun", BIN / "torchrun", [], described, **run)


def run_nvrx(**run: Any) -> dict[str, Any]:
    """The example under NVRx's ft_launcher (in-job restart), as torchrun's run;
    {"skipped": why} without NVRx."""
    launcher = BIN / "ft_launcher"
    if not launcher.exists():
        return {
            "skipped": f"no {launcher}: pip install nvidia-resiliency-ext==0.4.1 (pitstop[bench])"
        }
    described = {
        "launcher": "ft_launcher, one per simulated node, --nproc-per-node=1",
        "rank_monitor": "off (--ignore-missing-fault-tol-cfg)",
        "inprocess_restart": "not used",
        "local_checkpoints": "not used",
    }
    return run_elastic("nvrx", launcher, ["--ignore-missing-fault-tol-cfg"], described, **run)


RENDEZVOUS_STORE = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
while True:
    time.sleep(3600)
"""
"""A c10d store server on its own, for the launchers' rendezvous (killed with the run)."""


def run_elastic(
    name: str,
    launcher: Path,
    flags: list[str],
    described: dict[str, Any],
    *,
    workers: int,
    steps: int,
    step_seconds: float,
    failures: int,
    every: int,
    silent_after: float,
    root: Path,
    say: Callable[[str], None],
    save_every: int = 25,
) -> dict[str, Any]:
    """`workers` launchers (torchrun or ft_launcher) of one worker each, `failures` of
    each kind in turn, one every `every` steps; the launchers restart every worker, which
    loads the newest checkpoint (saved every `save_every` steps)."""
    root.mkdir(parents=True, exist_ok=True)
    save_dir = root / f"{name}-save"
    shutil.rmtree(save_dir, ignore_errors=True)
    say(f"{name}: {workers} launchers, {failures} failures of each kind")
    started = time.monotonic()
    with processes() as procs:
        # torchrun shares one TCPStore server across rendezvous rounds by default, and the
        # restarted workers' gloo group then reads the previous round's peer addresses
        # from it ("Connection refused" in connectFullMesh, or a hang). This opt-out
        # gives each round a store of its own: what a user who restarts workers needs.
        procs.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        port = free_port()
        # The rendezvous store on a host of its own, which no failure here touches: by
        # default the first launcher hosts it, and a silent death of that node would
        # take the rendezvous with it (a single point of failure a production set-up
        # avoids; etcd serves the same purpose).
        procs.start([sys.executable, "-c", RENDEZVOUS_STORE, str(port)], root / f"{name}-store.log")
        command = example_command(steps, step_seconds)
        command += ["--save-dir", str(save_dir), "--save-every", str(save_every)]
        argv = [
            str(launcher),
            f"--nnodes={workers}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=bench-{name}-{port}",
            "--rdzv-conf=is_host=false",
            f"--max-restarts={2 * failures + 5}",
            "--monitor-interval=0.1",
            *flags,
            *command[1:],
        ]
        agents = {node: procs.start(argv, root / f"{name}-{node}.log") for node in range(workers)}
        rows: list[dict[str, Any]] = []
        config = {
            **described,
            "rendezvous": "c10d at its default keep-alive, its store on a host of its own "
            "(is_host=false on every launcher); the workers' store apart "
            "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE)",
            "max_restarts": 2 * failures + 5,
            "monitor_interval_s": 0.1,
            "restart": "in-job: every worker restarted, the newest torch.save loaded",
            "checkpoint": f"torch.save every {save_every} steps",
            "silent_host": silent_host_config(silent_after),
            "replacement": "cold: new worker processes (Python, torch import, process group)",
        }
        try:
            for index, kind in enumerate(kinds_in_turn(failures)):
                rows.append(
                    elastic_failure(
                        procs,
                        agents,
                        argv,
                        save_dir,
                        index,
                        kind,
                        every,
                        step_seconds,
                        silent_after,
                        root / f"{name}-{{node}}-{index}.log",
                    )
                )
                row = rows[-1]
                say(
                    f"{name}: {kind} {index + 1} (rank {row['victim']}): training again "
                    f"after {row['to_progress']:.1f} s, whole after {row['to_full']:.1f} s, "
                    f"{row['lost_steps']:.0f} steps lost, {row['lost_gpu']:.1f} GPU-s"
                )
            finished(procs, list(agents.values()), f"a {launcher.name}")
        except (RuntimeError, subprocess.TimeoutExpired, psutil.Error) as exc:  # recorded
            return broke_down(name, exc, rows, 2 * failures, started, config, say)
        hashes = {
            int(line.fields["rank"]): str(line.fields["final_weights_sha256"])
            for line in procs.between(0)
            if "final_weights_sha256" in line.fields
        }
    return {
        "failures": rows,
        "seconds": time.monotonic() - started,
        "hash": hashes.get(0, ""),
        "hash_note": hash_note(hashes, workers),
        "config": config,
    }


def elastic_failure(
    procs: Processes,
    agents: dict[int, int],
    argv: list[str],
    save_dir: Path,
    index: int,
    kind: str,
    every: int,
    step_seconds: float,
    silent_after: float,
    log: Path,
) -> dict[str, Any]:
    """Fail one worker (rank_kill) or its whole node (node_silent: its launcher and
    worker frozen, a replacement launcher started after `silent_after`) at step
    `every * (index + 1)`, and follow it until every rank steps after the reload."""
    workers = len(agents)
    target = every * (index + 1)
    procs.wait(step_line(above=target - 1), f"step {target}")
    last = max(int(line.fields.get("step", 0)) for line in procs.between(0))
    ranks = elastic_workers(save_dir)
    if len(ranks) < workers:
        raise RuntimeError(f"only ranks {sorted(ranks)} of {workers} found to fail")
    victim = victim_index(index, workers)
    seen = procs.count()
    failed_at = time.time()
    frozen: list[int] = []
    dead: subprocess.Popen[str] | None = None  # a frozen node's launcher
    if kind == "rank_kill":
        os.kill(ranks[victim], signal.SIGKILL)
    else:
        agent = psutil.Process(ranks[victim]).ppid()
        node = next(n for n, s in agents.items() if procs.started[s].pid == agent)
        frozen = freeze(agent)
        # The cluster manager's deadline for a silent host: a timer, not a wait on the peer.
        time.sleep(max(0.0, failed_at + silent_after - time.time()))
        dead = procs.started[agents[node]]
        agents[node] = procs.start(argv, Path(str(log).replace("{node}", str(node))))
    what = f"{kind} {index + 1}"
    loaded = procs.wait(has_key("loaded_step"), f"{what}: the workers' reload", seen)
    step = int(loaded.fields["loaded_step"])
    # A rank the failure did not stop may print a step after it: only the steps read
    # after the reload count.
    firsts = [
        procs.wait(
            step_line(above=step, read_after=loaded.at, rank=rank),
            f"{what}: rank {rank}'s step after the reload",
            seen,
        ).at
        for rank in range(workers)
    ]
    bury(frozen)
    if dead is not None:
        dead.wait(timeout=STOP_SECONDS)
    to_progress, to_full = min(firsts) - failed_at, max(firsts) - failed_at
    return {
        "kind": kind,
        "victim": victim,
        "to_progress": to_progress,
        "to_full": to_full,
        "lost_gpu": lost_gpu_all_restart(workers, to_full, last - step, step_seconds),
        "lost_steps": float(last - step),
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def elastic_workers(save_dir: Path) -> dict[int, int]:
    """rank -> pid of the example's workers under this run's launchers (found by their
    save directory; a launcher's own argv names it too, but not the example module
    first), frozen ones left out."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if any(arg.endswith((b"ft_launcher", b"torchrun")) for arg in argv):
            continue
        if stat.rsplit(")", 1)[-1].split()[0] == "T":  # stopped: a frozen host's
            continue
        if b"pitstop.trainer.example" in argv and str(save_dir).encode() in argv:
            rank = next((e[5:] for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(proc.name)
    return found


# Alone ---------------------------------------------------------------------------------


RUNS: dict[str, Callable[..., dict[str, Any]]] = {
    "torchrun": run_torchrun,
    "torchft": run_torchft,
    "nvrx": run_nvrx,
}
"""Each peer's run, in the order bench/recovery.py runs them."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--failures", type=int, default=1, help="failures of each kind")
    parser.add_argument("--every", type=int, default=10, help="steps between failures")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument(
        "--silent-after",
        type=float,
        default=1.0,
        help="seconds until the cluster manager replaces a silent host (default: when the "
        "local cluster's scheduler has lost one at the latest, 0.5 s of keepalive + 0.5 s)",
    )
    parser.add_argument("--skip", action="append", default=[], choices=tuple(RUNS))
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pitstop-peers-"))
    steps = run_steps(args.failures, args.every)
    result: dict[str, Any] = {"bench": "peers", "steps": steps, "workers": args.workers}
    with orderly_exit(notice=say_on_stderr):
        try:
            with ReferenceRun(steps) as reference:
                expected = reference.final_hash()
            for name, run in RUNS.items():
                if name in args.skip:
                    continue
                out = run(
                    workers=args.workers,
                    steps=steps,
                    step_seconds=args.step_seconds,
                    failures=args.failures,
                    every=args.every,
                    silent_after=args.silent_after,
                    root=root / name,
                    say=say_on_stderr,
                )
                if "failures" in out:
                    out["by_kind"] = by_kind(out["failures"], KINDS)
                if "hash" in out:
                    out["hash_equal"] = out["hash"] == expected
                result[name] = out
        except (KeyboardInterrupt, Terminated) as stop:
            say_on_stderr(f"{'Ctrl-C' if isinstance(stop, KeyboardInterrupt) else stop}: stopped")
            return exit_code(stop)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            say_on_stderr(f"error: {exc}")
            return 1
        finally:
            if args.keep:
                say_on_stderr(f"kept {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
