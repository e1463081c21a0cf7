"""The example GPT job as one torchft replica group (one process), for bench/peers.py.

    python bench/torchft_train.py --replica 0 --lighthouse http://host:port \
        [--barrier DIR --replicas N] --steps 200 --step-seconds 0.1

The model, data, seed, dropout generators, learning rate and step pacing are the
example's (`pitstop.trainer.example`); only the gradient exchange is torchft's. To keep
the example's numerics whatever the quorum, the global batch stays split into --shards
shards: shard s is computed by the replica of quorum rank s % participants, each replica
writes its shards' gradients (and losses) into its row of a zero [shards, n + 1] tensor,
the Manager allreduces it with SUM (each element then has one non-zero addend), and every
replica sums the rows in shard order as the example does. A replica that joins late or
restarts heals from a peer through torchft's live checkpoint transfer: model, optimizer
and data cursor.

One JSON line per committed step, `{"rank": replica, "step": s, "loss": ...,
"participants": n, "quorum_at": t}` (t: the wall time the step's quorum was ready); one
`{"rank": replica, "redo_step": s, ...}` per step whose commit failed (run again); and at
the end `{"rank": replica, "steps": s, "final_weights_sha256": ...}`, the hash computed as
the example computes it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from torch.distributed import ReduceOp, TCPStore  # type: ignore[attr-defined]

# torchft ships no type information, and the dev environment does not install it.
from torchft import Manager  # type: ignore[import-untyped, import-not-found, unused-ignore]
from torchft.checkpointing.pg_transport import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    PGTransport,
)
from torchft.process_group import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    ProcessGroupGloo,
)

from pitstop.trainer import TrainState
from pitstop.trainer.example import Job, learning_rate, parse_args, weights_sha256

# As torchft's own train_ddp.py sets them for gloo on the CPU (torchft at v0.2.0 and
# main): the process group's collectives time out after 5 s, the Manager's operations
# after 30 s, the live checkpoint moves over the process group (PGTransport, 10 s); the
# quorum's timeout is the Manager's default (60 s), longer than the lighthouse's
# heartbeat timeout, so a quorum that waits out a dead replica does not time out itself.
PG_TIMEOUT = timedelta(seconds=5)
MANAGER_TIMEOUT = timedelta(seconds=30)
TRANSPORT_TIMEOUT = timedelta(seconds=10)
QUORUM_TIMEOUT = timedelta(seconds=60)
SOURCE = "torchft train_ddp.py (ProcessGroupGloo, Manager, PGTransport for the CPU)"
CONFIG = {
    "process_group": f"ProcessGroupGloo(timeout={PG_TIMEOUT.total_seconds():g} s)",
    "manager_timeout_s": MANAGER_TIMEOUT.total_seconds(),
    "quorum_timeout_s": QUORUM_TIMEOUT.total_seconds(),
    "checkpoint_transport": f"PGTransport(timeout={TRANSPORT_TIMEOUT.total_seconds():g} s)",
    "min_replica_size": 1,
    "use_async_quorum": False,
    "source": SOURCE,
    "differs_from_source": "use_async_quorum=False: a step must know its quorum before "
    "it computes, to keep the example's global batch whatever the quorum",
}
"""What bench/peers.py reports as torchft's settings."""
BARRIER_TIMEOUT = 300.0


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(prog="bench/torchft_train.py", add_help=False)
    own.add_argument("--replica", type=int, required=True, help="this replica group's index")
    own.add_argument("--lighthouse", required=True, help="the lighthouse's address")
    own.add_argument("--barrier", default="", help="wait here for --replicas peers at start")
    own.add_argument("--replicas", type=int, default=1)
    mine, rest = own.parse_known_args(argv)
    args = parse_args(rest)  # the example's own flags: --steps, --step-seconds, ...
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    job = Job(args, torch.device("cpu"))
    state = job.make_state()
    optimizer = state.optimizer
    assert optimizer is not None

    def state_dict() -> dict[str, Any]:
        return {
            "model": state.model.state_dict(),
            "optim": optimizer.state_dict(),
            "cursor": dict(state.cursor),
        }

    def load_state_dict(saved: dict[str, Any]) -> None:
        state.model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        state.cursor = dict(saved["cursor"])

    # Each replica group is one process: its own TCPStore, rank 0 of world 1.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=PG_TIMEOUT)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        # Quorum and healing before the step's compute: the step must know its quorum
        # rank to know its shards.
        use_async_quorum=False,
        timeout=MANAGER_TIMEOUT,
        quorum_timeout=QUORUM_TIMEOUT,
        checkpoint_transport=PGTransport(pg, timeout=TRANSPORT_TIMEOUT, device=torch.device("cpu")),
        # Every replica builds the same seeded weights; a late one heals from a peer.
        init_sync=False,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=mine.lighthouse,
        replica_id=f"replica_{mine.replica}",
        hostname="localhost",
    )
    say(rank=mine.replica, torchft_config=CONFIG)
    try:
        if mine.barrier:
            wait_for_peers(Path(mine.barrier), mine.replica, mine.replicas)
        while manager.current_step() < args.steps:
            train_step(job, state, manager, mine.replica)
        digest = weights_sha256(state.model)
        say(rank=mine.replica, steps=manager.current_step(), final_weights_sha256=digest)
    finally:
        manager.shutdown(wait=False)
    return 0


def train_step(job: Job, state: TrainState, manager: Any, replica: int) -> None:
    """One attempt at the next step: computed on this replica's shards of the quorum,
    allreduced, applied only if the Manager commits it (else the data cursor goes back
    and the same step runs again)."""
    began = time.monotonic()
    args, model, optimizer = job.args, state.model, state.optimizer
    assert optimizer is not None
    manager.start_quorum()
    quorum_at = time.time()
    step = manager.current_step() + 1
    rank, world = manager.participating_rank(), manager.num_participants()
    cursor = dict(state.cursor)
    x, y = job.next_batch(cursor)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    rows = torch.zeros(args.shards, sum(sizes) + 1)
    for shard in range(rank, args.shards, world) if rank is not None else ():
        batch = slice(shard * args.shard_batch, (shard + 1) * args.shard_batch)
        generator = torch.Generator()
        generator.manual_seed((args.seed * 1_000_003 + step) * 1_000_033 + shard)
        model.zero_grad(set_to_none=True)
        logits = model(x[batch], generator)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[batch].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        rows[shard, :-1] = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        rows[shard, -1] = loss.detach()
    if args.step_seconds > 0:  # the example's stand-in for a real model's GPU time
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
    manager.allreduce(rows, reduce_op=ReduceOp.SUM).wait()
    if not manager.should_commit():
        say(rank=replica, redo_step=step, participants=world, quorum_at=quorum_at)
        return
    total = rows[0].clone()
    for shard in range(1, args.shards):
        total += rows[shard]
    total /= args.shards
    for param, grad in zip(params, torch.split(total[:-1], sizes), strict=True):
        param.grad = grad.view_as(param)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(job.args, step)
    optimizer.step()
    state.cursor = cursor
    loss_value = round(float(total[-1]), 4)
    say(rank=replica, step=step, loss=loss_value, participants=world, quorum_at=quorum_at)


def wait_for_peers(directory: Path, replica: int, replicas: int) -> None:
    """Start training together: a replica that asked for a quorum alone would train
    alone (the lighthouse needs only one replica) and the others would heal from it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / str(replica)).touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while sum(1 for _ in directory.iterdir()) < replicas:
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {replica}: {replicas} replicas never all started")
        time.sleep(0.05)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    sys.exit(main())
