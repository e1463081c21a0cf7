"""Shared-memory slots (pitstop.checkpointd.slots): real /dev/shm segments, one budget."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from pitstop.checkpointd.instances import MARKER_SUFFIX
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
    """Segments under `prefix` in /dev/shm, the instances' markers left out."""
    return sorted(
        p.name
        for p in SHM_DIR.iterdir()
        if p.name.startswith(prefix) and not p.name.endswith(MARKER_SUFFIX)
    )


def markers(prefix: str) -> list[str]:
    return sorted(
        p.name
        for p in SHM_DIR.iterdir()
        if p.name.startswith(prefix) and p.name.endswith(MARKER_SUFFIX)
    )


def pool_in_a_child(prefix: str, count: int) -> subprocess.Popen[str]:
    """Another process whose SlotPool holds `count` segments under `prefix`; it prints
    their names on one line, then waits for stdin to close (or to be killed)."""
    code = (
        "import sys\n"
        "from pitstop.checkpointd.slots import SlotPool\n"
        f"pool = SlotPool({prefix!r}, 1 << 20)\n"
        f"names = [pool.allocate(1, ('job', 0)).name for _ in range({count})]\n"
        "print(' '.join(names), flush=True)\n"
        "sys.stdin.read()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


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
    with pytest.raises(MemoryBudgetFull, match="memory budget full") as refused:
        pool.allocate(2 * PAGE, OWNER)
    assert segments(prefix) == [held.name]
    assert pool.used_bytes == 2 * PAGE
    # The error names the numbers and the budget that would have fit.
    message = str(refused.value)
    assert f"a {2 * PAGE}-byte slot does not fit, {2 * PAGE} of {3 * PAGE} bytes" in message
    assert f"raise memory_budget_bytes to at least {4 * PAGE}" in message
    assert "keep_in_memory + 1 slots" in message
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


def test_segments_are_named_after_their_instance(prefix: str) -> None:
    first, second = SlotPool(prefix, 1 << 20), SlotPool(prefix, 1 << 20)
    assert first.instance != second.instance
    assert first.allocate(PAGE, OWNER).name.startswith(f"{prefix}{first.instance}-")
    assert markers(prefix) == sorted(
        f"{prefix}{pool.instance}{MARKER_SUFFIX}" for pool in (first, second)
    )
    first.close()
    second.close()
    assert markers(prefix) == []


def test_segments_of_a_killed_instance_are_removed(prefix: str) -> None:
    child = pool_in_a_child(prefix, 2)
    assert child.stdout is not None
    names = child.stdout.readline().split()
    child.send_signal(signal.SIGKILL)  # dies without closing its pool
    child.wait()
    assert segments(prefix) == sorted(names)
    assert remove_stale_segments(prefix) == sorted(names)
    assert segments(prefix) == []
    assert markers(prefix) == []


def test_a_live_instance_keeps_its_segments_whoever_cleans_up(prefix: str) -> None:
    # Two daemons with the same node id (two local clusters on one host): one in
    # another process, one here. Neither cleanup touches the other's segments.
    child = pool_in_a_child(prefix, 2)
    assert child.stdout is not None
    theirs = child.stdout.readline().split()
    try:
        mine = SlotPool(prefix, 1 << 20)
        ours = mine.allocate(PAGE, OWNER).name
        assert remove_stale_segments(prefix) == []
        assert segments(prefix) == sorted([*theirs, ours])
        mine.close()  # a graceful stop removes only its own
        assert segments(prefix) == sorted(theirs)
    finally:
        assert child.stdin is not None
        child.stdin.close()  # the child exits without closing its pool
        child.wait()
    assert remove_stale_segments(prefix) == sorted(theirs)


def test_segments_without_a_marker_are_a_dead_instances(prefix: str) -> None:
    pool = SlotPool(prefix, 1 << 20)
    name = pool.allocate(PAGE, OWNER).name
    os.unlink(SHM_DIR / f"{prefix}{pool.instance}{MARKER_SUFFIX}")
    assert remove_stale_segments(prefix) == [name]
    pool.close()


def test_names_of_another_shape_are_left_alone(prefix: str) -> None:
    other = SHM_DIR / f"{prefix}abc123-0"  # not an instance id: not ours to judge
    other.write_bytes(b"x")
    try:
        assert remove_stale_segments(prefix) == []
        assert other.exists()
    finally:
        other.unlink()


def test_a_free_segment_that_vanished_is_not_handed_out(prefix: str) -> None:
    pool = SlotPool(prefix, 2 * PAGE)
    gone = pool.allocate(PAGE, OWNER)
    pool.unref(gone)
    os.unlink(SHM_DIR / gone.name)
    again = pool.allocate(PAGE, OWNER)
    assert again is not gone
    assert segments(prefix) == [again.name]
    assert pool.used_bytes == PAGE
    pool.close()


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


def test_an_ended_jobs_segments_go_and_one_pinned_then_goes_when_released(
    prefix: str,
) -> None:
    pool = SlotPool(prefix, 1 << 20)
    try:
        check_an_ended_job_is_forgotten(pool, prefix)
    finally:  # a failed assertion must not leave this live pool's segments behind
        pool.close()


def check_an_ended_job_is_forgotten(pool: SlotPool, prefix: str) -> None:
    done = ("job-done", 0)
    other = pool.allocate(PAGE, OWNER)
    pool.begin_write(done, PAGE)  # the slot its rank took for the next snapshot
    free, pinned = pool.allocate(PAGE, done), pool.allocate(PAGE, done)
    pool.unref(free)
    pool.unref(other)
    pool.ref(pinned)  # a transfer under way
    pool.unref(pinned)  # its holder let go
    before = len(segments(prefix))

    assert pool.forget_job("job-done") == 2 * PAGE  # the free one, and the leased one
    assert len(segments(prefix)) == before - 2
    pool.unref(pinned)  # the transfer ends
    assert len(segments(prefix)) == before - 3
    assert pool.allocate(PAGE, OWNER) is other  # another job's free segment stays
