"""A bounded CPU load: N busy processes for a given time, to try the local cluster (the
demo, the fault tests) on a loaded machine.

    .venv/bin/python scripts/cpuload.py [--procs 2] [--seconds 600]

Ends when the time is up (at most 2 h), on Ctrl-C, SIGTERM or SIGHUP, and its busy
processes die with it even when it is killed with SIGKILL. From Python:
``with pitstop.client.cpuload.cpu_load(procs=2, seconds=600): ...``.
"""

from __future__ import annotations

import argparse
import sys
import time

from pitstop.client.cpuload import (
    DEFAULT_PROCS,
    MAX_PROCS,
    MAX_SECONDS,
    CpuLoad,
    CpuLoadError,
)
from pitstop.client.signals import Terminated, orderly_exit

DEFAULT_SECONDS = 600.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--procs",
        type=int,
        default=DEFAULT_PROCS,
        help=f"busy processes, 0 to {MAX_PROCS} (default {DEFAULT_PROCS})",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"how long, at most {MAX_SECONDS:.0f} (default {DEFAULT_SECONDS:.0f})",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    try:
        load = CpuLoad(args.procs, args.seconds)
    except CpuLoadError as exc:
        print(f"error: --{exc}", file=sys.stderr)
        return 2
    began = time.monotonic()
    with orderly_exit():
        try:
            with load:
                print(
                    f"cpuload: {args.procs} busy processes for {args.seconds:g} s "
                    f"(pids {', '.join(map(str, load.pids)) or 'none'}); Ctrl-C stops them",
                    flush=True,
                )
                load.wait()
        except (KeyboardInterrupt, Terminated) as stop:
            reason = "Ctrl-C" if isinstance(stop, KeyboardInterrupt) else str(stop)
            print(f"cpuload: {reason} after {time.monotonic() - began:.1f} s; stopped", flush=True)
            return 0
    print(f"cpuload: done after {time.monotonic() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
