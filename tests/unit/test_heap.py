"""A daemon's worker threads' freed buffers go back to the kernel when it trims its heap."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pitstop.common.heap import _malloc_trim

pytestmark = pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: nothing to trim")

# A worker thread allocates 80 MB in 4 KiB buffers (each a malloc of its own, in the
# thread's arena) and frees all but the last: the one kept pins the arena's top, so
# free() alone gives nothing back, as in a daemon whose thread held a shard's buffers.
SCRIPT = textwrap.dedent(
    """
    import json, threading
    from pitstop.common.heap import trim

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    kept = []
    def work():
        buffers = [bytearray(4096) for _ in range(20_000)]
        kept.append(buffers[-1])
        del buffers

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    before = rss_mb()
    released = trim()
    print(json.dumps({"before": before, "after": rss_mb(), "released": released}))
    """
)


def test_trim_gives_a_threads_freed_buffers_back() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["released"] is True
    assert seen["before"] - seen["after"] >= 40, seen
