"""The global sample order: which samples every training step consumes, at any dp.

A dataset is `samples` samples numbered 0..samples-1. Epoch e reads them in one
permutation fixed by (seed, e). Global step s (counted from 0: the number of optimizer
steps taken before it) is step k = s mod steps_per_epoch of epoch s // steps_per_epoch
and consumes the slice perm_e[k·B : (k+1)·B] of that permutation, B = global_batch.
steps_per_epoch = samples // B: the partial tail of each epoch's permutation (fewer than
B samples) is dropped, so every step has exactly B samples and no sample repeats within
an epoch.

The step's B samples are cut, in order, into M = B / microbatch_size microbatches.
Microbatch m goes to replica m mod dp (strided), so for every dp in 1..M the replicas'
shares together are the step's slice, shares differ by at most one microbatch, and a
replica accumulates gradients over its share. Nothing in this depends on dp except who
computes which microbatch: a job that shrinks from dp 4 to 3 consumes the same samples,
in the same order, in the same global batches.

Loss weighting. Every microbatch has the same size, so the global batch's mean loss is
the mean of the microbatch means:

    L = (1/B) Σ_i loss_i = (1/M) Σ_m L_m,        L_m = mean loss of microbatch m

A replica r backpropagates Σ_{m ∈ share(r)} L_m / M (each microbatch's loss times
`loss_scale` = 1/M, never 1/len(share)), and an all-reduce SUM of the gradients gives
∇L whatever dp is. With an all-reduce AVG (DDP's default divides by dp) use
`averaged_loss_scale(dp)` = dp/M instead.

The permutation comes from `torch.randperm` on a CPU `torch.Generator` seeded with a
63-bit number derived from sha256(seed, epoch). The CPU generator is a Mersenne Twister
and randperm's CPU algorithm does not depend on the machine, so the order is the same on
every platform for one torch version; a torch upgrade that changed randperm would change
it, which `step_digest` makes visible (compare a step's digest before and after).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

# The permutations kept: the current epoch's and, around an epoch boundary, the next
# one's (a prefetcher looks into the next epoch while the trainer finishes this one).
_CACHED_EPOCHS = 2


def _positive(name: str, value: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r}: must be an integer >= 1; {fix}")


@dataclass(frozen=True)
class SampleOrder:
    """Which samples global step `s` consumes, and which of them each replica reads.

    `samples`: the dataset's sample count. `global_batch`: samples per step (B).
    `microbatch_size`: samples per microbatch; B must be a multiple of it. `seed`: with
    the epoch, fixes each epoch's permutation. Thread-safe: a prefetch thread and the
    training loop may ask at the same time."""

    samples: int
    global_batch: int
    microbatch_size: int
    seed: int = 0
    _permutations: OrderedDict[int, npt.NDArray[np.int64]] = field(
        default_factory=OrderedDict, init=False, repr=False, compare=False
    )
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _positive("samples", self.samples, "a dataset needs at least one sample")
        _positive("global_batch", self.global_batch, "set the samples per optimizer step")
        _positive("microbatch_size", self.microbatch_size, "set the samples per forward pass")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed {self.seed!r}: must be an integer >= 0")
        if self.global_batch % self.microbatch_size:
            nearest = max(1, self.global_batch // self.microbatch_size) * self.microbatch_size
            raise ValueError(
                f"global_batch {self.global_batch}: must be a multiple of microbatch_size "
                f"{self.microbatch_size}; use a multiple (e.g. {nearest}) or a microbatch_size "
                f"that divides it"
            )
        if self.global_batch > self.samples:
            raise ValueError(
                f"global_batch {self.global_batch}: larger than the dataset's {self.samples} "
                f"samples, so an epoch would have no step; use a global_batch <= {self.samples} "
                f"or more data"
            )

    def __reduce__(self) -> tuple[type[SampleOrder], tuple[int, int, int, int]]:
        # Pickled (for a DataLoader worker, say) as its four numbers: the cache is
        # recomputed, and a lock cannot be pickled.
        return SampleOrder, (self.samples, self.global_batch, self.microbatch_size, self.seed)

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches in one epoch (the tail of fewer than B samples is dropped)."""
        return self.samples // self.global_batch

    @property
    def microbatches(self) -> int:
        """Microbatches per step (M): the most replicas a step can be split across."""
        return self.global_batch // self.microbatch_size

    @property
    def loss_scale(self) -> float:
        """1/M: multiply each microbatch's mean loss by it, then all-reduce SUM the
        gradients; the result is the gradient of the global batch's mean loss at any dp."""
        return 1.0 / self.microbatches

    def averaged_loss_scale(self, dp: int) -> float:
        """dp/M: the scale for an all-reduce that averages (divides by dp), as DDP does."""
        self._check_dp(dp)
        return dp / self.microbatches

    def replica_weight(self, dp: int, replica: int) -> float:
        """The share of the global batch that `replica` reads at `dp` (its microbatches over
        M): the weight of its local mean loss in the global mean, e.g. for logging."""
        return len(self.replica_microbatches(dp, replica)) / self.microbatches

    def epoch_of(self, step: int) -> int:
        """The epoch global step `step` falls in."""
        self._check_step(step)
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        """Epoch `epoch`'s order of all sample ids (int64, read-only). Cached per epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch {epoch!r}: must be an integer >= 0")
        with self._lock:
            cached = self._permutations.get(epoch)
            if cached is not None:
                self._permutations.move_to_end(epoch)
                return cached
            generator = torch.Generator(device="cpu").manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(self.samples, generator=generator, dtype=torch.int64).numpy()
            order.flags.writeable = False
            self._permutations[epoch] = order
            while len(self._permutations) > _CACHED_EPOCHS:
                self._permutations.popitem(last=False)
            return order

    def step_samples(self, step: int) -> list[int]:
        """The B sample ids global step `step` consumes, in order."""
        epoch = self.epoch_of(step)
        start = (step % self.steps_per_epoch) * self.global_batch
        return [int(i) for i in self.permutation(epoch)[start : start + self.global_batch]]

    def microbatch_samples(self, step: int, microbatch: int) -> list[int]:
        """The sample ids of microbatch `microbatch` (0..M-1) of global step `step`."""
        if not 0 <= microbatch < self.microbatches:
            raise ValueError(
                f"microbatch {microbatch}: must be in 0..{self.microbatches - 1} "
                f"(global_batch {self.global_batch} / microbatch_size {self.microbatch_size})"
            )
        epoch = self.epoch_of(step)
        start = (step % self.steps_per_epoch) * self.global_batch
        start += microbatch * self.microbatch_size
        return [int(i) for i in self.permutation(epoch)[start : start + self.microbatch_size]]

    def replica_microbatches(self, dp: int, replica: int) -> list[int]:
        """The microbatch indices `replica` of `dp` replicas computes at every step: those m
        with m mod dp == replica, ascending. The same at every step."""
        self._check_dp(dp)
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < dp:
            raise ValueError(f"replica {replica!r}: must be in 0..{dp - 1} for dp {dp}")
        return list(range(replica, self.microbatches, dp))

    def step_digest(self, step: int) -> str:
        """sha256 (hex) of step `step`'s sample ids as little-endian int64, in order: equal
        digests mean the same samples in the same order, whatever dp read them."""
        ids = np.asarray(self.step_samples(step), dtype="<i8")
        return hashlib.sha256(ids.tobytes()).hexdigest()

    def _check_dp(self, dp: int) -> None:
        if isinstance(dp, bool) or not isinstance(dp, int) or not 1 <= dp <= self.microbatches:
            raise ValueError(
                f"dp {dp!r}: must be in 1..{self.microbatches}, the microbatches per step "
                f"(global_batch {self.global_batch} / microbatch_size {self.microbatch_size}); "
                f"a replica with no microbatch would idle. Use fewer replicas or a smaller "
                f"microbatch_size"
            )

    def _check_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r}: must be an integer >= 0 (steps count from 0)")


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for (seed, epoch). Hashed, not seed + epoch, so that
    neighbouring seeds do not share epochs' orders (seed 1's epoch 0 would be seed 0's
    epoch 1)."""
    digest = hashlib.sha256(f"pitstop.data.order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
