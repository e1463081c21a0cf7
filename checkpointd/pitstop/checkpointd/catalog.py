"""The daemon's side of the scheduler's CheckpointCatalogService.

Reports are batched: shards gained and dropped and failed flushes accumulate while a
report is in flight and go in the next one. Each names the jobs the daemon holds
snapshots of, and the answer says which ended: their memory is freed. A scheduler that
is down, or that does not serve the catalog yet, is an outage to wait out with backoff,
never an error that stops the daemon: what was not reported stays queued. The buddy
comes from the configuration when one is given, else from GetBuddy, cached and
refreshed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

import grpc

from pitstop.checkpointd.store import Tier
from pitstop.common.tls import NodeIdentity, open_channel
from pitstop.rankside.shards import ShardId
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

log = logging.getLogger(__name__)

CALL_TIMEOUT_SECONDS = 10.0
MAX_FLUSH_ERRORS = 100
"""Failed-flush messages kept for the next report; older ones are dropped."""
_FIRST_RETRY_SECONDS = 0.1
IDLE_REPORT_SECONDS = 30.0
"""A daemon holding snapshots with nothing to report asks this often (by default)
whether their jobs ended: one cheap read a node; a node stepping a job reports far more
often anyway."""


@dataclass(frozen=True)
class Buddy:
    """Where this node replicates to."""

    node_id: str
    address: str


class CatalogClient:
    """Reports to the scheduler's checkpoint catalog; asks it for the buddy."""

    def __init__(
        self,
        scheduler: str,
        node_id: str,
        *,
        token: str = "",
        static_buddy: str = "",
        retry_max_seconds: float = 30.0,
        buddy_refresh_seconds: float = 30.0,
        identity: NodeIdentity | None = None,
        idle_report_seconds: float = IDLE_REPORT_SECONDS,
    ) -> None:
        self.node_id = node_id
        self._idle_report = idle_report_seconds
        self._static_buddy = Buddy("", static_buddy) if static_buddy else None
        self._retry_max = retry_max_seconds
        self._buddy_refresh = buddy_refresh_seconds
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = (
            open_channel(scheduler, identity, to_scheduler=True, aio=True) if scheduler else None
        )
        self._stub = (
            checkpoint_pb2_grpc.CheckpointCatalogServiceStub(self._channel)
            if self._channel
            else None
        )
        self._added: dict[tuple[ShardId, Tier], checkpoint_pb2.ShardInfo] = {}
        self._removed: dict[tuple[ShardId, Tier], checkpoint_pb2.ShardKey] = {}
        self._errors: deque[str] = deque(maxlen=MAX_FLUSH_ERRORS)
        self._wake = asyncio.Event()
        self._buddy: Buddy | None = None
        self._buddy_at = -float("inf")
        self.committed_steps: dict[str, int] = {}
        """Newest committed step per job, as of the last report's answer."""
        self.reports_sent = 0
        self.held_jobs: Callable[[], Collection[str]] = tuple
        """The jobs the daemon holds snapshots of (each report asks which ended)."""
        self.on_ended: Callable[[list[str]], None] = lambda _jobs: None
        """Called with the held jobs a report's answer says ended."""
        # Until the first report lands, it tells the scheduler this daemon is new.
        self._fresh_start = True
        self._wake.set()

    @property
    def pending(self) -> int:
        """Items waiting for the next report."""
        return len(self._added) + len(self._removed) + len(self._errors)

    def shard_added(self, info: checkpoint_pb2.ShardInfo, tier: Tier) -> None:
        """Queue a shard this node now holds in `tier`."""
        key = info.header.key
        shard = (ShardId(key.job_id, key.rank, key.step), tier)
        if self._removed.pop(shard, None) is None:
            self._added[shard] = info
        self._wake.set()

    def shard_removed(self, shard: ShardId, generation: int, tier: Tier) -> None:
        """Queue a shard this node no longer holds in `tier`."""
        if self._added.pop((shard, tier), None) is None:
            self._removed[(shard, tier)] = checkpoint_pb2.ShardKey(
                job_id=shard.job_id, rank=shard.rank, step=shard.step, generation=generation
            )
        self._wake.set()

    def flush_failed(self, message: str) -> None:
        """Queue a failed durable flush, in words."""
        self._errors.append(message)
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Send reports until `stop` is set; back off while the scheduler fails them."""
        if self._stub is None:
            await stop.wait()
            return
        delay = 0.0
        failures = 0
        while not stop.is_set():
            if delay:
                await _wait(stop, delay * random.uniform(0.5, 1.0))
            elif not (self.pending or self._fresh_start):
                self._wake.clear()
                # Asleep until there is something to report; with snapshots held, a
                # report every idle_report_seconds asks whether their jobs ended.
                idle = self._idle_report if self.held_jobs() else None
                await _wait_any(stop, self._wake, timeout=idle)
            held = sorted(self.held_jobs())
            if stop.is_set() or not (self.pending or self._fresh_start or held):
                continue
            added, self._added = self._added, {}
            removed, self._removed = self._removed, {}
            errors = list(self._errors)
            self._errors.clear()
            request = checkpoint_pb2.ReportShardsRequest(
                node_id=self.node_id,
                added=list(added.values()),
                removed=[k for (_, tier), k in removed.items() if tier is not Tier.DURABLE],
                removed_durable=[k for (_, tier), k in removed.items() if tier is Tier.DURABLE],
                flush_errors=errors,
                fresh_start=self._fresh_start,
                buddy_node_id=self._buddy.node_id if self._buddy is not None else "",
                held_jobs=held,
            )
            try:
                response = await self._stub.ReportShards(
                    request, timeout=CALL_TIMEOUT_SECONDS, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                failures += 1
                level = logging.WARNING if failures in (1, 10, 100) else logging.DEBUG
                log.log(
                    level,
                    "report to the scheduler failed (%d in a row), kept for retry: %s %s",
                    failures,
                    exc.code().name,
                    exc.details(),
                )
                for shard, info in added.items():
                    self._added.setdefault(shard, info)
                for shard, key in removed.items():
                    self._removed.setdefault(shard, key)
                self._errors.extendleft(reversed(errors))
                delay = min(self._retry_max, max(_FIRST_RETRY_SECONDS, delay * 2))
                continue
            failures, delay = 0, 0.0
            self._fresh_start = False
            self.reports_sent += 1
            self.committed_steps.update(response.committed_steps)
            if response.ended_jobs:
                for job_id in response.ended_jobs:
                    self.committed_steps.pop(job_id, None)
                self.on_ended(list(response.ended_jobs))
            if response.buddy_unfit and self._buddy is not None:
                # Its node is lost or being replaced: replicas there would count for
                # nothing. The next push asks for another buddy.
                log.info("buddy %s can hold no replicas now; asking for another", self._buddy)
                self.forget_buddy()

    @property
    def may_name_buddy(self) -> bool:
        """Whether the scheduler may name a buddy later (none is configured, and there
        is a scheduler to ask)."""
        return self._static_buddy is None and self._stub is not None

    async def buddy(self) -> Buddy | None:
        """The buddy to replicate to: the configured one, else the scheduler's answer
        (cached for a while; the last known one while the scheduler is unreachable)."""
        if self._static_buddy is not None:
            return self._static_buddy
        if self._stub is None or time.monotonic() - self._buddy_at < self._buddy_refresh:
            return self._buddy
        try:
            response = await self._stub.GetBuddy(
                checkpoint_pb2.GetBuddyRequest(node_id=self.node_id),
                timeout=CALL_TIMEOUT_SECONDS,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("GetBuddy failed: %s %s", exc.code().name, exc.details())
            return self._buddy
        address = response.buddy_address
        # "None yet" is not kept: a shard waiting for a buddy asks again on its retry.
        self._buddy_at = time.monotonic() if address else -float("inf")
        self._buddy = Buddy(response.buddy_node_id, address) if address else None
        return self._buddy

    def last_committed(self, job_id: str) -> int | None:
        """The job's committed step as of the last report's answer (0 before any); None
        without a scheduler, where nothing ever commits a step."""
        if self._stub is None:
            return None
        return self.committed_steps.get(job_id, 0)

    def known_buddy(self) -> Buddy | None:
        """The buddy as last known, without asking the scheduler."""
        return self._static_buddy or self._buddy

    def forget_buddy(self) -> None:
        """Ask the scheduler again next time (the buddy stopped answering)."""
        self._buddy_at = -float("inf")

    async def committed_step(self, job_id: str) -> int:
        """The job's committed step per the scheduler; 0 when unknown or unreachable."""
        if self._stub is None:
            return 0
        try:
            response = await self._stub.GetRestorePoint(
                checkpoint_pb2.GetRestorePointRequest(job_id=job_id),
                timeout=CALL_TIMEOUT_SECONDS,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("GetRestorePoint(%s) failed: %s", job_id, exc.code().name)
            return 0
        return int(response.committed_step)

    async def members(self, job_id: str) -> set[str] | None:
        """The nodes running a rank of the job now, per the scheduler; None when it
        cannot say (unreachable, or no scheduler)."""
        if self._stub is None:
            return None
        try:
            response = await self._stub.GetRestorePoint(
                checkpoint_pb2.GetRestorePointRequest(job_id=job_id),
                timeout=CALL_TIMEOUT_SECONDS,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("GetRestorePoint(%s) failed: %s", job_id, exc.code().name)
            return None
        return set(response.member_node_ids)

    async def holders(self, job_id: str, rank: int, step: int) -> list[str]:
        """host:port of the other nodes' daemons that hold the rank's shard of `step` in
        memory, per the scheduler; empty when unknown or unreachable."""
        if self._stub is None:
            return []
        try:
            response = await self._stub.GetRestorePoint(
                checkpoint_pb2.GetRestorePointRequest(job_id=job_id, step=step),
                timeout=CALL_TIMEOUT_SECONDS,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("GetRestorePoint(%s) failed: %s", job_id, exc.code().name)
            return []
        if rank not in response.locations:
            return []
        where = response.locations[rank]
        return [
            address
            for node_id, address in zip(where.node_ids, where.addresses, strict=False)
            if address and node_id != self.node_id
        ]

    async def close(self) -> None:
        """Close the channel; what was not reported is lost with the daemon's memory."""
        if self._channel is not None:
            await self._channel.close()


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _wait_any(*events: asyncio.Event, timeout: float | None = None) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
