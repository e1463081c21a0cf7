"""The example job: a tiny GPT trained data-parallel, bitwise reproducible.

    python -m pitstop.trainer.example --steps 200          # standalone, one process
    torchrun --nproc-per-node 2 -m pitstop.trainer.example # data-parallel, env://
    (under the pitstop agent: the same command, see examples/jobs/gpt-tiny.yaml)

At the end every rank prints the sha256 of its final weights (the bytes of every
parameter, in `named_parameters` order) and reports it as `final_weights_sha256`.

Why the result does not depend on failures, nor on the world size: the global batch of
every step is split into a fixed number of shards. Each shard's gradient is computed on
its own, with its own dropout generator seeded from (seed, step, shard), by whichever
rank owns the shard (shard s goes to rank s % world_size). The ranks all_gather the
per-shard gradients and every rank sums them in shard order, so the floating-point
additions happen in one order whatever the world size, and no reduction inside a
collective decides it. CPU kernels run single-threaded with deterministic algorithms.
The data is read through `pitstop.data`: the synthetic corpus is written once as a
token shard (`.npy`) and cut into windows of --context + 1 tokens; each epoch reads them
in a permutation fixed by (seed, epoch), and global batch b is the same slice of it at any
world size. The shards of the gradient are that batch's microbatches, and a rank reads
only its own. The cursor (the batches consumed) lives in the TrainState, so a restore
continues with the very next batch; each step line names the batch's samples (the first
16 hex digits of `SampleOrder.step_digest`).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from torch import nn

from pitstop.data import Manifest, SampleOrder, SampleReader, Windows
from pitstop.trainer import Session, TrainState
from pitstop.trainer.state import apply, capture

_TEXT = (
    "the a pit crew swaps every tire in seconds while engineers watch gauges and data "
    "cars return to the track faster than before when one node fails another spare "
    "takes its place so training never stops for long goodput counts each step saved "
    "memory holds the last snapshot and the buddy keeps a copy"
)


def make_corpus(chars: int = 16_000, seed: int = 7) -> str:
    """A deterministic text of about `chars` characters: sentences drawn from a small
    vocabulary by a linear congruential generator (independent of any library RNG)."""
    vocabulary = _TEXT.split()
    state = seed
    words: list[str] = []
    length = 0
    while length < chars:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        sentence_length = 4 + (state >> 33) % 7
        sentence = []
        for _ in range(sentence_length):
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
            sentence.append(vocabulary[(state >> 33) % len(vocabulary)])
        text = " ".join(sentence).capitalize() + ". "
        words.append(text)
        length += len(text)
    return "".join(words)


def data_digest(manifest_digest: str, **config: object) -> str:
    """The example's data version, for the job's record (`Session.record_data`): the
    digest of its token shards' manifest and the config that orders its batches (the
    seed, the window and batch shapes), which together name exactly the batches a run
    reads."""
    described = json.dumps({"manifest": manifest_digest, **config}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()


def corpus_shard(ids: list[int], folder: Path | None = None) -> Path:
    """The corpus's token ids as a `.npy` shard, written once per content (named by its
    digest) into `folder` (default: the temporary directory), whole or not at all: ranks
    starting side by side each write their own partial file and rename it."""
    tokens = np.asarray(ids, dtype=np.uint16)
    name = hashlib.sha256(tokens.tobytes()).hexdigest()[:16]
    folder = folder or Path(tempfile.gettempdir()) / "pitstop-example"
    path = folder / f"corpus-{name}.npy"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".corpus-{name}.{os.getpid()}.npy"
        with partial.open("wb") as out:
            np.save(out, tokens)
        os.replace(partial, path)
    return path


@dataclass(frozen=True)
class CorpusData:
    """The examples' corpus, read through `pitstop.data`."""

    vocab: list[str]
    """The characters of the corpus, a token id each."""
    order: SampleOrder
    reader: SampleReader
    digest: str
    """`data_digest` of its shard's manifest and the config that orders its batches."""
    source: str
    """The shard's URL."""


def corpus_data(
    context: int, global_batch: int, microbatch_size: int, seed: int, /, **config: object
) -> CorpusData:
    """The corpus `make_corpus` draws as a token shard, cut into windows of `context` + 1
    tokens and ordered by `seed` in global batches of `global_batch` windows; `config`:
    the rest of what orders the batches (named in the digest)."""
    corpus = make_corpus()
    vocab = sorted(set(corpus))
    lookup = {c: i for i, c in enumerate(vocab)}
    manifest = Manifest.build([str(corpus_shard([lookup[c] for c in corpus]))], "npy")
    windows = Windows(manifest, context)
    order = SampleOrder(windows.samples, global_batch, microbatch_size, seed)
    # A local shard is memory-mapped: no cache, and no prefetch thread ever starts.
    reader = SampleReader(windows)
    digest = data_digest(manifest.digest, seed=seed, context=context, **config)
    return CorpusData(vocab, order, reader, digest, manifest.shards[0].url)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attention = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        mixed = (attention @ v).transpose(1, 2).reshape(batch, length, dim)
        x = x + _dropout(self.proj(mixed), self.dropout, generator)
        return x + _dropout(self.out(F.gelu(self.fc(self.norm2(x)))), self.dropout, generator)


