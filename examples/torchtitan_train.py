"""torchtitan's Llama 3 "debugmodel" trained under pitstop: a thin launcher.

    python examples/torchtitan_train.py --steps 5                    # one process
    torchrun --nproc-per-node 2 examples/torchtitan_train.py --steps 5  # gloo, 2 ranks
    (under the pitstop agent: the same command; off-cluster the Session does nothing)

Needs, next to pitstop[trainer] (torch 2.13.0):
    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
        docstring-parser==0.18.0 typeguard==4.6.1 triton==3.9.0
--no-deps on purpose: torchtitan's declared dependencies (datasets, pyarrow, pandas,
wandb, tensorboard, ...: 45 packages, and an fsspec downgrade to datasets' <=2026.2.0)
serve the Trainer's data, metrics and checkpoint stacks, unused here; while triton,
which it imports unconditionally (models.common -> moe -> minimal_async_ep.kernels)
but does not declare, is missing from the CPU torch wheel. Hence no pyproject extra.

torchtitan's `Trainer` offers no per-step hook, and it owns the process group, the data
loader and the checkpointer, which pitstop's Session must own to snapshot, restore and
reconfigure in place. So this script builds what the Trainer would, with torchtitan's
own APIs (`model_registry("debugmodel")`, meta-device build plus `init_weights`,
`default_adamw(lr=8e-4)`, the debug config's `LRSchedulersContainer` warmup/decay
schedule, `CrossEntropyLoss` normalised by the global token count, and
`dist_utils.clip_grad_norm_` at the Trainer's max_norm of 1.0), and drives the loop
with the Session.

Attention: on CPU torchtitan's language-model backends cannot train. "flex" stops at
`torch.nn.attention.flex_attention`'s "FlexAttention does not support backward on CPU"
(torch 2.13, eager and compiled alike) and "varlen" calls `aten::_flash_attention_forward`,
which has no CPU kernel. So on CPU the debug model's inner attention is swapped for
torchtitan's own `ScaledDotProductAttention` (causal). The synthetic batches hold one
document per sequence, so causal attention is exactly the block-causal mask flex would
build. On a GPU the config's default, flex, is kept (`--attention` overrides either).

Data: deterministic synthetic token ids (arithmetic progressions modulo the vocabulary,
so the loss falls), a sample's ids drawn from a generator seeded by (seed, sample
index); the index is the cursor in the TrainState. As in pitstop.trainer.example, the
global batch is split into --shards shards; rank r computes the gradients of shards
r, r+world, ...; the ranks all_gather them and every rank sums them in shard order, so
the final weights do not depend on the world size, nor on failures and restores.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from pitstop.trainer import Session, TrainState
from pitstop.trainer.example import weights_sha256

VOCAB = 2048  # the debug model's vocabulary


def _torchtitan() -> tuple[object, ...]:
    """Import torchtitan late, so --help works without it and a missing install says how."""
    try:
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.llama3 import model_registry
    except ImportError as exc:
        raise SystemExit(
            f"torchtitan is not importable ({exc}); install it with "
            "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 "
            "docstring-parser==0.18.0 typeguard==4.6.1 triton==3.9.0"
        ) from exc
    return (
        CrossEntropyLoss,
        LRSchedulersContainer,
        default_adamw,
        dist_utils,
        ScaledDotProductAttention,
        model_registry,
    )


class Job:
    """torchtitan's debug model, optimizer, schedule and loss, and the synthetic data."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        (
            self._loss_cls,
            self._lr_cls,
            self._adamw,
            self.dist_utils,
            self._sdpa,
            self._registry,
        ) = _torchtitan()
        attention = args.attention
        if attention == "auto":
            attention = "flex" if device.type == "cuda" else "sdpa"
        self.attention = attention
        self.loss_fn = self._loss_cls.Config(global_vocab_size=VOCAB).build()  # type: ignore[attr-defined]
        self.lr_factor: Callable[[int], float] | None = None

    def make_state(self) -> TrainState:
        """The state at step 0, built as torchtitan's Trainer builds it: the model on the
        meta device, materialised, then `init_weights`; seeded, so every rank (and every
        restart) builds the same."""
        args = self.args
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        spec = self._registry(  # type: ignore[operator]
            "debugmodel", attn_backend="flex" if self.attention == "sdpa" else self.attention
        )
        config = spec.model
        if self.attention == "sdpa":
            for layer in config.layers:
                layer.attention.inner_attention = self._sdpa.Config()  # type: ignore[attr-defined]
        with torch.device("meta"):
            model = config.build()
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        optimizers = self._adamw(lr=args.lr).build(model_parts=[model])  # type: ignore[operator]
        schedulers = self._lr_cls.Config(  # type: ignore[attr-defined]
            warmup_steps=args.warmup, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ).build(optimizers=optimizers, training_steps=args.steps)
        # torchtitan's schedule is a pure function of the step (a LambdaLR lambda): it is
        # applied per step from state.step, so a restore needs no scheduler state.
        self.lr_factor = next(iter(schedulers)).lr_lambdas[0]
        if len(optimizers) != 1:
            raise SystemExit(f"expected one optimizer for the debug model, got {len(optimizers)}")
        return TrainState(model, optimizers.optimizers[0], cursor={"sample": 0})

    def sample(self, index: int) -> torch.Tensor:
        """Sample `index`: seq_len + 1 token ids, an arithmetic progression mod VOCAB."""
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + index)
        start, stride = torch.randint(0, VOCAB, (2,), generator=generator).tolist()
        positions = torch.arange(self.args.seq_len + 1)
        return (start + (1 + stride % 7) * positions) % VOCAB

    def train_step(
        self,
        state: TrainState,
        step: int,
        rank: int,
        world: int,
        waiting: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> torch.Tensor:
        """One optimizer step over the global batch as `rank` of `world`; the mean loss."""
        args, model, optimizer = self.args, state.model, state.optimizer
        assert optimizer is not None
        assert self.lr_factor is not None
        size = args.shards * args.shard_batch
        first = state.cursor["sample"]
        batch = torch.stack([self.sample(first + i) for i in range(size)]).to(self.device)
        state.cursor["sample"] = first + size
        inputs, labels = batch[:, :-1], batch[:, 1:]
        positions = torch.arange(args.seq_len, device=self.device).expand(args.shard_batch, -1)
        global_tokens = torch.tensor(labels.numel(), device=self.device)
        params = list(model.parameters())
        sizes = [p.numel() for p in params]
        slots = math.ceil(args.shards / world)
        local = torch.zeros(slots, sum(sizes) + 1, device=self.device)
        for slot, shard in enumerate(range(rank, args.shards, world)):
            rows = slice(shard * args.shard_batch, (shard + 1) * args.shard_batch)
            model.zero_grad(set_to_none=True)
            kwargs: dict[str, object] = {"positions": positions}
            if self.attention != "sdpa":
                kwargs["attention_masks"] = model.get_attention_masks(positions=positions)
            pred = model(inputs[rows], **kwargs)
            loss, _ = self.loss_fn(pred, labels[rows], global_tokens)
            loss.backward()
            local[slot, :-1] = torch.cat([_grad(p).reshape(-1) for p in params])
            local[slot, -1] = loss.detach()
        gathered = [local]
        if world > 1:
            gathered = [torch.empty_like(local) for _ in range(world)]
            with waiting():
                dist.all_gather(gathered, local)
        total = gathered[0][0].clone()
        for shard in range(1, args.shards):
            total += gathered[shard % world][shard // world]
        for param, grad in zip(params, torch.split(total[:-1], sizes), strict=True):
            param.grad = grad.view_as(param)
        self.dist_utils.clip_grad_norm_(params, 1.0, foreach=True)  # type: ignore[attr-defined]
        factor = self.lr_factor(step - 1)  # the Trainer's step s runs at last_epoch s - 1
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        optimizer.step()
        return total[-1]


def _grad(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python examples/torchtitan_train.py")
    parser.add_argument(
        "--steps", type=int, default=int(os.environ.get("PITSTOP_EXAMPLE_STEPS", 10))
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--seq-len", type=int, default=256, help="the debug config uses 2048")
    parser.add_argument("--shards", type=int, default=4, help="shards of the global batch")
    parser.add_argument("--shard-batch", type=int, default=2, help="sequences per shard")
    parser.add_argument("--lr", type=float, default=8e-4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--attention",
        choices=["auto", "sdpa", "flex", "varlen"],
        default="auto",
        help="inner attention; auto: flex on a GPU, torchtitan's SDPA module on CPU",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--log-every", type=int, default=1, help="print every N steps; 0: never")
    return parser.parse_args(argv)


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Train; print and report the final weights' hash. 0 also when stopped early."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    with Session.from_env() as session:
        job = Job(args, session.device)
        state = session.restore(default=job.make_state)
        if args.shards < session.world_size:
            raise SystemExit(f"--shards {args.shards} is below the world size {session.world_size}")
        for step in session.steps(state, until=args.steps):
            began = time.perf_counter()
            with session.guard():
                loss = job.train_step(
                    state, step, session.rank, session.world_size, session.waiting
                )
                mine = len(range(session.rank, args.shards, session.world_size))
                session.commit(state, loss=loss, tokens=mine * args.shard_batch * args.seq_len)
                if args.log_every and step % args.log_every == 0:
                    seconds = round(time.perf_counter() - began, 3)
                    _say(rank=session.rank, step=step, loss=round(float(loss), 4), s=seconds)
        if not session.finished:
            _say(rank=session.rank, stopped_at=state.step)
            return 0
        digest = weights_sha256(state.model)
        session.report_result({"final_weights_sha256": digest, "steps": str(state.step)})
        _say(rank=session.rank, steps=state.step, final_weights_sha256=digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
