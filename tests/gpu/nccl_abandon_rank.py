"""A rank for the NCCL abandon check: joins a 2-rank group through pitstop's `group.form`
on its own GPU (NCCL; collective timeout 60 s), all-reduces in a loop and waits for each
all-reduce on the CPU, as a training step that reads its loss does, and reports when its
collective ended and how.

    python nccl_abandon_rank.py --rank R --world 2 --rendezvous HOST:PORT --out DIR

Every rank is told of generation 2 from a second thread, as its command reader is when a
Reconfigure arrives (`group.abandon(older_than=2)`: on NCCL, the communicator's abort),
the last rank first and the others 0.1 s apart after it. The first told leaves its
all-reduce; its peer is then blocked in one that will never complete, until it is told
in turn. Each writes DIR/told-R.json when told, and DIR/rank-R.json when its collective
ended: when (time.time()), when it was told, the error. The loop runs inside
`group.collectives()`, as a Session's step does: a rank whose abandoned collective does
not end exits with group.STUCK_EXIT_CODE after the grace.

Without a GPU (no CUDA) the same script runs on gloo and the CPU, which is how its own
logic is tried on a machine without GPUs; the check runs it on NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pitstop.trainer import group

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
WARM_UP = 20  # all-reduces before anyone is told
FIRST = 0.5  # seconds into the loop: the main thread is all-reducing by then
APART = 0.1  # between two ranks told of the new generation
GRACE = group.ABANDON_GRACE


class Told(threading.Thread):
    """The second thread: tells this rank of generation 2."""

    def __init__(self, rank: int, world: int, out: Path) -> None:
        super().__init__()
        self.rank, self.world, self.out = rank, world, out
        self.started = threading.Event()
        self.told: float | None = None

    def run(self) -> None:
        self.started.wait()
        time.sleep(FIRST + APART * (self.world - 1 - self.rank))  # the schedule of the check
        self.told = time.time()
        (self.out / f"told-{self.rank}.json").write_text(json.dumps({"at": self.told}))
        group.abandon(older_than=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = group.device_for(args.rank)  # one GPU per rank, as NCCL requires
    group.form(
        args.rank,
        args.world,
        COLLECTIVE_TIMEOUT,
        rendezvous_address=args.rendezvous,
        device=device,
        wait=COLLECTIVE_TIMEOUT,
        generation=1,
    )
    tensor = torch.ones(1 << 20, device=device)

    def all_reduce() -> None:
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the CPU waits, as for a loss

    for _ in range(WARM_UP):
        all_reduce()
    told = Told(args.rank, args.world, args.out)
    told.start()
    error = ""
    try:
        with group.collectives(grace=GRACE):
            while True:
                told.started.set()
                all_reduce()
    except Exception as exc:  # the collective abandoned, here or by the peer
        ended = time.time()
        error = f"{type(exc).__name__}: {exc}"[:300]
        group.abandon()  # as Session.guard does
    told.join()
    record = {"at": ended, "told": told.told, "error": error, "backend": group.backend()}
    (args.out / f"rank-{args.rank}.json").write_text(json.dumps(record))
    os._exit(0)  # skip destroying a group whose peer is gone


if __name__ == "__main__":
    main()
