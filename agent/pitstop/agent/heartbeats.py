"""What the agent reports to the scheduler on its own: heartbeats with the node's health,
step times, and Xids as the driver raises them.

The agent looks at its node every heartbeat interval but sends a heartbeat only when
what it says changed, and at least every refresh interval: at 12,500 nodes the
scheduler reads what changed, not the fleet every second. That a host is alive is the
stream's keepalive pings' business, answered in gRPC's core.

A heartbeat loop runs while a stream is registered (the link starts one per stream);
Xids are pumped for the agent's whole life, and those of the kernel log are sent once,
after the first registration. Everything goes out through the link's `send`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Collection
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.agent.conditions import ConditionSource, NodeCondition, with_conditions
from pitstop.agent.config import AgentSettings
from pitstop.agent.gpu import GpuBackend
from pitstop.agent.host.watch import HostWatch
from pitstop.agent.metrics import AgentMetrics
from pitstop.health.host import gist
from pitstop.health.verdict import assess_gpu, assess_node, worst_verdict
from pitstop.health.xid import XidClass, classify_xid, verdict_for
from pitstop.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)

STEP_FLUSH_SAMPLES = 1024
"""Step samples folded since the last summary that send one before the next heartbeat."""
STEP_POLL_SECONDS = 0.1
HOST_READ_SECONDS = 2.0
"""The longest a heartbeat waits for the host's readings (files under /sys and /proc,
statvfs of the watched disks)."""


class StepSource(Protocol):
    """What the heartbeats need of the step summarizer."""

    def drain(self, due: bool = True) -> list[agent_pb2.StepSummary]: ...
    def forget_idle(self, active: Collection[str], now: float) -> list[str]: ...
    @property
    def pending(self) -> int: ...
    @property
    def dropped(self) -> int: ...


class RunningRanks(Protocol):
    """What the heartbeats need of the rank supervisor."""

    def running(self) -> list[agent_pb2.RunningRank]: ...
    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]: ...


def _gist(beat: agent_pb2.Heartbeat) -> tuple[object, ...]:
    """What the scheduler acts on in a heartbeat: the verdicts and their reasons (node,
    GPUs and host) and which processes run (not their step, nor the GPUs' temperatures
    and counters, which change at every look and are sent with the refresh). A host
    reason counts without its numbers: a disk filling or memory pressure moving says a
    new number every look, and is the same news until its verdict changes."""
    health = beat.health
    host = set(health.host.reasons)
    return (
        health.verdict,
        tuple(r for r in health.reasons if r not in host),
        tuple((g.index, g.verdict, tuple(g.reasons)) for g in health.gpus),
        health.host.verdict,
        gist(health.host.reasons),
        tuple(
            sorted(
                (r.job_id, r.generation, r.rank, r.pid, r.standby, r.ready)
                for r in beat.running_ranks
            )
        ),
    )


def timestamp(seconds: float) -> Timestamp:
    """`seconds` since the epoch as a protobuf Timestamp."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


