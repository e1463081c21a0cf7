"""A node proves itself before it gets ranks: a short preflight at the agent's start
and again every `preflight_interval_seconds` while the node runs no ranks (a spare, an
idle worker). A failed preflight is a fatal node condition in every heartbeat: the
scheduler quarantines the node (UNHEALTHY, the reason in its event), so no job places
ranks on it, until a later preflight passes and an operator uncordons it. Standby
processes do not count as ranks (they touch no GPU until they take one).

The checks: every GPU's health as its readings judge it (nothing fatal; a warning
already drains the node through its heartbeats);
on real GPUs, a small matrix product on each GPU checked against its known result (in
a child process with torch: the agent never imports it; skipped, and said so once,
where torch is missing); on simulated GPUs, an injected `fail_preflight` fault fails
the next preflight. An all-reduce with a peer node is not among them yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Protocol

from pitstop.agent.conditions import NodeCondition
from pitstop.agent.gpu import GpuBackend
from pitstop.health.verdict import assess_gpu
from pitstop.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)

MATMUL_SECONDS = 120.0
"""The longest the GPU matrix products may take, CUDA's start included."""
_MATMUL = """
import sys, torch
n = 256
a = (torch.arange(n * n, dtype=torch.float32).reshape(n, n) % 7) - 3
b = (torch.arange(n * n, dtype=torch.float32).reshape(n, n).T % 5) - 2
want = a.double() @ b.double()  # small integers: exact in float32 too
bad = []
for index in range(torch.cuda.device_count()):
    got = (a.cuda(index) @ b.cuda(index)).double().cpu()
    if not torch.equal(got, want):
        bad.append(f"GPU {index}: a matrix product differs from its known result")
print("; ".join(bad))
sys.exit(1 if bad else 0)
"""


class RanksHere(Protocol):
    def running(self) -> list[agent_pb2.RunningRank]: ...


class Preflight:
    """The node's preflight, and its result as a node condition."""

    def __init__(
        self,
        backend: GpuBackend,
        supervisor: RanksHere,
        interval: float,
        *,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._backend = backend
        self._supervisor = supervisor
        self._interval = interval
        self._on_change = on_change
        self.failed = ""
        """Why the last preflight failed; empty when it passed."""
        self.runs = 0
        self._said_no_torch = False

    def conditions(self) -> list[NodeCondition]:
        if not self.failed:
            return []
        return [NodeCondition(common_pb2.HEALTH_VERDICT_FATAL, f"preflight failed: {self.failed}")]

    async def check(self) -> str:
        """Run the preflight now; why it failed ("" when it passed)."""
        failed = await asyncio.to_thread(self._check)
        self.runs += 1
        if failed != self.failed:
            if failed:
                log.error("preflight failed: %s", failed)
            else:
                log.info("preflight passed")
            self.failed = failed
            self._on_change()
        return failed

    async def run(self, stop: asyncio.Event) -> None:
        """Every interval, a preflight while no rank runs here, until `stop`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
                return
            # A standby touches no GPU until it takes a rank: a spare holding one checks.
            if not any(not r.standby for r in self._supervisor.running()):
                try:
                    await self.check()
                except Exception:  # a broken check must not end the loop: say so, go on
                    log.exception("the preflight itself failed")

    def _check(self) -> str:
        problems = []
        if self._backend.take_preflight_fault():
            problems.append("an injected preflight failure (drill)")
        for reading in self._backend.read_health():
            judged = assess_gpu(reading, previous=None)
            if judged.verdict == common_pb2.HEALTH_VERDICT_FATAL:
                problems.append("; ".join(judged.reasons) or f"GPU {reading.index} unhealthy")
        if self._backend.name == "nvml" and not problems:
            problems += self._matmul()
        return "; ".join(problems)

    def _matmul(self) -> list[str]:
        try:
            done = subprocess.run(
                [sys.executable, "-c", _MATMUL],
                capture_output=True,
                text=True,
                timeout=MATMUL_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return [f"the GPU matrix products took over {MATMUL_SECONDS:.0f} s"]
        if "No module named 'torch'" in done.stderr:
            if not self._said_no_torch:
                log.warning("preflight: no torch beside the agent, so no GPU matrix products")
                self._said_no_torch = True
            return []
        if done.returncode != 0:
            return [done.stdout.strip() or done.stderr.strip()[-300:]]
        return []
