"""bench/soak.py's slopes: per hour, from each process's own warm-up on, none for a
series too short to say anything about an hour, and descriptors that come and go with
the work are not growth; a process's memory and descriptors less its /dev/shm segments,
and /dev/shm's growth the segments no running daemon owns."""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench.* as soak.py imports it
from bench._soak_samples import (
    Series,
    fd_kinds,
    fitted,
    growth,
    kinds_gained,
    orphaned_segments,
    orphaned_shm_bytes,
    outlived,
    private_rss_bytes,
    process_name,
    slope_per_hour,
)

MB = 1024 * 1024
SHM = Path("/dev/shm")


def test_a_steady_leak_is_its_rate_per_hour() -> None:
    points = [(60.0 * i, 100 + 0.1 * i) for i in range(30)]  # 0.1 MB a minute
    assert slope_per_hour(points) == pytest.approx(6.0)


def test_noise_around_a_flat_line_is_a_small_slope() -> None:
    points = [(60.0 * i, 100 + (0.5 if i % 2 else -0.5)) for i in range(50)]
    slope = slope_per_hour(points)
    assert slope is not None
    assert abs(slope) < 0.5


def test_one_sample_or_one_instant_has_no_slope() -> None:
    assert slope_per_hour([(0.0, 1.0)]) is None
    assert slope_per_hour([(5.0, 1.0), (5.0, 2.0)]) is None


def test_a_process_started_late_is_measured_from_its_own_warm_up() -> None:
    late = Series("agent-node-1[2]", started=1200.0)
    late.points = [(1200.0 + 60 * i, 50.0 + (40 if i < 10 else 0.01 * i)) for i in range(40)]
    slopes = fitted([late], warmup=600.0, min_span=300.0, measure=slope_per_hour)
    assert slopes["agent-node-1[2]"] == pytest.approx(0.6)  # its start-up bulge left out


def test_a_series_too_short_after_its_warm_up_gets_no_slope() -> None:
    rank = Series("rank@node-1[9]", started=0.0)
    rank.points = [(60.0 * i, 300.0 + 10 * i) for i in range(14)]  # 3 minutes after warm-up
    assert fitted([rank], warmup=600.0, min_span=300.0, measure=slope_per_hour) == {}


def test_descriptors_that_come_and_go_are_not_growth_but_a_new_level_is() -> None:
    churn = [(60.0 * i, 40.0 + (12 if i % 3 == 0 else 0)) for i in range(30)]
    assert growth(churn) == 0
    leak = [(60.0 * i, 40.0 + i) for i in range(30)]
    assert growth(leak) == 64.5 - 49.5  # the last ten's median less the twenty before's
    assert growth(leak[:2]) is None


def test_descriptors_closed_for_a_sample_or_two_are_no_level_to_grow_from() -> None:
    # An agent's descriptors after the 20-minute soak's warm-up (soak-20.json): 19 from
    # its first minute to its last, but for two samples a socket or two closed.
    agent = [18, 17, 19, 19, 19, 19, 19, 19, 19, 19, 19]
    assert growth([(60.0 * i, float(v)) for i, v in enumerate(agent)]) == 0


def test_processes_are_named_for_what_they_are() -> None:
    agent = ("/venv/bin/python", "/venv/bin/pitstop-agent", "--config", "a.yaml")
    assert process_name("agent-node-1", agent, rank=False, daemon_itself=True) == "agent-node-1"
    zygote = ("/venv/bin/python", "-m", "pitstop.agent.forkserver", "--socket", "/s")
    assert process_name("agent-node-1", zygote, False, False) == "zygote-node-1"
    assert process_name("agent-node-1", ("python", "train.py"), True, False) == "rank@node-1"