class TinyGPT(nn.Module):
    """A character-level GPT."""

    def __init__(self, vocab: int, context: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout=0.1) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token(ids) + self.position(positions)
        for block in self.blocks:
            x = block(x, generator)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def _dropout(x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Dropout drawn from an explicit generator, so which rank runs a shard (and what
    else drew from the global RNG) cannot change the mask."""
    if generator is None or p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return x.masked_fill(~keep, 0.0) / (1.0 - p)


class Job:
    """The example's model shape, data and training step."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        data = corpus_data(
            args.context,
            args.shards * args.shard_batch,
            args.shard_batch,
            args.seed,
            shards=args.shards,
            shard_batch=args.shard_batch,
        )
        self.vocab, self.order, self.reader = data.vocab, data.order, data.reader
        self.data_digest, self.data_source = data.digest, data.source
        self.samples_digest = ""
        """The last step's batch: the first 16 hex digits of its sample ids' digest."""
        self.grad_norm: torch.Tensor | None = None
        """The last step's gradient norm (before clipping)."""

    def make_state(self) -> TrainState:
        """The state at step 0: seeded, so every rank (and every restart) builds the same."""
        args = self.args
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        model = TinyGPT(len(self.vocab), args.context, args.dim, args.layers, args.heads)
        model.to(self.device)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1
        )
        return TrainState(model, optimizer, cursor={"batch": 0})

    def next_batch(self, cursor: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole of the next global batch (every shard's windows); advances `cursor`.
        For a loop that takes the batch at once (bench/torchft_train.py)."""
        batch = cursor["batch"]
        x, y = self.reader.read(self.order.step_samples(batch))
        cursor["batch"] = batch + 1
        return x.to(self.device), y.to(self.device)

    def shard_batch(self, batch: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shard `shard`'s windows of global batch `batch` (its microbatch)."""
        x, y = self.reader.read(self.order.microbatch_samples(batch, shard))
        return x.to(self.device), y.to(self.device)

    def skip_batch(self, state: TrainState) -> None:
        """Move the data position past one global batch (a rolled-back bad batch)."""
        state.cursor["batch"] += 1

    def train_step(
        self,
        state: TrainState,
        step: int,
        rank: int,
        world: int,
        waiting: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> torch.Tensor:
        """One optimizer step over the global batch, as `rank` of `world`; the mean loss
        of its shards. The gradient exchange runs inside `waiting()`; the work before it
        is paced to at least --step-seconds."""
        began = time.monotonic()
        args, model, optimizer = self.args, state.model, state.optimizer
        assert optimizer is not None
        batch = state.cursor["batch"]
        state.cursor["batch"] = batch + 1
        self.samples_digest = self.order.step_digest(batch)[:16]
        params = list(model.parameters())
        sizes = [p.numel() for p in params]
        mine = range(rank, args.shards, world)
        slots = math.ceil(args.shards / world)
        local = torch.zeros(slots, sum(sizes) + 1, device=self.device)
        for slot, shard in enumerate(mine):
            x, y = self.shard_batch(batch, shard)
            generator = torch.Generator(device=self.device)
            generator.manual_seed((args.seed * 1_000_003 + step) * 1_000_033 + shard)
            model.zero_grad(set_to_none=True)
            logits = model(x, generator)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            local[slot, :-1] = torch.cat([_grad(p).reshape(-1) for p in params])
            local[slot, -1] = loss.detach()
        if args.step_seconds > 0:  # the stand-in for a real model's GPU time
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
        gathered = [local]
        if world > 1:
            gathered = [torch.empty_like(local) for _ in range(world)]
            with waiting():
                dist.all_gather(gathered, local)
        total = gathered[0][0].clone()
        for shard in range(1, args.shards):
            total += gathered[shard % world][shard // world]
        total /= args.shards
        for param, grad in zip(params, torch.split(total[:-1], sizes), strict=True):
            param.grad = grad.view_as(param)
        self.grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(self.args, step)
        optimizer.step()
        return total[-1]


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """--lr with --warmup steps of linear warmup, then cosine decay to a tenth at
    --steps (the examples' schedule)."""
    if step <= args.warmup:
        return float(args.lr * step / args.warmup)
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return float(args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress))))


def _grad(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def weights_sha256(model: nn.Module) -> str:
    """sha256 of the bytes of every parameter, in `named_parameters` order."""
    digest = hashlib.sha256()
    for _, param in model.named_parameters():
        tensor = param.detach().to("cpu").contiguous()
        digest.update(ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    return digest.hexdigest()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's flags; --steps defaults to PITSTOP_EXAMPLE_STEPS, else 200."""
    parser = argparse.ArgumentParser(prog="python -m pitstop.trainer.example")
    parser.add_argument(
        "--steps", type=int, default=int(os.environ.get("PITSTOP_EXAMPLE_STEPS", 200))
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--shards", type=int, default=4, help="shards of the global batch")
    parser.add_argument("--shard-batch", type=int, default=4, help="sequences per shard")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--log-every", type=int, default=10, help="print every N steps; 0: never")
    parser.add_argument(
        "--save-dir",
        default="",
        help="without pitstop: torch.save a checkpoint here every --save-every steps and "
        "start from the newest one (the plain-torchrun baseline of bench/recovery.py)",
    )
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="pace each step's forward and backward (the work before the gradient exchange) "
        "to at least this long, standing in for a real model's GPU time: a simulated slow GPU "
        "stretches it (demos and fault tests use it to fail a run mid-way and to show a "
        "straggler; the weights do not change)",
    )
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=0.0,
        help="peak FLOP/s of each rank's accelerator at the training precision, for the "
        "job's MFU (e.g. 989e12: an H100 SXM in dense BF16); 0: unknown, no MFU",
    )
    return parser.parse_args(argv)


def model_flops_per_token(model: nn.Module, layers: int, dim: int, context: int) -> float:
    """Training FLOPs per token, forward and backward: 6 per weight outside the
    embeddings, plus attention's 12 x layers x dim x context (the PaLM paper's count)."""
    weights = sum(
        p.numel()
        for name, p in model.named_parameters()
        if not name.startswith(("token.", "position."))
    )
    return float(6 * weights + 12 * layers * dim * context)


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
        job = Job(args, session.device)
        # Its shard's manifest and the config that orders its batches (see data_digest).
        session.record_data(job.data_digest, source=job.data_source)
        state = session.restore(default=job.make_state)
        if args.save_dir:
            load_saved(state, Path(args.save_dir))
        session.set_flops(
            model_flops_per_token=model_flops_per_token(
                state.model, args.layers, args.dim, args.context
            ),
            peak_flops=args.peak_flops,
        )
        if args.shards < session.world_size:
            raise SystemExit(f"--shards {args.shards} is below the world size {session.world_size}")
        for step in session.steps(state, until=args.steps, skip_batch=job.skip_batch):
            with session.guard():
                loss = job.train_step(
                    state, step, session.rank, session.world_size, session.waiting
                )
                tokens = len(range(session.rank, args.shards, session.world_size))
                session.commit(
                    state,
                    loss=loss,
                    tokens=tokens * args.shard_batch * args.context,
                    grad_norm=job.grad_norm,
                )
                if args.log_every and step % args.log_every == 0:
                    at = round(time.time(), 3)  # when the step was done, for benchmarks
                    _say(
                        rank=session.rank,
                        step=step,
                        loss=round(float(loss), 4),
                        at=at,
                        samples=job.samples_digest,
                    )
            if args.save_dir and step % args.save_every == 0 and session.rank == 0:
                save(state, Path(args.save_dir))
        if not session.finished:
            _say(rank=session.rank, stopped_at=state.step)
            return 0
        digest = weights_sha256(state.model)
        session.report_result({"final_weights_sha256": digest, "steps": str(state.step)})
        _say(rank=session.rank, steps=state.step, final_weights_sha256=digest)
    return 0


def save(state: TrainState, directory: Path) -> None:
    """torch.save the whole state (as the snapshot captures it), written whole or not
    at all."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, metadata = capture(state)
    partial = directory / f".step-{state.step}.pt.partial"
    torch.save({"tensors": dict(tensors), "metadata": dict(metadata)}, partial)
    os.replace(partial, directory / "latest.pt")


def load_saved(state: TrainState, directory: Path) -> None:
    """Continue from the newest torch.save checkpoint in `directory`, if any; say the
    step it starts from (0: none saved yet, start over)."""
    path = directory / "latest.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        apply(state, saved["tensors"], saved["metadata"])
    _say(rank=int(os.environ.get("RANK", "0")), loaded_step=state.step)


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    sys.exit(main())
