"""A rank's whole training state as a flat mapping of tensors plus string metadata.

`capture` turns a `TrainState` into what a checkpointd shard holds; `apply` puts such a
mapping back into a live `TrainState`, in place, so the script's references to its
model and optimizer stay valid. Nothing is pickled: tensors travel as raw bytes and
the few non-tensor values (optimizer hyperparameters, python's RNG version) as JSON.

Flat names:
    model.<state_dict key>           parameters and buffers
    optim.state.<param id>.<key>     optimizer state tensors (Adam moments, step, ...)
    optim.group.<i>.<key>            tensor-valued hyperparameters (rare)
    rng.python                       int64[625]: python `random`'s Mersenne Twister words
    rng.torch                        uint8: torch's CPU generator
    rng.cuda.<device>                uint8: each CUDA generator, when CUDA is in use
    cursor.<name>                    int64 scalars: the data loader's position
    loader.<name>.<path>             tensors in a stateful loader's state_dict (its RNG)
    extra.<name>                     the script's own tensors
    step                             int64 scalar: steps completed
Metadata: "pitstop.optim" (JSON of the optimizer's param groups and non-tensor state),
"pitstop.rng.python" (JSON of the MT version and gauss_next), "pitstop.loader.<name>"
(JSON of a loader's state_dict), "pitstop.dtensor" (see below), "user.<key>".

Sharded state. A DTensor (FSDP2's `fully_shard`, tensor parallel's
`parallelize_module`, their optimizer state) is kept as this rank's local shard, the
bytes it holds, and "pitstop.dtensor" maps its flat name to where the shard sits in the
whole tensor: {"shape": global shape, "offset": the shard's global offset, "local":
its shape, "placements": [str], "mesh": [dim names], "dtype"}. That is enough to put a
shard back into a model sharded the same way (in place, bitwise), and for a checkpoint
reader (DCP) to assemble or reshard the whole tensor from every rank's shards.

`capture` returns the live tensors, not copies: the snapshot is the copy, and it is
taken before anything changes them again.
"""

from __future__ import annotations

import array
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

Flat = dict[str, torch.Tensor]

DTENSOR_KEY = "pitstop.dtensor"
"""Metadata: where each sharded tensor's local shard sits in the whole tensor."""
SHAPE_KEY = "pitstop.shape"
"""Metadata the session adds to a snapshot: the job's dp, pp, tp and the rank's
coordinates when it was taken, as JSON (see `pitstop.trainer.reshard`)."""