def test_a_gone_daemons_segments_are_orphans_and_a_live_ones_are_not() -> None:
    instance = secrets.token_hex(6)
    node = f"pitstop-ckpt-soaktest-{secrets.token_hex(3)}-"
    marker = SHM / f"{node}{instance}.owner"
    segment = SHM / f"{node}{instance}-0"
    before = orphaned_shm_bytes(node)  # 0: a name of this test's only
    try:
        with marker.open("w") as owner:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running daemon holds it
            with segment.open("wb") as f:
                f.write(b"x" * (2 * MB))
            assert orphaned_shm_bytes(node) - before == 0
        # The lock went with its holder: the segment is an orphan now.
        assert orphaned_shm_bytes(node) - before == 2 * MB
        marker.unlink()
        assert orphaned_shm_bytes(node) - before == 2 * MB  # no marker at all
    finally:
        segment.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)


def test_an_orphan_counts_once_it_outlives_a_sample_and_a_cleared_one_never() -> None:
    killed = {("pitstop-ckpt-n1-aaaaaaaaaaaa-0", 11): 45 * MB}  # its restart clears it
    left = {("pitstop-ckpt-n2-bbbbbbbbbbbb-0", 12): 2 * MB}  # nothing ever will
    samples = [{}, killed | left, left, left, {}]
    seen, before = [], {}
    for now in samples:
        seen.append(outlived(now, before))
        before = now
    assert seen == [0, 0, 2 * MB, 2 * MB, 0]
    # A name used again by a new segment (another inode) is a new orphan.
    reused = {("pitstop-ckpt-n2-bbbbbbbbbbbb-0", 13): 2 * MB}
    assert outlived(reused, left) == 0


def test_a_segment_found_orphaned_is_keyed_by_its_name_and_inode() -> None:
    node = f"pitstop-ckpt-soaktest-{secrets.token_hex(3)}-"
    segment = SHM / f"{node}{secrets.token_hex(6)}-0"
    try:
        segment.write_bytes(b"x" * MB)
        found = orphaned_segments(node)
        assert found == {(segment.name, segment.stat().st_ino): MB}
    finally:
        segment.unlink(missing_ok=True)


def test_descriptors_are_told_apart_by_what_they_are() -> None:
    before = fd_kinds(os.getpid())
    assert before is not None
    read, write = os.pipe()
    try:
        with tempfile.NamedTemporaryFile() as f:
            after = fd_kinds(os.getpid())
            assert after is not None
            assert kinds_gained(before, after) == {"pipe": 2, f.name: 1}
    finally:
        os.close(read)
        os.close(write)


def open_fds(pid: int) -> int:
    """The descriptors the sampler counts for a process: `fd_kinds`, all kinds."""
    kinds = fd_kinds(pid)
    assert kinds is not None
    return sum(kinds.values())


def vm_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if "VmRSS" in line)


def test_a_process_memory_and_descriptors_leave_out_its_shared_segments() -> None:
    pid = os.getpid()
    sizes, fds, whole = private_rss_bytes(pid), open_fds(pid), vm_rss()
    assert sizes is not None
    assert fds is not None
    rss, anon = sizes
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="pitstop-test-") as segment:
        segment.truncate(64 * MB)
        with mmap.mmap(segment.fileno(), 64 * MB) as mapped:
            for offset in range(0, 64 * MB, mmap.PAGESIZE):
                mapped[offset] = 1  # every page resident, in this process's RSS
            assert open_fds(pid) == fds  # the segment's descriptor left out
            assert vm_rss() - whole >= 48 * MB  # in the RSS the kernel reports
            with_segment = private_rss_bytes(pid)
            assert with_segment is not None
            assert with_segment[0] - rss < 16 * MB
            with tempfile.TemporaryFile() as other:
                assert other.fileno() >= 0
                assert open_fds(pid) == fds + 1  # any other file counts
    heap = b"\x01" * (64 * MB)  # a heap that grows: in the RSS, and in its anonymous part
    grown = private_rss_bytes(pid)
    assert grown is not None
    assert grown[0] - rss >= 48 * MB
    assert grown[1] - anon >= 48 * MB
    del heap
