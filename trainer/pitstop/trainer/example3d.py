"""The 3D example job: a small Llama-style model, tensor parallel x pipeline x FSDP2.

    torchrun --nproc-per-node 8 -m pitstop.trainer.example3d --tp 2 --pp 2   # dp = 2
    (under the pitstop agent: the same module, see examples/jobs/llama-3d.yaml)

The session's ("dp", "pp", "tp") mesh carries it all: every block's attention and MLP
are tensor parallel over "tp" (DTensor: q, k, v and the MLP's up projections split by
column, the output projections by row), the blocks are cut into `pp` pipeline stages
run with a 1F1B schedule over several microbatches (`torch.distributed.pipelining`, the
stage-to-stage activations over "pp"), and each stage is FSDP2-sharded over "dp".
The data is read through `pitstop.data`: a global batch of --microbatches microbatches
whose samples depend on the seed and the step only, microbatch m computed by replica
m mod dp (its pipeline runs its share), each microbatch's loss scaled by dp/M under
FSDP's averaging reduce, so a job that shrinks keeps its global batch, its sample order
and its schedule; the cursor (the batches consumed) is part of the state, and each step
line names its batch's samples. `make_state(mesh)` is the script's
parallelize step: the session runs it again on the new mesh after every in-place
recovery, and the step reads the model, optimizer and schedule from the state.

Deterministic (seeded, single-threaded CPU kernels, deterministic algorithms), so a run
that lost a node and recovered ends with bitwise the weights of one that did not. At the
end every rank prints and reports `final_weights_sha256`: the sha256 of every stage's
full parameters (gathered from their shards), stage by stage, the same on every rank.
gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from pitstop.trainer import Session, TrainState
from pitstop.trainer.example import corpus_data, learning_rate


class Attention(nn.Module):
    """Causal self-attention; under tensor parallelism each rank holds heads/tp heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (
            f(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        mixed = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        out: torch.Tensor = self.o(mixed.transpose(1, 2).reshape(batch, length, -1))
        return out


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    """Pre-norm Llama block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


TP_PLAN = {
    "attention.q": ColwiseParallel(),
    "attention.k": ColwiseParallel(),
    "attention.v": ColwiseParallel(),
    "attention.o": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


class Stage(nn.Module):
    """One pipeline stage: the first holds the embeddings, the last the norm and head."""

    def __init__(self, args: argparse.Namespace, vocab: int, index: int, stages: int) -> None:
        super().__init__()
        # The whole model is drawn from one seeded generator in one order on every rank,
        # so a stage's initial weights do not depend on how many stages there are.
        torch.manual_seed(args.seed)
        embedding = nn.Embedding(vocab, args.dim)
        blocks = [Block(args.dim, args.heads) for _ in range(args.layers)]
        norm, head = nn.RMSNorm(args.dim), nn.Linear(args.dim, vocab, bias=False)
        per_stage = math.ceil(args.layers / stages)
        first = index * per_stage
        self.embedding = embedding if index == 0 else None
        # Keyed by the layer's index in the whole model, as torchtitan does: every
        # parameter has one name across the stages (a DCP checkpoint of the job has no
        # two "blocks.0" of different stages).
        self.blocks = nn.ModuleDict(
            {str(first + i): block for i, block in enumerate(blocks[first : first + per_stage])}
        )
        self.norm = norm if index == stages - 1 else None
        self.head = head if index == stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


class Job:
    """The 3D example's data and state."""

    def __init__(self, args: argparse.Namespace, session: Session) -> None:
        self.args, self.session = args, session
        data = corpus_data(
            args.context,
            args.microbatches * args.microbatch_size,
            args.microbatch_size,
            args.seed,
            microbatches=args.microbatches,
            microbatch_size=args.microbatch_size,
        )
        self.vocab, self.order, self.reader = data.vocab, data.order, data.reader
        self.data_digest, self.data_source = data.digest, data.source
        self.samples_digest = ""
        """The last step's batch: the first 16 hex digits of its sample ids' digest."""

    def make_state(self, mesh: DeviceMesh) -> TrainState:
        """Build, parallelize and shard this rank's stage on `mesh`; seeded, so every
        build is the same. The session calls it again on a new generation's mesh."""
        args, shape, device = self.args, self.session.shape, self.session.device
        random.seed(args.seed)
        stage = Stage(args, len(self.vocab), shape.pp_rank, shape.pp).to(device)
        for block in stage.blocks.values():
            if shape.tp > 1:
                parallelize_module(block, mesh["tp"], TP_PLAN)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
        optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.1)
        share = self.order.replica_microbatches(shape.dp, shape.dp_rank)
        if len(share) < shape.pp:
            raise SystemExit(
                f"--microbatches {args.microbatches}: replica {shape.dp_rank} of {shape.dp} "
                f"gets {len(share)}, fewer than the {shape.pp} pipeline stages 1F1B needs; "
                f"use at least {shape.pp * shape.dp}"
            )
        # FSDP averages the replicas' gradients (divides by dp): each microbatch's loss
        # times dp/M makes their sum the global batch's mean loss's gradient at any dp.
        # The schedule must not divide by its own microbatch count on top.
        scale = self.order.averaged_loss_scale(shape.dp)
        pipeline = PipelineStage(stage, shape.pp_rank, shape.pp, device, group=mesh.get_group("pp"))
        schedule = Schedule1F1B(
            pipeline,
            n_microbatches=len(share),
            loss_fn=lambda logits, target: _loss(logits, target) * scale,
            scale_grads=False,
        )
        return TrainState(
            stage,
            optimizer,
            cursor={"batch": 0},
            objects={"schedule": schedule, "share": share, "scale": scale},
        )

    def train_step(self, state: TrainState, step: int) -> torch.Tensor:
        """One optimizer step: every microbatch through the pipeline (1F1B); the mean
        loss on the last stage, 0 elsewhere."""
        began = time.monotonic()
        shape, optimizer = self.session.shape, state.optimizer
        assert optimizer is not None
        batch = state.cursor["batch"]
        state.cursor["batch"] = batch + 1
        self.samples_digest = self.order.step_digest(batch)[:16]
        # This replica's microbatches, in order: the schedule cuts them apart again.
        samples = [
            sample
            for microbatch in state.objects["share"]
            for sample in self.order.microbatch_samples(batch, microbatch)
        ]
        x, y = self.reader.read(samples)
        x, y = x.to(self.session.device), y.to(self.session.device)
        schedule = state.objects["schedule"]
        losses: list[torch.Tensor] = []
        first, last = shape.pp_rank == 0, shape.pp_rank == shape.pp - 1
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(self.args, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.args.step_seconds > 0:  # the stand-in for a real model's GPU time
            time.sleep(max(0.0, self.args.step_seconds - (time.monotonic() - began)))
        if not losses:
            return torch.zeros(())
        scale: float = state.objects["scale"]
        return (torch.stack(losses).mean() / scale).detach()


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def weights_sha256(state: TrainState, session: Session) -> str:
    """sha256 over the stages in order of each stage's full parameters (gathered from
    their shards, in `named_parameters` order): the same on every rank. Collective."""
    digest = hashlib.sha256()
    # Gathering a TP-and-FSDP-sharded tensor warns of its two all-gathers, once a tensor.
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        for _, param in state.model.named_parameters():
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            digest.update(whole.detach().to("cpu").contiguous().numpy().tobytes())
    finally:
        redistribute.setLevel(level)
    stages: list[Any] = [None] * session.world_size
    dist.all_gather_object(stages, (session.shape.pp_rank, digest.hexdigest()))
    combined = hashlib.sha256()
    for _, stage_digest in sorted(set(stages)):
        combined.update(stage_digest.encode())
    return combined.hexdigest()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pitstop.trainer.example3d")
    parser.add_argument(
        "--steps", type=int, default=int(os.environ.get("PITSTOP_EXAMPLE_STEPS", 100))
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument(
        "--microbatches",
        type=int,
        default=8,
        help="per step over all replicas (replica r runs those m with m mod dp == r, through 1F1B)",
    )
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences each")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--log-every", type=int, default=10, help="print every N steps; 0: never")
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="pace each step to at least this long, standing in for a real model's GPU time",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Train; print and report the final weights' hash. 0 also when stopped early."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # On CUDA, deterministic algorithms refuse cuBLAS matrix products unless cuBLAS
    # keeps a fixed workspace per stream (read when its handle is made: set it first).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    with Session.from_env() as session:
        # A standby process has no group nor rank until `restore` hands it one; the ranks
        # of the job it joins checked its shape.
        standby = session.config.standby
        if not standby and not dist.is_initialized():
            raise SystemExit(
                "the 3D example needs a process group: run it under torchrun or pitstop"
            )
        if not standby and args.layers % session.shape.pp:
            raise SystemExit(
                f"--layers {args.layers} does not split into {session.shape.pp} stages"
            )
        job = Job(args, session)
        # Its shard's manifest and the config that orders its batches (example.data_digest).
        session.record_data(job.data_digest, source=job.data_source)
        state = session.restore(default=job.make_state)
        _say(rank=session.rank, shape=session.shape.sizes, coordinates=session.shape.coordinates)
        for step in session.steps(state, until=args.steps):
            with session.guard():
                loss = job.train_step(state, step)
                session.commit(state, loss=loss)
                if args.log_every and step % args.log_every == 0:
                    last = session.shape.pp_rank == session.shape.pp - 1
                    shown = round(float(loss), 4) if last else None  # the last stage's
                    at = round(time.time(), 3)  # when the step was done, for benchmarks
                    _say(
                        rank=session.rank,
                        step=step,
                        loss=shown,
                        at=at,
                        samples=job.samples_digest,
                    )
        if not session.finished:
            _say(rank=session.rank, stopped_at=state.step)
            return 0
        digest = weights_sha256(state, session)
        session.report_result({"final_weights_sha256": digest, "steps": str(state.step)})
        _say(rank=session.rank, steps=state.step, final_weights_sha256=digest)
    return 0


def _say(**fields: object) -> None:
    """One JSON line, in one write: ranks sharing a pipe (torchrun) do not split it."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
