"""Leaving pitstop: torch.distributed.checkpoint (DCP) loads a durable checkpoint.

    import torch.distributed.checkpoint as dcp
    from pitstop.trainer.dcp import DurableReader

    state_dict = model.state_dict()          # any world size, any sharding (or none)
    dcp.load(state_dict, storage_reader=DurableReader("s3://bucket/ckpt", "job-42"))

`DurableReader` reads the durable store as checkpointd flushes it (one safetensors
shard per rank plus each node's manifest; see `pitstop.rankside.durable`) and
describes it to DCP the way DCP's own checkpoints are described: every model tensor
under its `model.state_dict()` key (the shard's "model." prefix dropped; `prefix`
puts another in front, e.g. "model." for `dcp.load({"model": model.state_dict()})`),
with its global shape and the chunks the ranks hold. A sharded tensor's chunks come
from "pitstop.dtensor" (each rank's local shard and its global offset); a whole
tensor (replicated, plain data parallel) is one chunk of its full shape, read from the
lowest rank that holds it. DCP then reshards: the loading job may have another world
size and another mesh than the one that saved, or no process group at all
(`no_dist=True`). The bytes are the saved bytes; a target of another dtype is
converted by `Tensor.copy_`, as DCP's own readers do.

Only model state is offered. Optimizer state is kept by parameter index, not by name,
and the shard does not say which model tensors are parameters, so it cannot be mapped
onto DCP's FQN-keyed optimizer state; rng, step, cursor, loader and extra tensors
belong to one rank of one run and are not offered either.

Needs the checkpointd extra (fsspec, xxhash) beside the trainer's, and the fsspec
package of the store's scheme (s3fs for s3://).

Step 0 (the default) is the newest complete step: every rank from 0 up listed by the
nodes' manifests and every sharded tensor covered by its chunks. A step a node had
not finished flushing is passed over (with a warning) for an older complete one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from pitstop.rankside.durable import DurableEntry, DurableStore
from pitstop.rankside.format import DTYPE_SIZES, MAX_HEADER_BYTES, METADATA_KEY
from pitstop.rankside.shards import shard_checksum
from pitstop.trainer.state import DTENSOR_KEY

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."
READER_NODE = "dcp-reader"
"""The node name the reader opens the store as; it never writes."""
_LENGTH = struct.Struct("<Q")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "C64": torch.complex64,
}
"""The torch dtype of each safetensors dtype a shard may hold."""


class DurableCheckpointError(RuntimeError):
    """No complete durable step to load, or a shard that does not read as one."""


@dataclass(frozen=True)
class ChunkLocation:
    """Where one chunk's bytes sit: [begin, end) of the shard file at `path`."""

    path: str
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    rank: int