class Heartbeats:
    """The node's health, step times and Xids, sent through `send` (the link's outbox)."""

    def __init__(
        self,
        settings: AgentSettings,
        backend: GpuBackend,
        supervisor: RunningRanks,
        steps: StepSource,
        metrics: AgentMetrics,
        *,
        send: Callable[..., None],
        clock: Callable[[], float],
        conditions: Collection[ConditionSource] = (),
        host: HostWatch | None = None,
    ) -> None:
        self._settings = settings
        self._host = host
        self._host_read: asyncio.Future[common_pb2.HostHealth] | None = None
        self._backend = backend
        self._supervisor = supervisor
        self._steps = steps
        self._metrics = metrics
        self._send = send
        self._clock = clock
        self._conditions = tuple(conditions)
        self._xid_inbox: asyncio.Queue[common_pb2.XidEvent] = asyncio.Queue()
        self._recent_xids: defaultdict[int, list[int]] = defaultdict(list)
        self._previous: dict[int, common_pb2.GpuHealth] = {}
        self._beat_now = asyncio.Event()
        self._dropped_seen = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.latest: common_pb2.NodeHealth | None = None
        """The node's health as the last heartbeat judged it; None before the first.
        What the Kubernetes publisher reads."""
        # What the last heartbeat sent said (_gist), and when (loop time): the loop sends
        # again when that changes, and an ack that carried a heartbeat counts as one.
        self._sent: tuple[object, ...] | None = None
        self._sent_at = -math.inf

    # Heartbeats and step times

    async def run(
        self, interval: float, refresh: float | None = None, steps_every: float = 0.0
    ) -> None:
        """Look at the node every `interval` seconds (sooner after `beat_soon`) until
        cancelled: send a heartbeat when what it says changed (`_gist`), and at least
        every `refresh` seconds (default: every look); report step times every
        `steps_every` seconds (default: every look), a generation's first steps at the
        look after them, and between looks once enough wait."""
        loop = asyncio.get_running_loop()
        refresh = max(refresh or interval, interval)
        steps_every = max(steps_every, interval)
        self._sent, self._sent_at = None, -math.inf  # a new stream hears everything anew
        steps_at = -math.inf
        while True:
            self._beat_now.clear()
            try:
                beat = await self._look()
                gist, now = _gist(beat), loop.time()
                # Half a look early: a refresh equal to the interval sends every look.
                if gist != self._sent or now - self._sent_at >= refresh - interval / 2:
                    self._send(heartbeat=beat)
                    self._sent, self._sent_at = gist, now
                due = now - steps_at >= steps_every - interval / 2
                self.flush_steps(due=due)
                if due:
                    steps_at = now
            except Exception:  # a bad beat must not end the heartbeats: liveness hangs on them
                log.exception("building a heartbeat failed")
            deadline = loop.time() + interval
            while (remaining := deadline - loop.time()) > 0:
                try:
                    await asyncio.wait_for(self._beat_now.wait(), min(remaining, STEP_POLL_SECONDS))
                    break
                except TimeoutError:
                    if self._steps.pending >= STEP_FLUSH_SAMPLES:
                        self.flush_steps()

    async def _look(self, *, read_host: bool = True) -> agent_pb2.Heartbeat:
        """The node's health and running ranks now, as a heartbeat; without `read_host`,
        the host as the last look judged it (a command's ack waits for no host read)."""
        try:
            readings = await asyncio.to_thread(self._backend.read_health)
        except Exception as exc:
            log.exception("reading GPU health failed")
            health = common_pb2.NodeHealth(
                verdict=common_pb2.HEALTH_VERDICT_WARNING,
                reasons=[f"reading GPU health failed: {type(exc).__name__}: {exc}"],
            )
        else:
            self._drain_xid_inbox()
            recent, self._recent_xids = self._recent_xids, defaultdict(list)
            assessed = [
                assess_gpu(r, previous=self._previous.get(r.index), xids=recent.get(r.index, ()))
                for r in readings
            ]
            self._previous = {r.index: r for r in readings}
            health = assess_node(assessed)
            self._metrics.observe_health(health.gpus)
        # Beyond the GPUs: the host (links, memory, disks, PCIe), and a node daemon that
        # is down (the checkpoint daemon).
        found = [c for s in self._conditions for c in s.conditions()]
        if self._host is not None:
            latest = self._host.latest
            host = await self._look_at_host() if read_host or latest is None else latest
            health.host.CopyFrom(host)
            found += [NodeCondition(host.verdict, reason) for reason in host.reasons]
        health = with_conditions(health, found)
        running = self._supervisor.running()
        self._metrics.ranks_running.labels(self._settings.node_id).set(len(running))
        self.latest = health
        return agent_pb2.Heartbeat(
            time=timestamp(self._clock()), health=health, running_ranks=running
        )

    async def _look_at_host(self) -> common_pb2.HostHealth:
        """The host now, judged. A read that fails is reported degraded, saying why; one
        that does not finish within HOST_READ_SECONDS (a hung NFS mount under a watched
        path) is too, with the last reading, and no second read starts beside it: a
        stuck read never holds the heartbeat, which liveness hangs on."""
        host = self._host
        assert host is not None
        read = self._host_read
        if read is None or read.done():
            if read is not None and not read.cancelled():
                read.exception()  # a read that outlived its look: its news is stale now
            now = asyncio.get_running_loop().time()
            read = self._host_read = asyncio.ensure_future(asyncio.to_thread(host.look, now))
        try:
            judged = await asyncio.wait_for(asyncio.shield(read), HOST_READ_SECONDS)
        except TimeoutError:
            why = f"reading the host's health took over {HOST_READ_SECONDS:g} s"
        except Exception as exc:
            log.exception("reading the host's health failed")
            why = f"reading the host's health failed: {type(exc).__name__}: {exc}"
        else:
            self._metrics.observe_host(judged)
            return judged
        stale = common_pb2.HostHealth()
        if host.latest is not None:
            stale.CopyFrom(host.latest)
        stale.reasons.append(why)
        stale.verdict = worst_verdict([stale.verdict, common_pb2.HEALTH_VERDICT_DEGRADED])
        return stale

    async def carried(self) -> agent_pb2.Heartbeat:
        """A heartbeat of the node now, to go with a command's ack instead of after it,
        and counted as sent (the loop sends the next one only when something changes
        again)."""
        beat = await self._look(read_host=False)
        self._sent, self._sent_at = _gist(beat), asyncio.get_running_loop().time()
        return beat

    def beat_soon(self) -> None:
        """Send a heartbeat now rather than at the next interval (the node's health
        changed); a no-op while no stream is registered."""
        self._beat_now.set()

    def flush_steps(self, due: bool = True) -> None:
        """Send the step summaries of what the ranks reported since the last flush (with
        `due` False, only the news the scheduler acts on at once: StepSummarizer.drain),
        and count the window summaries dropped."""
        dropped = self._steps.dropped
        if dropped > self._dropped_seen:
            self._metrics.samples_dropped.labels(self._settings.node_id).inc(
                dropped - self._dropped_seen
            )
            self._dropped_seen = dropped
        for summary in self._steps.drain(due):
            self._send(step_summary=summary)
            self._metrics.steps_reported.labels(self._settings.node_id, summary.job_id).inc(
                summary.samples
            )
        if due:  # what the node keeps of a job that left it goes, its series too
            active = {rank.job_id for rank in self._supervisor.running()}
            for job_id in self._steps.forget_idle(active, self._clock()):
                with contextlib.suppress(KeyError):
                    self._metrics.steps_reported.remove(self._settings.node_id, job_id)

    # Xids

    def watch_xids(self) -> None:
        """Have the backend report Xids from now on; call on the agent's event loop, then
        run `pump_xids` there."""
        self._loop = asyncio.get_running_loop()
        self._backend.start_xid_watch(self._xid_from_driver)

    def _xid_from_driver(self, event: common_pb2.XidEvent) -> None:
        # Called on the backend's watch thread (or inline by the simulator).
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the agent is stopping
                loop.call_soon_threadsafe(self._xid_inbox.put_nowait, event)

    async def pump_xids(self) -> None:
        """Judge and send each Xid the driver raises, until cancelled."""
        while True:
            self._accept_xid(await self._xid_inbox.get())

    def _drain_xid_inbox(self) -> None:
        while not self._xid_inbox.empty():
            self._accept_xid(self._xid_inbox.get_nowait())

    def _accept_xid(self, event: common_pb2.XidEvent, *, live: bool = True) -> None:
        xid = common_pb2.XidEvent()
        xid.CopyFrom(event)
        info = classify_xid(xid.xid)
        xid.verdict = verdict_for(info.xid_class)
        if live:
            # Kernel-log Xids are history: sent for the record, not judged again.
            self._recent_xids[xid.gpu_index].append(xid.xid)
            self._metrics.observe_xid(xid)
            log.warning(
                "GPU %d (%s): Xid %d (%s): %s",
                xid.gpu_index,
                xid.gpu_uuid,
                xid.xid,
                info.name,
                common_pb2.HealthVerdict.Name(xid.verdict),
            )
            if info.xid_class in (XidClass.APPLICATION, XidClass.FATAL):
                # The contexts on the GPU are broken (application), or the GPU itself
                # (fatal): the ranks there would crash or hang in their next kernel, or
                # worse, step on with a GPU that computes wrong numbers. End them now:
                # their peers stop at the next collective and wait for the scheduler's
                # decision (restart in place; a replacement for a fatal Xid) instead of
                # waiting on a collective timeout or training on without the decision.
                self._supervisor.kill_gpu(xid.gpu_index, f"Xid {xid.xid} ({info.name})")
        self._send(xid=xid)

    async def send_kernel_log_xids(self) -> None:
        """Send the Xids the kernel log holds from before the agent started, unjudged."""
        try:
            events = await asyncio.to_thread(self._backend.kernel_log_xids)
        except Exception:
            log.exception("reading Xids from the kernel log failed")
            return
        for event in events:
            self._accept_xid(event, live=False)
