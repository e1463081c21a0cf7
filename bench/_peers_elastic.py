"""bench/peers.py's torchrun and NVRx runs: launchers that restart every worker from the
newest torch.save checkpoint after a failure."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench._peers_costs import (
    bury,
    freeze,
    kinds_in_turn,
    lost_gpu_all_restart,
    silent_host_config,
    victim_index,
)
from bench._peers_procs import (
    BIN,
    STOP_SECONDS,
    Processes,
    broke_down,
    finished,
    has_key,
    hash_note,
    processes,
    step_line,
)
from pitstop.client.scenario import example_command

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
