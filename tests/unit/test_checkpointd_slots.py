"""Shared-memory slots (pitstop.checkpointd.slots): real /dev/shm segments, one budget."""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Iterator

import pytest

from pitstop.checkpointd.slots import (
    SHM_DIR,
    MemoryBudgetFull,
    SlotMismatch,
    SlotPool,
    remove_stale_segments,
    segment_prefix,
    slot_size,
)

PAGE = mmap.PAGESIZE
OWNER = ("job-a", 0)


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = segment_prefix(f"unit-{uuid.uuid4().hex[:8]}")
    yield prefix
    remove_stale_segments(prefix)


def segments(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def test_prefix_is_stable_per_node_and_safe() -> None:
    assert segment_prefix("node-1") == segment_prefix("node-1")
    assert segment_prefix("node-1") != segment_prefix("node-2")
    assert "/" not in segment_prefix("a/b c")


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1, PAGE),
        (PAGE, PAGE),
        (PAGE + 1, 2 * PAGE),
        (64 << 20, 64 << 20),
        ((64 << 20) + 1, 66 << 20),
    ],
)
def test_slot_sizes_round_up(size: int, expected: int) -> None:
    assert slot_size(size) == expected


def test_a_slot_is_a_shared_segment_unlinked_on_close(prefix: str) -> None:
    pool = SlotPool(prefix, 1 << 20)
    segment = pool.allocate(1000, OWNER)
    segment.view[:5] = b"hello"
    with (SHM_DIR / segment.name).open("rb") as file:
        assert file.read(5) == b"hello"
    assert segments(prefix) == [segment.name]
    assert pool.used_bytes == PAGE
    pool.close()
    assert segments(prefix) == []


def test_a_referenced_segment_is_never_reused(prefix: str) -> None:
    pool = SlotPool(prefix, 1 << 20)
    first = pool.allocate(PAGE, OWNER)
    second = pool.allocate(PAGE, OWNER)
    assert first is not second
    pool.unref(first)
    assert pool.allocate(PAGE, OWNER) is first
    pool.close()


def test_pins_delay_reuse(prefix: str) -> None:
    pool = SlotPool(prefix, 1 << 20)
    segment = pool.allocate(PAGE, OWNER)
    with pool.pinned(segment):
        pool.unref(segment)
        assert pool.allocate(PAGE, OWNER) is not segment
    assert pool.allocate(PAGE, OWNER) is segment
    pool.close()


def test_the_owner_gets_its_own_free_segment_back(prefix: str) -> None:
    pool = SlotPool(prefix, 1 << 20)
    mine, theirs = pool.allocate(PAGE, OWNER), pool.allocate(PAGE, ("job-a", 1))
    pool.unref(theirs)
    pool.unref(mine)
    assert pool.allocate(PAGE, OWNER) is mine
    pool.close()


def test_budget_full_refuses_without_allocating(prefix: str) -> None:
    pool = SlotPool(prefix, 3 * PAGE)
    held = pool.allocate(2 * PAGE, OWNER)
    with pytest.raises(MemoryBudgetFull, match="memory budget full"):
        pool.allocate(2 * PAGE, OWNER)
    assert segments(prefix) == [held.name]
    assert pool.used_bytes == 2 * PAGE
    pool.close()


def test_free_segments_are_dropped_to_make_room(prefix: str) -> None:
    pool = SlotPool(prefix, 3 * PAGE)
    small = pool.allocate(PAGE, OWNER)
    pool.unref(small)
    big = pool.allocate(3 * PAGE, OWNER)
    assert segments(prefix) == [big.name]
    pool.close()


def test_an_unsealed_slot_is_reclaimed_by_the_next_acquire(prefix: str) -> None:
    pool = SlotPool(prefix, 2 * PAGE)
    abandoned = pool.begin_write(OWNER, PAGE)
    again = pool.begin_write(OWNER, PAGE)
    assert again is abandoned  # the dead writer's slot, not a second one
    sealed = pool.finish_write(OWNER, again.name, PAGE)
    assert sealed is again
    pool.close()


def test_sealing_a_slot_not_given_is_refused(prefix: str) -> None:
    pool = SlotPool(prefix, 2 * PAGE)
    with pytest.raises(SlotMismatch, match="acquire a slot first"):
        pool.finish_write(OWNER, "nope", 1)
    segment = pool.begin_write(OWNER, PAGE)
    with pytest.raises(SlotMismatch, match="not the one given"):
        pool.finish_write(OWNER, "other", 1)
    with pytest.raises(SlotMismatch, match="bytes sealed"):
        pool.finish_write(OWNER, segment.name, 2 * PAGE)
    pool.close()


def test_a_write_that_may_not_create_takes_only_a_free_segment(prefix: str) -> None:
    pool = SlotPool(prefix, 2 * PAGE)
    assert pool.begin_write(OWNER, PAGE, may_create=False) is None
    assert segments(prefix) == []
    first = pool.begin_write(OWNER, PAGE)
    assert first is not None
    pool.unref(pool.finish_write(OWNER, first.name, PAGE))
    assert pool.begin_write(OWNER, PAGE, may_create=False) is first
    pool.close()


def test_stale_segments_of_a_killed_daemon_are_removed(prefix: str) -> None:
    left = SlotPool(prefix, 1 << 20)
    names = {left.allocate(PAGE, OWNER).name, left.allocate(PAGE, OWNER).name}
    # The daemon dies without closing its pool: its segments stay in /dev/shm.
    assert set(segments(prefix)) == names
    assert remove_stale_segments(prefix) == sorted(names)
    assert segments(prefix) == []


def test_slots_unsealed_for_long_are_reclaimed_when_memory_is_needed(prefix: str) -> None:
    patient = SlotPool(prefix, 2 * PAGE)
    patient.begin_write(("job-a", 0), PAGE)
    patient.begin_write(("job-a", 1), PAGE)
    with pytest.raises(MemoryBudgetFull):
        patient.allocate(PAGE, ("job-b", 0))
    patient.close()
    impatient = SlotPool(prefix, 2 * PAGE, stale_write_seconds=0.0)
    gone = impatient.begin_write(("job-a", 0), PAGE)
    impatient.begin_write(("job-a", 1), PAGE)
    assert impatient.allocate(PAGE, ("job-b", 0)) is gone
    assert gone is not None
    with pytest.raises(SlotMismatch):
        impatient.finish_write(("job-a", 0), gone.name, PAGE)
    impatient.close()
