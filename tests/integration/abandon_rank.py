"""A rank for the abandon test: joins a 4-rank gloo group through pitstop's
`group.form` (collective timeout 60 s), all-reduces in a loop, and reports when its
collective ended and how.

    python abandon_rank.py --rank R --world 4 --rendezvous HOST:PORT --out DIR --fault F [--cuda]

With `--fault kill`, the last rank SIGKILLs itself from a second thread while its main
thread all-reduces, after writing the time to DIR/left.json. With `--fault reconfigure`,
every rank is told of generation 2 from a second thread, as its command reader is when
a Reconfigure arrives (`group.abandon(older_than=2)`), the last rank first and the others
0.1 s apart after it; each stays alive, and writes DIR/told-R.json when told. The loop
runs inside `group.collectives()`, as a Session's step does: a rank whose abandoned
collective does not end (gloo's partly written send) exits with group.STUCK_EXIT_CODE
after the grace. Every rank whose collective ends writes DIR/rank-R.json: when
(time.time()), when it was told (null: not yet), the error and the backend.

With `--cuda` each rank computes on its own GPU (NCCL, which refuses two ranks on one
GPU) and waits for each all-reduce on the CPU, as a step that reads its loss does; an
abandon then aborts the NCCL communicator (tests/gpu/test_gpu_nccl_abandon.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pitstop.trainer import group

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
WARM_UP = 20  # all-reduces before the fault
FIRST = 0.2  # seconds into the loop: the main thread is all-reducing by then
APART = 0.1  # between two ranks told of the new generation
GRACE = group.ABANDON_GRACE  # for an abandoned collective to end before the process exits


class Fault(threading.Thread):
    """The second thread: kills this rank, or tells it of generation 2."""

    def __init__(self, fault: str, rank: int, world: int, out: Path) -> None:
        super().__init__()
        self.fault, self.rank, self.world, self.out = fault, rank, world, out
        self.started = threading.Event()
        self.told: float | None = None
        self.same_generation_shut = -1

    def run(self) -> None:
        self.started.wait()
        time.sleep(FIRST + APART * (self.world - 1 - self.rank))
        if self.fault == "kill":
            (self.out / "left.json").write_text(json.dumps({"at": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        # A command for the generation the group already runs changes nothing.
        self.same_generation_shut = group.abandon(older_than=1)
        self.told = time.time()
        (self.out / f"told-{self.rank}.json").write_text(json.dumps({"at": self.told}))
        group.abandon(older_than=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fault", choices=["kill", "reconfigure"], required=True)
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL")
    args = parser.parse_args()
    device = group.device_for(args.rank) if args.cuda else torch.device("cpu")
    group.form(
        args.rank,
        args.world,
        COLLECTIVE_TIMEOUT,
        rendezvous_address=args.rendezvous,
        device=device,
        wait=COLLECTIVE_TIMEOUT,
        generation=1,
    )
    backend = str(dist.get_backend())
    tensor = torch.ones(1 << 16, device=device)

    def all_reduce() -> None:
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    for _ in range(WARM_UP):
        all_reduce()
    fault = Fault(args.fault, args.rank, args.world, args.out)
    if args.fault == "reconfigure" or args.rank == args.world - 1:
        fault.start()
    try:
        with group.collectives(grace=GRACE):
            while True:
                fault.started.set()
                all_reduce()
    except Exception as exc:  # the collective a peer left
        ended, told = time.time(), fault.told
        error = f"{type(exc).__name__}: {exc}"[:300]
        group.abandon()  # as Session.guard does: peers still waiting hear of it
    if fault.is_alive():
        fault.join()
    record = {
        "at": ended,
        "told": told,
        "same_generation_shut": fault.same_generation_shut,
        "error": error,
        "backend": backend,
    }
    (args.out / f"rank-{args.rank}.json").write_text(json.dumps(record))
    os._exit(0)  # skip destroying a group whose peers are gone


if __name__ == "__main__":
    main()
