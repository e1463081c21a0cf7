"""bench/soak.py's measurements: what is sampled every minute (every pitstop process's
RSS and open descriptors, both less its /dev/shm segments, Redis, PostgreSQL, /dev/shm)
and the slopes read from it.

A process is followed by its pid: one restarted by a fault (an agent killed, a
scheduler failed over) is a new series with a warm-up of its own. A slope is a
least-squares fit over a series' samples from the end of its warm-up on; a series
shorter than `min_span` after its warm-up is listed but gets no slope (a few minutes of
RSS say nothing about an hour)."""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from pitstop.checkpointd.instances import MARKER_SUFFIX, SEGMENT_PREFIX
from pitstop.client.localcluster.processes import tagged_processes

MB = 1024 * 1024
SHM = Path("/dev/shm")
SEGMENT = re.compile(rf"{re.escape(SEGMENT_PREFIX)}.*?([0-9a-f]{{12}})-\d+")
"""A checkpoint daemon's segment: its instance's marker is the name up to the instance
id, plus MARKER_SUFFIX (pitstop.checkpointd.instances)."""


@dataclass
class Series:
    """One quantity over time: (seconds since the run began, value) pairs."""

    name: str
    started: float = 0.0
    """When what it measures started (a process: its first sample), run seconds."""
    points: list[tuple[float, float]] = field(default_factory=list)

    def after(self, warmup: float) -> list[tuple[float, float]]:
        """The samples from `warmup` s after it started on."""
        return [(t, v) for t, v in self.points if t >= self.started + warmup]


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of value over time, per hour (None under 2 distinct times)."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 3600


