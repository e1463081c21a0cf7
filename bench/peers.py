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
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pitstop.client.scenario import ReferenceRun
from pitstop.client.signals import Terminated, exit_code, orderly_exit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: bench.* from the root
from bench._peers_costs import (
    KINDS,
    by_kind,
    kinds_in_turn,
    lost_gpu_all_restart,
    lost_gpu_survivors_go_on,
    run_steps,
    summary,
)
from bench._peers_elastic import run_nvrx, run_torchrun
from bench._peers_procs import say_on_stderr
from bench._peers_torchft import run_torchft

__all__ = [  # what bench/recovery.py reads of the peers
    "KINDS",
    "RUNS",
    "by_kind",
    "kinds_in_turn",
    "lost_gpu_all_restart",
    "lost_gpu_survivors_go_on",
    "run_steps",
    "summary",
]

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
