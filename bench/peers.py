"""Peers in the same run: the example GPT job under torchft and under NVIDIA's resiliency
extension (NVRx), with the kill -9 failures of bench/recovery.py.

torchft (`run_torchft`, `pip install torchft==0.2.0`): one replica group (one process,
bench/torchft_train.py) per simulated node, a lighthouse (the `torchft_lighthouse`
binary, port 0, started as torchft's README starts it), a `torchft.Manager` over
`ProcessGroupGloo` in each replica, with the timeouts and checkpoint transport of
torchft's own train_ddp.py (the JSON's `config` says each and where it comes from).
Every --every steps one replica's process is killed (kill -9); the bench
starts it again at once, as torchx or SLURM would (torchft needs an outside supervisor),
and it heals from a peer through torchft's live checkpoint transfer while the survivors
go on. Per failure:

* total: kill -> the first step committed by a survivor in a quorum formed after the
  kill (training again without the dead replica);
* rejoin: kill -> the restarted replica's first committed step;
* lost_steps: steps whose commit failed somewhere between the kill and the later of the
  two (each runs again).

NVRx (`run_nvrx`, `pip install nvidia-resiliency-ext==0.4.1`): the example under
`ft_launcher`, one launcher per simulated node (c10d rendezvous), in-job restart: a
worker killed with kill -9 makes the launchers restart every worker, which loads the
newest torch.save checkpoint (the example's --save-dir, every --save-every steps), as
bench/recovery.py's torchrun baseline does. The workers do not use NVRx's rank monitor
client (heartbeats, sections), so its hang detection is off; a dead process is what
the launcher sees. Per failure: total (kill -> the first step after the reload), rejoin
(kill -> the killed rank's first step after it) and lost_steps (the last step before the
kill minus the step reloaded).

Each returns {"failures": [...], "seconds": wall, "hash": rank or replica 0's final
weights' hash, "hash_note": ..., "config": ...}, or {"skipped": why} when its package is
missing. A run that breaks down (a process that exits or a step that never comes)
returns the failures it completed with {"error": what}: the caller goes on with the
other systems. Both stop every process they started however they end. Alone (progress
on stderr, one JSON line on stdout, with each hash compared to a fault-free run's):

    .venv/bin/python bench/peers.py [--workers 2] [--failures 2] [--every 10] [--steps 60]
        [--step-seconds 0.1] [--skip-nvrx] [--skip-torchft] [--keep]
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
        """Kill every process still running, with its whole session; reap them."""
        for proc in self.started:
            if proc.poll() is None:
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
    rows: list[dict[str, float]],
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


# torchft -------------------------------------------------------------------------------


def run_torchft(
    *,
    workers: int,
    steps: int,
    step_seconds: float,
    failures: int,
    every: int,
    root: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The example under torchft, `workers` replica groups of one process, a kill -9 of
    one replica's process every `every` steps (`failures` times), restarted at once.
    {"failures": [{"total", "rejoin", "lost_steps"}], "seconds", "hash", "hash_note"};
    {"skipped": why} without torchft."""
    lighthouse_bin = BIN / "torchft_lighthouse"
    if not lighthouse_bin.exists():
        return {"skipped": f"no {lighthouse_bin}: pip install torchft==0.2.0 (pitstop[bench])"}
    root.mkdir(parents=True, exist_ok=True)
    say(f"torchft: {workers} replica groups, {failures} failures")
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
        rows: list[dict[str, float]] = []
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
            "restart": "the killed replica's process started again at once (torchx, SLURM)",
        }
        try:
            first = procs.wait(lambda line: "torchft_config" in line.fields, "torchft's config")
            config["replica"] = first.fields["torchft_config"]
            run_torchft_failures(procs, current, start, rows, failures, every, step_seconds, say)
            finished(procs, list(current.values()), "a torchft replica")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # recorded, not fatal
            return broke_down("torchft", exc, rows, failures, started, config, say)
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


def run_torchft_failures(
    procs: Processes,
    current: dict[int, int],
    start: Callable[[int, int], int],
    rows: list[dict[str, float]],
    failures: int,
    every: int,
    step_seconds: float,
    say: Callable[[str], None],
) -> None:
    """Kill one replica's process every `every` steps, start it again at once, and
    append each failure's row to `rows` as it completes."""
    workers = len(current)
    for index in range(failures):
        target = every * (index + 1)
        procs.wait(step_line(above=target - 1), f"torchft: step {target}")
        # Half a step on: the replicas are computing. Killed as the step line comes,
        # the victim dies before asking for its next quorum, torchft's best case
        # (the survivors wait for the quorum, no step fails).
        time.sleep(step_seconds / 2)
        victim = index % workers
        old = procs.started[current[victim]]
        killed_at = time.time()
        os.kill(old.pid, signal.SIGKILL)
        old.wait(timeout=STOP_SECONDS)
        current[victim] = start(victim, index + 1)
        survivors = {s for r, s in current.items() if r != victim}
        again = procs.wait(
            step_line(sources=survivors, quorum_after=killed_at),
            f"torchft failure {index + 1}: a survivor's step after the kill",
        )
        back = procs.wait(
            step_line(sources={current[victim]}),
            f"torchft failure {index + 1}: the restarted replica {victim}'s first step",
        )
        redone = {
            line.fields["redo_step"]
            for line in procs.between(killed_at, max(again.at, back.at))
            if "redo_step" in line.fields
        }
        rows.append(
            {
                "total": again.at - killed_at,
                "rejoin": back.at - killed_at,
                "lost_steps": float(len(redone)),
            }
        )
        say(
            f"torchft: failure {index + 1} (replica {victim}): training again after "
            f"{rows[-1]['total']:.1f} s, rejoined after {rows[-1]['rejoin']:.1f} s, "
            f"{len(redone)} steps run twice"
        )


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


