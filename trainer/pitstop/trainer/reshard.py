"""Sharded state onto another mesh: the snapshots of the old ranks, cut to this rank's
new shards.

When a job shrinks by one data-parallel replica, every FSDP-sharded tensor is split
over fewer ranks, so a surviving rank's new local shard is a larger piece of the whole
tensor than the one it snapshotted: its own old piece and the lost replica's. Every
snapshot says where each local shard sat in the whole tensor ("pitstop.dtensor": global
shape, offset, local shape), so the new shard is assembled by copying, from each old
rank's snapshot at the restore step, the part that overlaps where this rank's shard now
sits. Model parameters and optimizer state (Adam's moments, sharded like their
parameter) come back exactly: the whole tensors are the ones snapshotted, only cut
differently. What is not sharded (the step, the RNG, the data loader's position, the
optimizer's hyperparameters) comes from one old rank's snapshot, `own`: a surviving
rank's own.

Only the data-parallel size may differ: tensor- and pipeline-parallel sizes are kept by
a shrink, and a tensor's pieces are looked for among the old ranks at this rank's
(pp, tp) coordinates.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pitstop.trainer.state import DTENSOR_KEY, SHAPE_KEY, Flat, StateFormatError, TrainState

Snapshot = tuple[Mapping[str, torch.Tensor], Mapping[str, str]]


def reshard(
    state: TrainState, own: Snapshot, sources: Sequence[Snapshot]
) -> tuple[Flat, dict[str, str]]:
    """A flat state in `state`'s current sharding, for `apply`: each sharded tensor of
    `own` assembled from the pieces `sources` hold (`own` among them or not); every other
    entry as `own` has it. Raises StateFormatError when a piece is missing or a tensor
    does not fit this rank's model."""
    own_tensors, own_metadata = own
    described = _described(own_metadata)
    targets = _targets(state)
    placed = [(tensors, _described(metadata)) for tensors, metadata in sources]
    out: Flat = {k: v for k, v in own_tensors.items() if k not in described}
    for name, where in described.items():
        target = targets.get(_owner(name))
        if target is None:
            raise StateFormatError(
                f"{name} is sharded in the snapshot but this rank's state has no sharded "
                "tensor of that name; restore with the model the snapshot was taken of"
            )
        shape, offset, local = target
        if list(shape) != list(where["shape"]):
            raise StateFormatError(
                f"{name}: the snapshot's whole tensor is {tuple(where['shape'])}, this "
                f"model's is {tuple(shape)}; only the data-parallel sharding may change"
            )
        out[name] = _assemble(name, own_tensors[name].dtype, offset, local, placed)
    metadata = {k: v for k, v in own_metadata.items() if k not in (DTENSOR_KEY, SHAPE_KEY)}
    return out, metadata


def _owner(name: str) -> str:
    """The key of `name` in `_targets`: an optimizer state tensor is its parameter's."""
    if name.startswith("optim.state."):
        return "optim.state." + name.removeprefix("optim.state.").partition(".")[0] + "."
    return name


def _described(metadata: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    try:
        described: dict[str, dict[str, Any]] = json.loads(metadata.get(DTENSOR_KEY) or "{}")
    except ValueError as exc:
        raise StateFormatError(f"{DTENSOR_KEY} in the snapshot is not JSON: {exc}") from exc
    return described


def _targets(state: TrainState) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Flat name -> (global shape, offset, local shape) of this rank's sharded tensors
    on its current mesh: the model's, and each sharded parameter's optimizer state
    (which an optimizer built afresh does not hold yet, so it is the parameter's)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def where(value: DTensor) -> tuple[list[int], list[int], list[int]]:
        local, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return list(value.shape), [int(o) for o in offset], [int(n) for n in local]

    targets = {
        f"model.{k}": where(v)
        for k, v in state.model.state_dict(keep_vars=True).items()
        if isinstance(v, DTensor)
    }
    if state.optimizer is not None:
        params = [p for group in state.optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            if isinstance(param, DTensor):
                targets[f"optim.state.{index}."] = where(param)
    return targets


def _assemble(
    name: str,
    dtype: torch.dtype,
    offset: Sequence[int],
    local: Sequence[int],
    placed: Sequence[tuple[Mapping[str, torch.Tensor], dict[str, dict[str, Any]]]],
) -> torch.Tensor:
    """This rank's shard of `name` (at `offset`, of shape `local`), copied from the
    parts of the sources' shards that overlap it; every element must be covered."""
    out = torch.empty(tuple(local), dtype=dtype)
    covered = torch.zeros(tuple(local), dtype=torch.bool)
    for tensors, described in placed:
        where = described.get(name)
        if where is None or name not in tensors:
            continue
        into, come_from = [], []
        for mine, size, theirs, their_size in zip(
            offset, local, where["offset"], where["local"], strict=True
        ):
            low, high = max(mine, theirs), min(mine + size, theirs + their_size)
            if high <= low:
                break
            into.append(slice(low - mine, high - mine))
            come_from.append(slice(low - theirs, high - theirs))
        else:
            out[tuple(into)] = tensors[name].reshape(where["local"])[tuple(come_from)]
            covered[tuple(into)] = True
    if math.prod(local) and not bool(covered.all()):
        raise StateFormatError(
            f"{name}: the snapshots read cover {int(covered.sum())} of the "
            f"{math.prod(local)} elements of this rank's shard; a rank's snapshot of the "
            "restore step is missing"
        )
    return out
