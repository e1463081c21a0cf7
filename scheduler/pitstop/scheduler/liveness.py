"""The liveness scan: a node whose heartbeats stop (a hung agent with its socket still
open, say) is LOST once its deadline passes.

Deadlines live in a Redis sorted set; each tick claims only what expired, so the cost
follows failures, not the fleet. It runs in the process that decides (the leader). The
process that holds a node's stream judges that stream itself and keeps its deadline
fresh while it does (AgentServicer.judge_streams): a holder busy or starved never has
its healthy nodes declared lost by the leader, and the scan is left the nodes whose
holder died or froze.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pitstop.scheduler.cancelling import reraise_if_cancelling
from pitstop.scheduler.gateway import AgentGateway
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services import health as health_service
from pitstop.scheduler.store import Store

log = logging.getLogger(__name__)

STALL_SECONDS = 1.0
"""A scan this much later than its tick means the scheduler itself stalled."""
DEADLINE_REASON = "no heartbeat before the liveness deadline (agent hung or cut off)"


class LivenessMonitor:
    def __init__(
        self,
        store: Store,
        hot: HotState,
        gateway: AgentGateway,
        *,
        tick_seconds: float,
        startup_grace_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.hot = hot
        self.gateway = gateway
        self.tick = tick_seconds
        self.grace = startup_grace_seconds
        self.clock = clock

    async def scan_once(self) -> list[str]:
        """Mark every node whose deadline passed LOST, all in one transaction (a mass
        expiry costs one commit, not one per node); returns them."""
        now = self.clock()
        lost = await self.hot.expired_nodes(now)
        if not lost:
            return []
        reason = DEADLINE_REASON
        try:
            async with self.store.write() as session:
                await health_service.mark_all_lost(session, lost, reason=reason)
        except BaseException:
            # Not recorded (a deadlock, the database down): the claims go back, or a
            # hung agent, which sends nothing more, would never be declared lost.
            await asyncio.shield(self.hot.reclaimable(lost, now))
            raise
        for node_id in lost:
            # Its stream, if still open, is stale: end it so the agent must register again.
            self.gateway.close(node_id, reason)
            log.warning("node %s lost: %s", node_id, reason)
        return lost

    async def run(self) -> None:
        await self.hot.extend_deadlines(self.clock() + self.grace)
        while True:
            started = self.clock()
            try:
                await self.scan_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                reraise_if_cancelling()
                # A store outage must not end the loop; the next tick retries.
                log.warning("liveness scan failed; retrying", exc_info=True)
            await asyncio.sleep(self.tick)
            await self._forgive_stall(self.clock() - started - self.tick)

    async def _forgive_stall(self, late: float) -> None:
        """This process was not looking for `late` seconds (a starved CPU, a pause): the
        heartbeats that came meanwhile are unread, not missing, and a deadline that
        passed while they queued says nothing about the node. Every node gets at least
        that long again before the next scan may declare it lost."""
        if late < STALL_SECONDS:
            return
        log.warning(
            "the liveness scan ran %.1fs late (this process was starved or paused); "
            "every node's heartbeat deadline is pushed back as long",
            late,
        )
        try:
            await self.hot.extend_deadlines(self.clock() + late)
        except Exception:
            reraise_if_cancelling()
            log.warning("could not push back the heartbeat deadlines", exc_info=True)