@dataclass
class TrainState:
    """Everything a rank needs to continue bitwise where it left off.

    `cursor` is the data loader's position as named integers (e.g. epoch, index); the
    loader reads it and the training step advances it. `step` counts completed steps.
    `tensors` holds any further tensors the script wants kept (restored in place).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    cursor: dict[str, int] = field(default_factory=dict)
    step: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    loaders: dict[str, Any] = field(default_factory=dict)
    """Data loaders with `state_dict()`/`load_state_dict()` (torchdata's
    StatefulDataLoader): their position and RNG are part of the state, so a restored
    rank continues with the very next batch."""
    objects: dict[str, Any] = field(default_factory=dict)
    """Whatever else the script built with the state and needs again after it is
    rebuilt on a new mesh (a pipeline schedule, a loss function); never captured."""
    _batches: dict[str, Iterator[Any]] = field(default_factory=dict, repr=False, compare=False)

    def next_batch(self, loader: str = "train") -> Any:
        """The next batch of `loaders[loader]`, a new epoch when one ends. After a restore
        it is the batch after the restored step's (an iterator taken before would not
        know of the restore)."""
        batches = self._batches.get(loader)
        if batches is None:
            batches = self._batches[loader] = iter(self.loaders[loader])
        try:
            return next(batches)
        except StopIteration:
            batches = self._batches[loader] = iter(self.loaders[loader])
            return next(batches)


class StateFormatError(ValueError):
    """A flat mapping that does not fit the live state (another model, a missing key)."""


class Capturer:
    """`capture` for a training loop: the flat names, which do not change from step to
    step, are worked out once, so a snapshot's bookkeeping stays a small fraction of
    the copy itself."""

    def __init__(self) -> None:
        self._names: dict[tuple[str, object, str], str] = {}
        self._optim_names: dict[int, dict[str, str]] = {}
        self._shards: dict[tuple[object, ...], dict[str, Any]] = {}
        self._shards_json: tuple[list[tuple[object, ...]], str] = ([], "")
        self.behind: frozenset[str] = frozenset()
        """Of the last capture's names, those only `state.optimizer.step()` changes: the
        parameters it updates and its state. A snapshot may copy them while the next
        step's forward and backward run (`SnapshotWriter.snapshot`'s `behind`)."""

    def __call__(
        self, state: TrainState, *, with_cuda_rng: bool | None = None
    ) -> tuple[Flat, dict[str, str]]:
        """The state as (flat tensors, metadata). `with_cuda_rng`: capture the CUDA
        generators (default: when CUDA is initialised in this process)."""
        names = self._names
        # keep_vars: the parameters themselves, without a detached view of each.
        tensors: Flat = {
            names.get(("model", None, k)) or self._name("model", None, k): v
            for k, v in state.model.state_dict(keep_vars=True).items()
        }
        metadata = {f"user.{k}": v for k, v in state.metadata.items()}
        behind: set[str] = set()
        if state.optimizer is not None:
            updated = {id(p) for group in state.optimizer.param_groups for p in group["params"]}
            behind.update(name for name, v in tensors.items() if id(v) in updated)
            known = len(tensors)
            metadata["pitstop.optim"] = self._optimizer(state.optimizer, tensors)
            added = list(tensors)[known:]
            behind.update(name for name in added if name.startswith("optim.state."))
        self.behind = frozenset(behind)
        shards = self._local_shards(tensors)
        if shards:
            metadata[DTENSOR_KEY] = shards
        python_state = random.getstate()
        words = array.array("q", python_state[1])
        tensors["rng.python"] = torch.frombuffer(words, dtype=torch.int64)
        metadata["pitstop.rng.python"] = json.dumps(
            {"version": python_state[0], "gauss_next": python_state[2]}
        )
        tensors["rng.torch"] = torch.get_rng_state()
        if with_cuda_rng is None:
            initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            with_cuda_rng = torch.cuda.is_available() and initialized
        if with_cuda_rng:
            for index, rng in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{index}"] = rng
        for name, position in state.cursor.items():
            tensors[f"cursor.{name}"] = torch.tensor(position, dtype=torch.int64)
        for name, loader in state.loaders.items():
            described = _json_value(f"loader.{name}", loader.state_dict(), tensors)
            metadata[f"pitstop.loader.{name}"] = json.dumps(described)
        for name, tensor in state.tensors.items():
            tensors[f"extra.{name}"] = tensor.detach()
        tensors["step"] = torch.tensor(state.step, dtype=torch.int64)
        return tensors, metadata

    def _local_shards(self, tensors: Flat) -> str:
        """Replace each DTensor in `tensors` by its local shard; the shards' placement
        metadata as JSON ("" when there is none). Worked out once per tensor."""
        described = {}
        keys: list[tuple[object, ...]] = []
        for name, value in tensors.items():
            if not isinstance(value, DTensor):
                continue
            mesh = value.device_mesh  # by value, not id: a rebuilt model reuses ids
            where = tuple(mesh.get_coordinate() or ())
            key = (name, value.placements, tuple(value.shape), tuple(mesh.shape), where)
            known = self._shards.get(key)
            if known is None:
                known = self._shards[key] = _shard_metadata(value)
            described[name] = known
            keys.append(key)
            tensors[name] = value._local_tensor
        if not described:
            return ""
        if self._shards_json[0] != keys:  # the same tensors as the last step: same text
            self._shards_json = (keys, json.dumps(described, separators=(",", ":")))
        return self._shards_json[1]

    def _name(self, kind: str, owner: object, key: str) -> str:
        name = f"model.{key}" if kind == "model" else f"optim.state.{owner}.{key}"
        self._names[(kind, owner, key)] = name
        return name

    def _optimizer(self, optimizer: torch.optim.Optimizer, tensors: Flat) -> str:
        """Put the optimizer's state tensors into `tensors`; the rest as JSON."""
        state_dict = optimizer.state_dict()
        names = self._optim_names
        scalars: dict[str, dict[str, Any]] = {}
        for param_id, entries in state_dict["state"].items():
            known = names.get(param_id)
            if known is None:
                known = names[param_id] = {}
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    name = known.get(key)
                    if name is None:
                        name = known[key] = f"optim.state.{param_id}.{key}"
                    tensors[name] = value
                else:
                    name = f"optim.state.{param_id}.{key}"
                    scalars.setdefault(str(param_id), {})[key] = _json_value(name, value, tensors)

        def tensor_reference(value: object) -> object:
            # json calls this for what it cannot encode itself: tensor hyperparameters.
            if not isinstance(value, torch.Tensor):
                raise StateFormatError(
                    f"optimizer hyperparameter {value!r} is a {type(value).__name__}, which "
                    "pitstop cannot keep without pickle; use numbers, strings or tensors"
                )
            name = f"optim.group.tensor.{sum(k.startswith('optim.group.') for k in tensors)}"
            tensors[name] = value
            return {"__tensor__": name}

        # Tuples (Adam's betas) become lists here; `apply` turns them back by the live
        # optimizer's own groups.
        groups = json.dumps(state_dict["param_groups"], default=tensor_reference)
        return f'{{"param_groups": {groups}, "scalars": {json.dumps(scalars)}}}'


def capture(state: TrainState, *, with_cuda_rng: bool | None = None) -> tuple[Flat, dict[str, str]]:
    """The state as (flat tensors, metadata); see `Capturer` for a loop."""
    return Capturer()(state, with_cuda_rng=with_cuda_rng)