def growth(points: Sequence[tuple[float, float]]) -> float | None:
    """The median of the last third less the median of all before it: what a count
    that comes and goes with the work (descriptors of the sockets a job's ranks open)
    gained for good. A connection open at one sample is not a new level, nor one closed
    at a sample or two (a stream between reconnects) a lower one to
    grow from. None under three samples."""
    if len(points) < 3:
        return None
    third = max(len(points) // 3, 1)
    return statistics.median(v for _, v in points[-third:]) - statistics.median(
        v for _, v in points[:-third]
    )


def fitted(
    series: Sequence[Series], warmup: float, min_span: float, measure: Callable[..., float | None]
) -> dict[str, float]:
    """`measure` of every series whose samples after its warm-up span `min_span` s."""
    out = {}
    for s in series:
        points = s.after(warmup)
        if points and points[-1][0] - points[0][0] >= min_span:
            value = measure(points)
            if value is not None:
                out[s.name] = round(value, 3)
    return out


def process_name(daemon: str, argv: Sequence[str], rank: bool, daemon_itself: bool) -> str:
    """What a tagged process is: its daemon's name (``agent-node-1``), the zygote an
    agent keeps (``zygote-node-1``), or a rank or standby an agent started."""
    if daemon_itself:
        return daemon
    if rank:
        return f"rank@{daemon.removeprefix('agent-')}"
    if "pitstop.agent.forkserver" in argv:
        return f"zygote-{daemon.removeprefix('agent-')}"
    return f"{daemon}/{Path(argv[0]).name if argv else '?'}"


def private_rss_bytes(pid: int) -> tuple[int, int] | None:
    """The process's RSS less its shared memory, and of that its anonymous part: the
    snapshot segments a checkpoint daemon or a rank maps come and go with the job
    running and are measured as /dev/shm; what a leak grows is the rest, and of the
    rest the heap (anonymous) rather than the pages of its libraries (file-backed)."""
    fields: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "VmRSS" not in fields:
        return None
    return fields["VmRSS"] - fields.get("RssShmem", 0), fields.get("RssAnon", 0)


def fd_kinds(pid: int) -> Counter[str] | None:
    """The process's open descriptors but those of /dev/shm segments (measured there), by
    what they are: a file by its path, the rest by kind (``socket``, ``pipe``,
    ``anon_inode:[eventfd]``), so a count that grew says what grew."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    kinds: Counter[str] = Counter()
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed since the listing
        if not target.startswith(f"{SHM}/"):
            kinds[_kind(target)] += 1
    return kinds


def _kind(target: str) -> str:
    """``socket:[123]`` -> ``socket``; a path or an ``anon_inode:[eventfd]`` as it is."""
    kind, bracket, _ = target.partition(":[")
    return kind if bracket and kind in ("socket", "pipe", "net") else target


def shm_bytes(prefixes: Sequence[str] = ("pitstop",)) -> int:
    """Bytes held by the files in /dev/shm whose names start with one of `prefixes`."""
    total = 0
    for entry in SHM.iterdir() if SHM.is_dir() else ():
        if entry.name.startswith(tuple(prefixes)):
            try:
                total += entry.stat().st_blocks * 512
            except OSError:
                continue
    return total


def locked_files() -> set[tuple[int, int, int]]:
    """(device major, minor, inode) of each file some process holds a lock on, from
    /proc/locks: read, never taken, so a daemon's cleanup never finds a marker locked
    by this sampler."""
    found = set()
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = [f for f in line.split() if f != "->"]  # "->": a waiter
            if len(fields) > 5 and fields[5].count(":") == 2:
                major, minor, inode = fields[5].split(":")
                found.add((int(major, 16), int(minor, 16), int(inode)))
    return found


def orphaned_segments(prefix: str = SEGMENT_PREFIX) -> dict[tuple[str, int], int]:
    """The checkpoint daemons' segments in /dev/shm whose daemon instance is gone (its
    marker missing or unlocked), (name, inode) -> bytes: what nothing will ever free but
    a cleanup. A live daemon's segments are bounded by its memory budget and come and go
    with the jobs; these are what would grow. (`prefix`: of those names only.)"""
    locked, found = locked_files(), {}
    for entry in SHM.iterdir() if SHM.is_dir() else ():
        match = SEGMENT.fullmatch(entry.name)
        if not match or not entry.name.startswith(prefix):
            continue
        marker = SHM / f"{entry.name[: match.end(1)]}{MARKER_SUFFIX}"
        try:
            st = marker.stat()
            if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in locked:
                continue  # its daemon runs
        except OSError:
            pass  # no marker: its daemon is gone
        with contextlib.suppress(OSError):
            st = entry.stat()
            found[(entry.name, st.st_ino)] = st.st_blocks * 512
    return found


def orphaned_shm_bytes(prefix: str = SEGMENT_PREFIX) -> int:
    """Bytes of `orphaned_segments`."""
    return sum(orphaned_segments(prefix).values())


def outlived(now: dict[tuple[str, int], int], before: Collection[tuple[str, int]]) -> int:
    """Bytes of the orphans `now` that were orphans at the sample `before` too. A daemon
    killed by a fault leaves its segments until its restart clears them, seconds later;
    a sample that falls in between sees them once. One that outlives a sample interval
    is left for good."""
    return sum(size for key, size in now.items() if key in before)


class Sampler(threading.Thread):
    """Every `every` s: each pitstop process of the cluster in `state_dir` (RSS, open
    descriptors), Redis `used_memory`, the PostgreSQL database's size and each table's
    rows, the pitstop files in /dev/shm. A store that does not answer (restarted by a
    fault) is asked again at the next sample."""

    def __init__(
        self, state_dir: Path, redis_url: str, postgres_url: str, every: float = 60.0
    ) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.state_dir, self.redis_url, self.postgres_url = state_dir, redis_url, postgres_url
        self.every = every
        self.began = time.monotonic()
        self.stop = threading.Event()
        self.rss: dict[int, Series] = {}
        self.anon: dict[int, Series] = {}
        """Of each process's RSS its anonymous part: where a heap that grows shows."""
        self.fds: dict[int, Series] = {}
        self.redis = Series("redis_used_memory_mb")
        self.postgres = Series("postgres_database_mb")
        self.shm = Series("dev_shm_mb")
        self.orphaned = Series("dev_shm_orphaned_mb")
        """Orphaned segments that outlived a sample interval (`outlived`)."""
        self._orphans: dict[tuple[str, int], int] = {}
        self.kinds_first: dict[int, Counter[str]] = {}
        self.kinds_last: dict[int, Counter[str]] = {}
        """Each process's descriptors by kind at its first and its latest sample."""
        self.rows: dict[str, Series] = {}
        self.table_mb: dict[str, Series] = {}
        """Each table's size with its indexes and TOAST, MB: where the database grows."""
        self.samples = 0
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.every)

    def sample(self) -> None:
        now = time.monotonic() - self.began
        for proc in tagged_processes(self.state_dir):
            name = process_name(proc.daemon, proc.argv, proc.rank, proc.is_daemon())
            sizes, kinds = private_rss_bytes(proc.pid), fd_kinds(proc.pid)
            if sizes is None or kinds is None:
                continue
            rss, anon = sizes
            fds = sum(kinds.values())
            self.kinds_first.setdefault(proc.pid, kinds)
            self.kinds_last[proc.pid] = kinds
            label = f"{name}[{proc.pid}]"
            self.rss.setdefault(proc.pid, Series(label, now)).points.append((now, rss / MB))
            self.anon.setdefault(proc.pid, Series(label, now)).points.append((now, anon / MB))
            self.fds.setdefault(proc.pid, Series(label, now)).points.append((now, fds))
        self.shm.points.append((now, shm_bytes() / MB))
        orphans = orphaned_segments()
        self.orphaned.points.append((now, outlived(orphans, self._orphans) / MB))
        self._orphans = orphans
        self._stores(now)
        self.samples += 1

    def _stores(self, now: float) -> None:
        try:
            with redis.Redis.from_url(self.redis_url, socket_timeout=5) as client:
                used = int(client.info("memory")["used_memory"])
            self.redis.points.append((now, used / MB))
        except (redis.RedisError, OSError) as exc:
            self.errors.append(f"redis at +{now:.0f} s: {exc}")
        try:
            with psycopg.connect(self.postgres_url, connect_timeout=5, autocommit=True) as conn:
                size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
                tables = conn.execute(
                    "SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables"
                    " ORDER BY relname"
                ).fetchall()
                for table, total in tables:
                    count = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
                    series = self.rows.setdefault(table, Series(table))
                    series.points.append((now, count[0] if count else 0))
                    sized = self.table_mb.setdefault(table, Series(table))
                    sized.points.append((now, total / MB))
            self.postgres.points.append((now, (size[0] if size else 0) / MB))
        except psycopg.Error as exc:
            self.errors.append(f"postgres at +{now:.0f} s: {exc}")

    def summary(self, warmup: float, min_span: float, store_warmup: float) -> dict[str, Any]:
        """Slopes after the warm-up (Redis', PostgreSQL's and their tables' after
        `store_warmup`); the processes too short-lived to have one."""
        rss = fitted(list(self.rss.values()), warmup, min_span, slope_per_hour)
        anon = fitted(list(self.anon.values()), warmup, min_span, slope_per_hour)
        fds = fitted(list(self.fds.values()), warmup, min_span, growth)
        stores = [self.redis, self.postgres, self.shm, self.orphaned]
        slopes = fitted(stores[:2], store_warmup, min_span, slope_per_hour)
        slopes |= fitted(stores[2:], warmup, min_span, slope_per_hour)
        rows = fitted(list(self.rows.values()), store_warmup, min_span, slope_per_hour)
        sizes = fitted(list(self.table_mb.values()), store_warmup, min_span, slope_per_hour)
        ends = {s.name: s.points[-1][1] for s in stores if s.points}
        return {
            "samples": self.samples,
            "sample_seconds": self.every,
            "warmup_seconds": warmup,
            "store_warmup_seconds": round(store_warmup, 1),
            "min_span_seconds": min_span,
            "rss_slope_mb_per_hour_max": max(rss.values(), default=None),
            "fd_growth_max": max(fds.values(), default=None),
            "redis_slope_mb_per_hour": slopes.get(self.redis.name),
            "pg_slope_mb_per_hour": slopes.get(self.postgres.name),
            "shm_slope_mb_per_hour": slopes.get(self.shm.name),
            "shm_orphaned_slope_mb_per_hour": slopes.get(self.orphaned.name),
            "rss_slope_mb_per_hour": dict(sorted(rss.items())),
            "rss_anon_slope_mb_per_hour": dict(sorted(anon.items())),
            "fd_growth": dict(sorted(fds.items())),
            # What a process's descriptors that grew were, its last sample less its first.
            "fd_kinds_gained": {
                s.name: kinds_gained(self.kinds_first[pid], self.kinds_last[pid])
                for pid, s in self.fds.items()
                if fds.get(s.name)
            },
            "rss_mb_last": {
                s.name: round(s.points[-1][1], 1) for s in self.rss.values() if s.name in rss
            },
            "too_short_for_a_slope": sorted(s.name for s in self.rss.values() if s.name not in rss),
            "rows_slope_per_hour": rows,
            "rows_last": {name: s.points[-1][1] for name, s in sorted(self.rows.items())},
            "table_mb_slope_per_hour": sizes,
            "table_mb_last": {
                name: round(s.points[-1][1], 3) for name, s in sorted(self.table_mb.items())
            },
            "stores_last": {k: round(v, 2) for k, v in ends.items()},
            "errors": self.errors[-10:],
            # The samples behind the slopes, to fit them again: (run seconds, value).
            "series": {
                **{s.name: _points(s) for s in stores},
                **{f"rss {s.name}": _points(s) for s in self.rss.values() if s.name in rss},
                **{f"anon {s.name}": _points(s) for s in self.anon.values() if s.name in anon},
                **{f"fds {s.name}": _points(s) for s in self.fds.values() if s.name in fds},
            },
        }


def kinds_gained(first: Counter[str], last: Counter[str]) -> dict[str, int]:
    """Each kind of descriptor whose count differs between two samples, by how much."""
    return {
        k: last[k] - first[k] for k in sorted(first.keys() | last.keys()) if last[k] != first[k]
    }


def _points(series: Series) -> list[tuple[int, float]]:
    return [(round(t), round(v, 3)) for t, v in series.points]