# NVRx ----------------------------------------------------------------------------------


def run_nvrx(
    *,
    workers: int,
    steps: int,
    step_seconds: float,
    failures: int,
    every: int,
    root: Path,
    say: Callable[[str], None],
    save_every: int = 25,
) -> dict[str, Any]:
    """The example under NVRx's ft_launcher, `workers` launchers of one worker each, a
    kill -9 of one worker every `every` steps (`failures` times); the launchers restart
    every worker, which loads the newest checkpoint (saved every `save_every` steps).
    {"failures": [{"total", "rejoin", "lost_steps"}], "seconds", "hash", "hash_note"};
    {"skipped": why} without NVRx."""
    launcher = BIN / "ft_launcher"
    if not launcher.exists():
        return {
            "skipped": f"no {launcher}: pip install nvidia-resiliency-ext==0.4.1 (pitstop[bench])"
        }
    root.mkdir(parents=True, exist_ok=True)
    save_dir = root / "nvrx-save"
    shutil.rmtree(save_dir, ignore_errors=True)
    say(f"nvrx: {workers} ft_launchers, {failures} failures")
    started = time.monotonic()
    with processes() as procs:
        # As for bench/recovery.py's torchrun: a rendezvous store per round, else the
        # restarted workers' gloo group reads the previous round's peer addresses.
        procs.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        port = free_port()
        command = example_command(steps, step_seconds)
        command += ["--save-dir", str(save_dir), "--save-every", str(save_every)]
        agents = [
            procs.start(
                [
                    str(launcher),
                    f"--nnodes={workers}",
                    "--nproc-per-node=1",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id=bench-nvrx-{port}",
                    f"--max-restarts={failures + 5}",
                    "--monitor-interval=0.1",
                    "--ignore-missing-fault-tol-cfg",
                    *command[1:],
                ],
                root / f"nvrx-{node}.log",
            )
            for node in range(workers)
        ]
        rows: list[dict[str, float]] = []
        config = {
            "launcher": "ft_launcher, one per simulated node, --nproc-per-node=1",
            "rendezvous": "c10d",
            "max_restarts": failures + 5,
            "monitor_interval_s": 0.1,
            "restart": "in-job: every worker restarted, the newest torch.save loaded",
            "checkpoint": f"torch.save every {save_every} steps",
            "rank_monitor": "off (--ignore-missing-fault-tol-cfg)",
            "inprocess_restart": "not used",
            "local_checkpoints": "not used",
        }
        try:
            for index in range(failures):
                target = every * (index + 1)
                procs.wait(step_line(above=target - 1), f"nvrx: step {target}")
                last = max(int(line.fields.get("step", 0)) for line in procs.between(0))
                ranks = nvrx_workers(save_dir)
                if not ranks:
                    raise RuntimeError("nvrx: no worker process found to kill")
                victim_rank, victim_pid = sorted(ranks.items())[index % len(ranks)]
                seen = procs.count()
                killed_at = time.time()
                os.kill(victim_pid, signal.SIGKILL)
                loaded = procs.wait(
                    has_key("loaded_step"), f"nvrx failure {index + 1}: the workers' reload", seen
                )
                step = int(loaded.fields["loaded_step"])
                # A rank the kill did not stop may print a step after it: only the steps read
                # after the reload count.
                again = procs.wait(
                    step_line(above=step, read_after=loaded.at),
                    f"nvrx failure {index + 1}: a step after the reload",
                    seen,
                )
                back = procs.wait(
                    step_line(above=step, read_after=loaded.at, rank=victim_rank),
                    f"nvrx failure {index + 1}: rank {victim_rank}'s step after the reload",
                    seen,
                )
                rows.append(
                    {
                        "total": again.at - killed_at,
                        "rejoin": back.at - killed_at,
                        "lost_steps": float(last - step),
                    }
                )
                say(
                    f"nvrx: failure {index + 1} (rank {victim_rank}): training again after "
                    f"{rows[-1]['total']:.1f} s, {last - step} steps lost"
                )
            finished(procs, agents, "an ft_launcher")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # recorded, not fatal
            return broke_down("nvrx", exc, rows, failures, started, config, say)
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def nvrx_workers(save_dir: Path) -> dict[int, int]:
    """rank -> pid of the example's workers under this run's launchers (found by their
    save directory; a launcher's own argv names it too, but not the example module
    first)."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"ft_launcher") for arg in argv):
            continue
        if b"pitstop.trainer.example" in argv and str(save_dir).encode() in argv:
            rank = next((e[5:] for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(proc.name)
    return found


# Alone ---------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--failures", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="steps between failures")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--skip-torchft", action="store_true")
    parser.add_argument("--skip-nvrx", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pitstop-peers-"))
    runs = {"torchft": run_torchft, "nvrx": run_nvrx}
    skip = {"torchft": args.skip_torchft, "nvrx": args.skip_nvrx}
    result: dict[str, Any] = {"bench": "peers", "steps": args.steps, "workers": args.workers}
    with orderly_exit(notice=say_on_stderr):
        try:
            with ReferenceRun(args.steps) as reference:
                expected = reference.final_hash()
            for name, run in runs.items():
                if skip[name]:
                    continue
                out = run(
                    workers=args.workers,
                    steps=args.steps,
                    step_seconds=args.step_seconds,
                    failures=args.failures,
                    every=args.every,
                    root=root,
                    say=say_on_stderr,
                )
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