def apply(
    state: TrainState, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> None:
    """Put a captured state back into `state`, in place. Model tensors restored straight
    into the live ones (the same memory) are not copied again."""
    if "step" not in tensors:
        raise StateFormatError("the restored state has no 'step' tensor: it is not a TrainState")
    live = {k: local_tensor(v) for k, v in state.model.state_dict().items()}
    given = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    if set(given) != set(live):
        missing, unexpected = sorted(set(live) - set(given)), sorted(set(given) - set(live))
        raise StateFormatError(
            f"the restored model does not fit this one: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; restore with the model the snapshot was taken of"
        )
    with torch.no_grad():
        for name, value in given.items():
            target = live[name]
            if value.shape != target.shape:
                raise StateFormatError(
                    f"model.{name}: the restored shard is {tuple(value.shape)}, this rank's is "
                    f"{tuple(target.shape)}; the model is sharded differently than when the "
                    "snapshot was taken (restore on the same mesh, or reshard through DCP)"
                )
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)
    if state.optimizer is not None:
        _apply_optimizer(state.optimizer, tensors, metadata.get("pitstop.optim", ""))
    python_meta = json.loads(metadata.get("pitstop.rng.python", "{}"))
    if "rng.python" in tensors and python_meta:
        words = tuple(int(w) for w in tensors["rng.python"].tolist())
        random.setstate((python_meta["version"], words, python_meta["gauss_next"]))
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"].cpu())
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k[9:]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k].cpu() for k in cuda])
    for name, loader in state.loaders.items():
        described = metadata.get(f"pitstop.loader.{name}")
        if described is None:
            raise StateFormatError(
                f"the restored state has no data loader {name!r}; restore with the loaders "
                "the snapshot was taken with"
            )
        loader.load_state_dict(_from_json(json.loads(described), tensors))
    state._batches.clear()
    state.cursor.clear()
    state.cursor.update(
        {k.removeprefix("cursor."): int(v) for k, v in tensors.items() if k.startswith("cursor.")}
    )
    for name, value in tensors.items():
        if not name.startswith("extra."):
            continue
        key = name.removeprefix("extra.")
        current = state.tensors.get(key)
        if current is not None and current.shape == value.shape and current.dtype == value.dtype:
            with torch.no_grad():
                current.copy_(value)
        else:
            state.tensors[key] = value
    state.metadata.clear()
    state.metadata.update(
        {k.removeprefix("user."): v for k, v in metadata.items() if k.startswith("user.")}
    )
    state.step = int(tensors["step"])


def _apply_optimizer(
    optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], described: str
) -> None:
    if not described:
        raise StateFormatError(
            "the restored state has no optimizer (no 'pitstop.optim' metadata) but this "
            "TrainState has one; restore with the state the snapshot was taken of"
        )
    layout = json.loads(described)
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim.state."):
            param_id, _, key = name.removeprefix("optim.state.").partition(".")
            state.setdefault(int(param_id), {})[key] = value
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in state.items():
        param = params[index] if index < len(params) else None
        if not isinstance(param, DTensor):
            continue
        for key, value in entries.items():
            if not isinstance(value, DTensor) and value.shape == param._local_tensor.shape:
                entries[key] = DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
    for param_id, entries in layout["scalars"].items():
        for key, value in entries.items():
            state.setdefault(int(param_id), {})[key] = _from_json(value, tensors)
    groups = [
        {key: _from_json(value, tensors) for key, value in group.items()}
        for group in layout["param_groups"]
    ]
    for group, live in zip(groups, optimizer.param_groups, strict=False):
        for key, value in group.items():
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)
    # load_state_dict casts state to each parameter's device and dtype, and keeps the
    # optimizer object the script holds.
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, any other tensor itself."""
    return value._local_tensor if isinstance(value, DTensor) else value


def _shard_metadata(value: DTensor) -> dict[str, Any]:
    """Where `value`'s local shard sits in the whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return {
        "shape": list(value.shape),
        "offset": [int(o) for o in offset],
        "local": [int(n) for n in local_shape],
        "placements": [str(p) for p in value.placements],
        "mesh": list(value.device_mesh.mesh_dim_names or ()),
        "dtype": str(value.dtype).removeprefix("torch."),
    }


def _json_value(name: str, value: Any, tensors: Flat) -> Any:
    """`value` as JSON; tensors go into `tensors` under `name` and leave a reference."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return {"__tensor__": name}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _json_value(f"{name}.{k}", v, tensors) for k, v in value.items()}
        return {
            "__items__": [
                [_json_value(f"{name}.k{i}", k, tensors), _json_value(f"{name}.{i}", v, tensors)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if isinstance(value, tuple):
        return {"__tuple__": [_json_value(f"{name}.{i}", v, tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_json_value(f"{name}.{i}", v, tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise StateFormatError(
        f"{name} is a {type(value).__name__}, which pitstop cannot keep without pickle; "
        "use numbers, strings, lists, dicts or tensors"
    )


def _from_json(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_from_json(v, tensors) for v in value["__tuple__"])
    if isinstance(value, dict) and "__items__" in value:
        return {_from_json(k, tensors): _from_json(v, tensors) for k, v in value["__items__"]}
    if isinstance(value, dict):
        return {k: _from_json(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v, tensors) for v in value]
    return value
