"""Training data whose order is global: the same samples per step at any dp.

A job's data is a list of token shards (`Manifest`) cut into samples of context + 1
tokens (`Windows`). Each epoch reads them in a permutation fixed by (seed, epoch), global
step s consumes a fixed slice of it (`SampleOrder`), and the only data state a snapshot
keeps is the global step (`Cursor`). A replica reads the microbatches m of the step with
m mod dp == its rank (`ReplicaBatches`, `ReplicaNode` for torchdata's Loader), from
local disk or any fsspec URL through a bounded local cache (`SampleReader`,
`ShardCache`).

Exact across a dp change (a node lost, dp 4 -> 3, or grown back): which samples each step
consumes, their order, which microbatch each is in, the step count, and so the learning
rate schedule and everything else keyed by step. A run that changes dp mid-way consumes
the same `step_digest` sequence as one that never does.

Not exact: the floating-point sums. Which replica accumulates which microbatches, and
the all-reduce that adds the replicas' gradients, change with dp, and floating-point
addition is not associative, so the gradients differ in their last bits. Bitwise equal
weights across dp need a fixed reduction order on top (as the example job's per-shard
all_gather does).

This part imports nothing else of pitstop, so a training script can use it alone.
"""

from pitstop.data.cursor import Cursor
from pitstop.data.node import ReplicaNode
from pitstop.data.order import SampleOrder
from pitstop.data.reader import CacheFullError, SampleReader, ShardCache, is_local
from pitstop.data.replica import Microbatch, ReplicaBatches
from pitstop.data.shards import (
    FORMATS,
    Manifest,
    MegatronIndex,
    ShardInfo,
    Windows,
    describe_shard,
    read_megatron_index,
)

__all__ = [
    "FORMATS",
    "CacheFullError",
    "Cursor",
    "Manifest",
    "MegatronIndex",
    "Microbatch",
    "ReplicaBatches",
    "ReplicaNode",
    "SampleOrder",
    "SampleReader",
    "ShardCache",
    "ShardInfo",
    "Windows",
    "describe_shard",
    "is_local",
    "read_megatron_index",
]
