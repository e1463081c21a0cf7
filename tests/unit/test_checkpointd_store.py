"""The in-memory shard store and the durable store (checkpointd.store, rankside.durable)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from pitstop.checkpointd.catalog import CatalogClient
from pitstop.checkpointd.flusher import DurableFlusher
from pitstop.checkpointd.slots import SlotPool, remove_stale_segments, segment_prefix
from pitstop.checkpointd.store import (
    PENDING_COMMIT,
    ShardId,
    ShardRecord,
    ShardStore,
    Tier,
    shard_checksum,
)
from pitstop.rankside.durable import DurableShard, DurableStore


@pytest.fixture
def pool() -> Iterator[SlotPool]:
    prefix = segment_prefix(f"unit-{uuid.uuid4().hex[:8]}")
    pool = SlotPool(prefix, 1 << 24)
    yield pool
    pool.close()
    remove_stale_segments(prefix)


def record(
    pool: SlotPool, step: int, *, rank: int = 0, tier: Tier = Tier.LOCAL, generation: int = 0
) -> ShardRecord:
    data = f"shard {rank}@{step}".encode()
    segment = pool.allocate(len(data), ("job", rank))
    segment.view[: len(data)] = data
    return ShardRecord(ShardId("job", rank, step), generation, tier, segment, len(data), "n1")


def test_checksum_is_xxh3_64() -> None:
    assert shard_checksum(b"abc") == xxhash.xxh3_64(b"abc").hexdigest()


def test_the_newest_k_are_kept_per_rank_and_tier(pool: SlotPool) -> None:
    store = ShardStore(keep=2)
    one, two, three = record(pool, 1), record(pool, 2), record(pool, 3)
    assert store.put(one) == []
    assert store.put(two) == []
    assert store.put(record(pool, 1, tier=Tier.REPLICA)) == []
    assert store.put(record(pool, 1, rank=1)) == []
    assert store.put(three) == [one]
    assert [r.shard.step for r in store.records() if r.shard.rank == 0] == [1, 2, 3]
    assert store.newest_step("job", 0) == 3


def test_the_committed_step_and_the_steps_awaiting_commit_are_kept(pool: SlotPool) -> None:
    """A recovery restores the committed step, which trails the newest by the time
    replication takes: its snapshot, and those that may be committed next, must
    outlive the newest K (up to K + PENDING_COMMIT of them)."""
    store = ShardStore(keep=2)
    snapshots = [record(pool, step) for step in range(1, 10 + PENDING_COMMIT * 2)]
    for shard in snapshots[:6]:
        store.put(shard, committed=2)
    assert sorted(r.shard.step for r in store.records()) == [2, 3, 4, 5, 6]
    # The commit moves on: what is older than the new restore point goes.
    evicted = store.put(snapshots[6], committed=5)
    assert {r.shard.step for r in evicted} <= {1, 2, 3, 4}
    assert sorted(r.shard.step for r in store.records()) == [5, 6, 7]
    # Commits stall (a buddy is gone): memory stays bounded.
    for shard in snapshots[7:]:
        store.put(shard, committed=5)
    kept = sorted(r.shard.step for r in store.records())
    assert kept[0] == 5
    assert len(kept) == 1 + store.keep + PENDING_COMMIT
    assert kept[-1] == snapshots[-1].shard.step


def test_an_older_shard_than_the_kept_ones_is_evicted_at_once(pool: SlotPool) -> None:
    store = ShardStore(keep=1)
    newest = record(pool, 5)
    store.put(newest)
    old = record(pool, 4)
    assert store.put(old) == [old]
    assert store.holds(newest)
    assert not store.holds(old)


def test_the_same_shard_again_replaces_the_old_copy(pool: SlotPool) -> None:
    store = ShardStore(keep=2)
    first, again = record(pool, 1), record(pool, 1)
    store.put(first)
    assert store.put(again) == [first]
    assert store.find("job", 0, 1) == [again]


def test_a_new_generation_drops_the_abandoned_timeline(pool: SlotPool) -> None:
    store = ShardStore(keep=3)
    for step in (5, 6, 7):
        store.put(record(pool, step))
    # Recovery rolled back to 5; generation 1 writes step 6 again.
    redo = record(pool, 6, generation=1)
    evicted = store.put(redo)
    assert sorted(r.shard.step for r in evicted) == [6, 7]
    assert store.find("job", 0) == [redo]


def test_find_prefers_the_local_copy_and_step_zero_means_newest(pool: SlotPool) -> None:
    store = ShardStore(keep=2)
    replica, local = record(pool, 3, tier=Tier.REPLICA), record(pool, 3)
    store.put(replica)
    store.put(local)
    store.put(record(pool, 2))
    assert store.find("job", 0) == [local, replica]
    assert store.find("job", 0, 3) == [local, replica]
    assert store.find("job", 0, 9) == []
    assert store.find("job", 1) == []


def test_verify_detects_a_flipped_byte(pool: SlotPool) -> None:
    shard = record(pool, 1)
    assert shard.verify()
    shard.segment.view[0] ^= 0x01
    assert not shard.verify()


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep_in_memory 0"):
        ShardStore(keep=0)


# The durable store.


def shard(rank: int, payload: bytes) -> DurableShard:
    return DurableShard(rank, memoryview(payload), shard_checksum(payload))


def test_a_flushed_checkpoint_is_listed_and_reads_back(tmp_path: Path) -> None:
    durable = DurableStore(f"file://{tmp_path}", "n1")
    durable.write_checkpoint("job", 4, 2, [shard(0, b"zero" * 10), shard(1, b"one")])
    entries = durable.entries("job")
    assert [(e.shard.rank, e.shard.step, e.generation, e.size) for e in entries] == [
        (0, 4, 2, 40),
        (1, 4, 2, 3),
    ]
    buffer = bytearray(40)
    durable.read_into(entries[0], memoryview(buffer))
    assert bytes(buffer) == b"zero" * 10
    manifest = json.loads((tmp_path / "job" / f"step-{4:012d}" / "manifest-n1.json").read_text())
    assert manifest["job_id"] == "job"
    assert manifest["ranks"]["1"]["checksum"] == shard_checksum(b"one")


def test_a_flush_killed_before_its_manifest_is_never_offered(tmp_path: Path) -> None:
    durable = DurableStore(f"file://{tmp_path}", "n1")
    durable.write_checkpoint("job", 1, 0, [shard(0, b"complete")])

    class Killed(Exception):
        pass

    def die() -> None:
        raise Killed

    with pytest.raises(Killed):
        durable.write_checkpoint("job", 2, 0, [shard(0, b"torn")], before_manifest=die)
    assert list((tmp_path / "job" / f"step-{2:012d}").glob("rank-*"))  # the shard is there
    assert [e.shard.step for e in durable.entries("job")] == [1]
    found = durable.find("job", 0)
    assert found is not None
    assert found.shard.step == 1


def test_a_manifest_whose_shard_is_short_is_not_offered(tmp_path: Path) -> None:
    durable = DurableStore(f"file://{tmp_path}", "n1")
    durable.write_checkpoint("job", 1, 0, [shard(0, b"complete")])
    (shard_file,) = (tmp_path / "job" / f"step-{1:012d}").glob("rank-*")
    shard_file.write_bytes(b"comp")
    assert durable.entries("job") == []


@pytest.mark.parametrize("content", ["{not json", '{"format": "other"}', '{"format": 1}'])
def test_an_unreadable_manifest_is_ignored(tmp_path: Path, content: str) -> None:
    durable = DurableStore(f"file://{tmp_path}", "n1")
    durable.write_checkpoint("job", 1, 0, [shard(0, b"x")])
    (tmp_path / "job" / f"step-{1:012d}" / "manifest-n1.json").write_text(content)
    assert durable.entries("job") == []


def test_a_late_rank_is_merged_into_the_manifest(tmp_path: Path) -> None:
    durable = DurableStore(f"file://{tmp_path}", "n1")
    durable.write_checkpoint("job", 3, 0, [shard(0, b"a")])
    durable.write_checkpoint("job", 3, 0, [shard(1, b"b")])
    assert [e.shard.rank for e in durable.entries("job")] == [0, 1]


def test_prune_keeps_the_newest_d_of_this_node(tmp_path: Path) -> None:
    mine, theirs = (
        DurableStore(f"file://{tmp_path}", "n1"),
        DurableStore(f"file://{tmp_path}", "n2"),
    )
    for step in (1, 2, 3):
        mine.write_checkpoint("job", step, 0, [shard(0, b"mine")])
    theirs.write_checkpoint("job", 1, 0, [shard(1, b"theirs")])
    assert mine.prune("job", keep=2) == [ShardId("job", 0, 1)]
    assert sorted((e.shard.step, e.node_id) for e in mine.entries("job")) == [
        (1, "n2"),
        (2, "n1"),
        (3, "n1"),
    ]
    assert mine.job_ids() == ["job"]


def test_unsafe_job_ids_are_refused(tmp_path: Path) -> None:
    durable = DurableStore(f"file://{tmp_path}", "n1")
    with pytest.raises(ValueError, match=re.escape("job_id '../x'")):
        durable.write_checkpoint("../x", 1, 0, [])


# The flush policy.


def flusher(pool: SlotPool, tmp_path: Path, every: int) -> DurableFlusher:
    return DurableFlusher(
        DurableStore(f"file://{tmp_path}", "n1"),
        pool,
        CatalogClient("", "n1"),
        every_steps=every,
        keep_durable=2,
        failures_per_hour=1.0,
    )


def test_a_fixed_interval_flushes_every_m_steps(pool: SlotPool, tmp_path: Path) -> None:
    policy = flusher(pool, tmp_path, every=50)
    policy.observe_seal("job", 1, now=0.0)
    policy.observe_seal("job", 2, now=1.0)
    policy.flush_cost_s = 10.0
    assert policy.every_steps("job") == 50


def test_the_young_daly_interval_is_a_power_of_two(pool: SlotPool, tmp_path: Path) -> None:
    policy = flusher(pool, tmp_path, every=0)
    assert policy.every_steps("job") == 1  # nothing measured yet: flush, and measure
    policy.observe_seal("job", 10, now=100.0)
    policy.observe_seal("job", 12, now=102.0)  # 1 s per step
    policy.flush_cost_s = 10.0  # Young/Daly: 261.7 s = 262 steps
    assert policy.every_steps("job") == 256
    assert policy.every_steps("other-job") == 1


def test_a_newer_due_step_replaces_an_older_waiting_one(pool: SlotPool, tmp_path: Path) -> None:
    policy = flusher(pool, tmp_path, every=2)
    older, newer, off_cycle = record(pool, 2), record(pool, 4), record(pool, 5)
    policy.submit(older)
    assert older.segment.refs == 2  # pinned while it waits
    policy.submit(off_cycle)
    assert off_cycle.segment.refs == 1  # step 5 is not due
    policy.submit(newer)
    assert older.segment.refs == 1
    assert newer.segment.refs == 2
    policy.close()
    assert newer.segment.refs == 1