@dataclass(frozen=True)
class _Chosen:
    step: int
    entries: list[DurableEntry]
    tensors: dict[str, TensorStorageMetadata]
    storage: dict[MetadataIndex, ChunkLocation]


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class DurableReader(StorageReader):
    """A DCP `StorageReader` over the durable checkpoints of `job_id` in the store at
    `url` (any fsspec URL checkpointd flushes to). `step`: the step to load, 0 for the
    newest complete one; `self.step` is the one chosen. `prefix` goes in front of every
    model key. `verify`: check each shard file's checksum (reads every file a rank
    loads from in full; turn it off for large checkpoints on slow storage)."""

    def __init__(
        self,
        url: str,
        job_id: str,
        step: int = 0,
        *,
        prefix: str = "",
        verify: bool = True,
    ) -> None:
        super().__init__()
        self.url = url
        self.job_id = job_id
        self.prefix = prefix
        self.verify = verify
        self.store = DurableStore(url, READER_NODE)
        self._chosen = self._choose(step)
        self.storage_data: dict[MetadataIndex, ChunkLocation] = {}
        self.load_id = uuid.uuid4().hex

    # --- the StorageReader contract --------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A fresh load. `checkpoint_id`, when DCP is given one: the step to load."""
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is not None and str(checkpoint_id) != self.checkpoint_id:
            step = str(checkpoint_id).rsplit("step-", 1)[-1]
            if not step.isdigit():
                raise DurableCheckpointError(
                    f"checkpoint_id {checkpoint_id!r}: give DurableReader's checkpoint_id "
                    "a step number (or leave it out for the newest complete step)"
                )
            self._chosen = self._choose(int(step))

    @property
    def step(self) -> int:
        """The step this reader loads."""
        return self._chosen.step

    @property
    def entries(self) -> list[DurableEntry]:
        """The step's shards, one per rank, in rank order."""
        return self._chosen.entries

    @property
    def checkpoint_id(self) -> str:
        """The step loaded, as `<url>/<job>/step-<step>`."""
        return f"{self.url.rstrip('/')}/{self.job_id}/step-{self.step:012d}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # Never picked by DCP on its own: a durable store is opened by job, not by path.
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's model tensors, their global shapes and chunks, from every shard's
        header (the tensor bytes are not read here)."""
        self.storage_data = dict(self._chosen.storage)
        return Metadata(
            state_dict_metadata=dict(self._chosen.tensors),
            storage_data=self.storage_data,
            storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id, load_id=self.load_id),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise DurableCheckpointError("DCP passed metadata without storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each requested sub-slice of a saved chunk into the planner's target,
        one open per shard file."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].path, []).append(item)
        checksums = {entry.path: entry for entry in self.entries}
        for path, items in per_file.items():
            with self.store.fs.open(path, "rb") as file:
                whole = self._whole_file(file, checksums[path]) if self.verify else None
                for item in items:
                    where = self.storage_data[item.storage_index]
                    if whole is not None:
                        data = whole[where.begin : where.end]
                    else:
                        file.seek(where.begin)
                        data = memoryview(file.read(where.end - where.begin))
                    source = _tensor(data, where)
                    for dim, (offset, length) in enumerate(
                        zip(item.storage_offsets, item.lengths, strict=True)
                    ):
                        source = source.narrow(dim, offset, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != source.size():
                        raise DurableCheckpointError(
                            f"{item.storage_index.fqn}: the plan wants {tuple(target.size())} "
                            f"from a slice of {tuple(source.size())}"
                        )
                    target.copy_(source)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # --- the store ------------------------------------------------------------

    def _choose(self, step: int) -> _Chosen:
        """The step to load: `step`, or the newest complete step for 0. Complete: every
        rank from 0 to the highest listed, and every sharded tensor covered by chunks."""
        by_step: dict[int, dict[int, DurableEntry]] = {}
        for entry in self.store.entries(self.job_id):
            by_step.setdefault(entry.shard.step, {}).setdefault(entry.shard.rank, entry)
        problems = []
        for candidate in [step] if step else sorted(by_step, reverse=True):
            ranks = by_step.get(candidate, {})
            if not ranks:
                continue
            entries = [ranks[r] for r in sorted(ranks)]
            missing = [r for r in range(entries[-1].shard.rank + 1) if r not in ranks]
            if missing:
                problem = f"step {candidate} lacks the shards of ranks {missing}"
            else:
                tensors, storage = _describe(self.store, entries, self.prefix)
                problem = _uncovered(tensors)
                if not problem:
                    return _Chosen(candidate, entries, tensors, storage)
                problem = f"step {candidate}: {problem}"
            log.warning("job %s: durable %s (a flush not done): passed over", self.job_id, problem)
            problems.append(problem)
        found = ", ".join(str(s) for s in sorted(by_step)) or "none"
        which = f"step {step}" if step else "any step"
        raise DurableCheckpointError(
            f"job {self.job_id!r} has no complete durable checkpoint at {which} in {self.url} "
            f"(steps with a manifest: {found}{'; ' if problems else ''}{'; '.join(problems)}). "
            "Give the URL checkpointd flushes to (its durable_url, default "
            "file://<state_dir>/durable) and the job's id (a directory there), another step, "
            "or let checkpointd finish a durable flush first."
        )

    def _whole_file(self, file: Any, entry: DurableEntry) -> memoryview:
        data = memoryview(file.read())
        if len(data) != entry.size or shard_checksum(data) != entry.checksum:
            raise DurableCheckpointError(
                f"{entry.path}: its bytes do not match the manifest's size {entry.size} and "
                f"checksum {entry.checksum}; the shard is damaged (load another step)"
            )
        return data


def _uncovered(tensors: dict[str, TensorStorageMetadata]) -> str:
    """What the chunks leave out ("" when every tensor is whole)."""
    for fqn, described in tensors.items():
        covered = sum(math.prod(chunk.sizes) for chunk in described.chunks)
        if covered != math.prod(described.size):
            total = math.prod(described.size)
            return f"its shards hold {covered} of the {total} elements of {fqn!r}"
    return ""


def _describe(
    store: DurableStore, entries: Iterable[DurableEntry], prefix: str
) -> tuple[dict[str, TensorStorageMetadata], dict[MetadataIndex, ChunkLocation]]:
    """Every model tensor of `entries` (ascending rank) as DCP metadata, and where each
    chunk's bytes are. A chunk two ranks hold (a replicated dimension) is read from the
    lower one."""
    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, ChunkLocation] = {}
    for entry in entries:
        header, data_start, metadata = _read_header(store, entry)
        try:
            sharded = json.loads(metadata.get(DTENSOR_KEY) or "{}")
        except json.JSONDecodeError as exc:
            raise DurableCheckpointError(
                f"{entry.path}: {DTENSOR_KEY} is not JSON: {exc}"
            ) from None
        for tensor in header:
            if not tensor.name.startswith(MODEL_PREFIX):
                continue
            fqn = prefix + tensor.name.removeprefix(MODEL_PREFIX)
            where = sharded.get(tensor.name)
            if where is None:
                size, offsets = tensor.shape, (0,) * len(tensor.shape)
            else:
                size, offsets = tuple(where["shape"]), tuple(where["offset"])
                if tuple(where["local"]) != tensor.shape:
                    raise DurableCheckpointError(
                        f"{entry.path}: {tensor.name} holds {tensor.shape}, its "
                        f"{DTENSOR_KEY} entry says {where['local']}"
                    )
            dtype = TORCH_DTYPES[tensor.dtype]
            described = tensors.get(fqn)
            if described is None:
                described = tensors[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=dtype), torch.Size(size), []
                )
            elif described.size != torch.Size(size) or described.properties.dtype != dtype:
                raise DurableCheckpointError(
                    f"{fqn}: rank {entry.shard.rank} holds it as {tensor.dtype} {size}, a lower "
                    f"rank as {described.properties.dtype} {tuple(described.size)}"
                )
            index = MetadataIndex(fqn, offsets)
            if index in storage:
                continue
            storage[index] = ChunkLocation(
                entry.path,
                data_start + tensor.begin,
                data_start + tensor.end,
                tensor.dtype,
                tensor.shape,
                entry.shard.rank,
            )
            described.chunks.append(
                ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(tensor.shape))
            )
    return tensors, storage


def _read_header(
    store: DurableStore, entry: DurableEntry
) -> tuple[list[_Tensor], int, dict[str, str]]:
    """The tensors of the shard at `entry` (names, dtypes, shapes, data offsets), where
    its tensor bytes start, and its metadata."""
    with store.fs.open(entry.path, "rb") as file:
        prefix = file.read(_LENGTH.size)
        if len(prefix) != _LENGTH.size:
            raise DurableCheckpointError(f"{entry.path}: too short for a safetensors header")
        (length,) = _LENGTH.unpack(prefix)
        if length > MAX_HEADER_BYTES or _LENGTH.size + length > entry.size:
            raise DurableCheckpointError(f"{entry.path}: header length {length} does not fit")
        raw = file.read(length)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DurableCheckpointError(f"{entry.path}: header is not JSON: {exc}") from None
    metadata = doc.pop(METADATA_KEY, None) or {}
    data_start = _LENGTH.size + length
    tensors = []
    for name, info in doc.items():
        try:
            dtype, shape = str(info["dtype"]), tuple(int(n) for n in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DurableCheckpointError(f"{entry.path}: bad header entry {name!r}") from None
        if (
            dtype not in TORCH_DTYPES
            or end - begin != DTYPE_SIZES[dtype] * math.prod(shape)
            or not 0 <= begin <= end <= entry.size - data_start
        ):
            raise DurableCheckpointError(f"{entry.path}: bad header entry {name!r}: {info}")
        tensors.append(_Tensor(name, dtype, shape, begin, end))
    return tensors, data_start, metadata


def _tensor(data: memoryview, where: ChunkLocation) -> torch.Tensor:
    """The chunk's bytes as a tensor of its dtype and shape (a copy, writable)."""
    dtype = TORCH_DTYPES[where.dtype]
    if len(data) == 0:
        return torch.empty(where.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(where.shape)
