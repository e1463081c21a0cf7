"""The Slurm adapter: a loop of the leader's that keeps Slurm in step with pitstop's node
states. Every node pitstop holds unhealthy or lost is drained in Slurm with pitstop's
reason (`scontrol update nodename=N state=drain reason="pitstop: lost: ..."`), asked
for again in every pass until Slurm shows it, then recorded (`node.slurm_drained`).
With a replacement command configured, a failed node drained in Slurm while no idle spare
is left gets one replacement allocation (`node.slurm_replacement_requested`), which joins
as a spare when it starts.

Everything it needs to go on is in PostgreSQL (`slurm_drains`) or in Slurm: a restarted
scheduler, or another one taking the lead, reads both and carries on. A replacement's
Slurm job name is committed before the request runs, and a request is made only while
Slurm lists no job of that name, so it is not made twice. Slurm's commands run outside
every transaction; the record changes check the leader's fencing token."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shlex
import time
from collections.abc import Callable, Mapping, Sequence

from sqlalchemy import exists, func, select

from pitstop.scheduler.cancelling import reraise_if_cancelling
from pitstop.scheduler.config import SchedulerSettings
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import NodeRole, NodeState
from pitstop.scheduler.leader import LeaderElection
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.slurm.commands import (
    Slurm,
    SlurmUnavailable,
    SubprocessRunner,
    parse_sbatch,
)
from pitstop.scheduler.slurm.decide import (
    DrainPlan,
    DrainRecord,
    FailedNode,
    drain_reason,
    plan_drains,
    plan_submissions,
    settled,
)
from pitstop.scheduler.store import Store

log = logging.getLogger(__name__)

ACTOR = "scheduler:slurm"
FAILED_STATES = (NodeState.UNHEALTHY, NodeState.LOST)
SECRET_ENV = ("PITSTOP_DATABASE_URL", "PITSTOP_REDIS_URL", "PITSTOP_TOKENS", "PITSTOP_TOKEN")
"""The scheduler's own secrets, kept out of a replacement request's environment."""
MIN_PASS_GAP_SECONDS = 0.25
"""Passes woken by events come no closer than this: each may run sinfo."""
MAX_RETRY_SECONDS = 60.0
"""A replacement request that failed is retried after a pass, then twice as late, up to this."""


class SlurmAdapter:
    def __init__(
        self,
        store: Store,
        election: LeaderElection,
        slurm: Slurm,
        *,
        node_names: Mapping[str, str] | None = None,
        replacement_command: Sequence[str] = (),
        job_prefix: str = "pitstop-replace",
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.election = election
        self.slurm = slurm
        self.node_names = dict(node_names or {})
        self.replacement_command = list(replacement_command)
        self.job_prefix = job_prefix
        self.environ = os.environ if environ is None else environ
        self.clock = clock
        self._unknown_warned: set[str] = set()
        # node id -> (when its failed replacement request may be retried, the wait after that)
        self._retry: dict[str, tuple[float, float]] = {}

    @classmethod
    def from_settings(
        cls, settings: SchedulerSettings, store: Store, election: LeaderElection
    ) -> SlurmAdapter:
        runner = SubprocessRunner(settings.slurm_command_timeout_seconds)
        return cls(
            store,
            election,
            Slurm(runner, settings.slurm_bin_dir),
            node_names=settings.slurm_node_names,
            replacement_command=shlex.split(settings.slurm_replacement_command),
            job_prefix=settings.slurm_replacement_job_prefix,
        )

    async def run(self, interval: float) -> None:
        """Reconcile every `interval`, and soon after the event log grows (a node failed),
        for as long as this process leads. A failed pass is logged; the next one retries."""
        bus = self.store.bus
        while True:
            seen = bus.version
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                reraise_if_cancelling()
                log.exception("slurm adapter pass failed; the next pass retries")
            await bus.wait(seen, interval)
            await asyncio.sleep(MIN_PASS_GAP_SECONDS)

    def slurm_name(self, node_id: str) -> str:
        return self.node_names.get(node_id, node_id)

    async def reconcile(self) -> None:
        """One pass: compare pitstop's failed nodes with Slurm, record what Slurm now
        shows, drain what it does not yet, and ask for the replacements due."""
        failed, records, idle_spares = await self._read()
        if not failed and not records:
            return
        names = [
            want.slurm_node
            for want in failed.values()
            if want.node_id not in records or not settled(want, records[want.node_id])
        ]
        try:
            observed = await self.slurm.nodes(names)
        except SlurmUnavailable as exc:
            log.warning("slurm adapter: Slurm did not answer (%s); the next pass asks again", exc)
            return
        # Is a newly failed node's allocation still running? (Its end is no failure.)
        allocations = {}
        try:
            for want in failed.values():
                if want.node_id not in records and want.slurm_node in observed:
                    allocations[want.slurm_node] = await self.slurm.allocations(want.slurm_node)
        except SlurmUnavailable as exc:
            log.warning("slurm adapter: Slurm did not answer (%s); the next pass asks again", exc)
            return
        plan = plan_drains(
            failed,
            records,
            observed,
            allocations,
            idle_spares=idle_spares,
            replacements=bool(self.replacement_command),
        )
        self._warn_unknown(plan)
        changes = plan.create or plan.retarget or plan.clear or plan.confirm or plan.release
        if changes or plan.name_replacement:
            await self._record(plan)
        for want in plan.drain:
            done = await self.slurm.drain(want.slurm_node, want.reason)
            if done.ok:
                log.info("asked Slurm to drain %s: %s", want.slurm_node, want.reason)
            else:
                log.warning("slurm adapter: %s; the next pass asks again", done.describe())
        if self.replacement_command:
            await self._request_replacements()

    async def _read(self) -> tuple[dict[str, FailedNode], dict[str, DrainRecord], int]:
        async with self.store.read() as session:
            nodes = (
                await session.execute(
                    select(models.Node.id, models.Node.state, models.Node.reason).where(
                        models.Node.state.in_(FAILED_STATES)
                    )
                )
            ).all()
            rows = (await session.scalars(select(models.SlurmDrain))).all()
            idle_spares = await session.scalar(
                select(func.count())
                .select_from(models.Node)
                .where(models.Node.role == NodeRole.SPARE)
                .where(models.Node.state == NodeState.READY)
                .where(models.Node.connected.is_(True))
                .where(~exists().where(models.GpuBooking.node_id == models.Node.id))
            )
        failed = {
            node_id: FailedNode(node_id, self.slurm_name(node_id), drain_reason(state, reason))
            for node_id, state, reason in nodes
        }
        records = {row.node_id: _record_of(row) for row in rows}
        return failed, records, int(idle_spares or 0)

    async def _record(self, plan: DrainPlan) -> None:
        """The plan's record changes and events, in one transaction of the leader's."""
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            ids = {w.node_id for w in plan.create + plan.retarget} | set(plan.clear)
            ids |= {r.node.node_id for r in plan.release}
            ids |= {c.node_id for c in plan.confirm} | set(plan.name_replacement)
            rows = {
                row.node_id: row
                for row in (
                    await session.scalars(
                        select(models.SlurmDrain)
                        .where(models.SlurmDrain.node_id.in_(ids))
                        .with_for_update(key_share=True)
                    )
                ).all()
            }
            for want in plan.create:
                row = models.SlurmDrain(
                    node_id=want.node_id, slurm_node=want.slurm_node, reason=want.reason
                )
                session.add(row)
                rows[want.node_id] = row
            for ended in plan.release:
                want = ended.node
                session.add(
                    models.SlurmDrain(
                        node_id=want.node_id,
                        slurm_node=want.slurm_node,
                        reason=want.reason,
                        allocation_ended=True,
                    )
                )
                held = f"Slurm job {ended.job_id} ends" if ended.job_id else "no Slurm job holds it"
                record_event(
                    session,
                    "node.slurm_allocation_ended",
                    actor=ACTOR,
                    node_id=want.node_id,
                    reason=f"lost as its allocation ended ({held}): not drained in Slurm",
                    attributes={"slurm_node": want.slurm_node, "slurm_job_id": ended.job_id},
                )
            for want in plan.retarget:
                row = rows[want.node_id]
                row.slurm_node, row.reason, row.drained_at = want.slurm_node, want.reason, None
            for node_id in plan.clear:
                if node_id in rows:
                    await session.delete(rows[node_id])
            for seen in plan.confirm:
                rows[seen.node_id].drained_at = func.now()
                attributes = {"slurm_node": seen.slurm.name, "slurm_state": seen.slurm.state}
                if seen.foreign:
                    attributes["drained_by"] = "another party: its reason is kept"
                record_event(
                    session,
                    "node.slurm_drained",
                    actor=ACTOR,
                    node_id=seen.node_id,
                    reason=seen.slurm.reason,
                    attributes=attributes,
                )
            for node_id in plan.name_replacement:
                row = rows[node_id]
                row.replacement_job_name = (
                    f"{self.job_prefix}-{row.slurm_node}-{secrets.token_hex(3)}"
                )

    async def _request_replacements(self) -> None:
        async with self.store.read() as session:
            rows = (
                await session.scalars(
                    select(models.SlurmDrain)
                    .where(models.SlurmDrain.replacement_job_name != "")
                    .where(models.SlurmDrain.replacement_job_id == "")
                )
            ).all()
            pending = [_record_of(row) for row in rows]
        if not pending:
            return
        try:
            in_slurm = await self.slurm.jobs_named([r.replacement_name for r in pending])
        except SlurmUnavailable as exc:
            log.warning("slurm adapter: Slurm did not answer (%s); the next pass asks again", exc)
            return
        plan = plan_submissions(pending, in_slurm)
        for node_id, job_id in plan.adopt.items():
            await self._requested(node_id, job_id, "found in Slurm by its name")
        now = self.clock()
        for record in plan.submit:
            retry_at, wait = self._retry.get(record.node_id, (0.0, 0.0))
            if now < retry_at:
                continue
            env = {k: v for k, v in self.environ.items() if k not in SECRET_ENV}
            env |= {
                "SBATCH_JOB_NAME": record.replacement_name,
                "PITSTOP_SLURM_REPLACES": record.node_id,
            }
            done = await self.slurm.submit(self.replacement_command, env)
            submitted = parse_sbatch(done.stdout) if done.ok else None
            if submitted is None:
                wait = min(max(2 * wait, 1.0), MAX_RETRY_SECONDS)
                self._retry[record.node_id] = (now + wait, wait)
                log.warning(
                    "slurm adapter: no replacement for %s yet: %s; retrying in %.0f s",
                    record.node_id,
                    done.describe() if not done.ok else f"no job id in {done.stdout!r}",
                    wait,
                )
                continue
            self._retry.pop(record.node_id, None)
            await self._requested(record.node_id, submitted, "submitted")

    async def _requested(self, node_id: str, job_id: str, how: str) -> None:
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            row = await session.get(
                models.SlurmDrain, node_id, with_for_update=models.NO_KEY_UPDATE
            )
            if row is None or row.replacement_job_id:
                return
            row.replacement_job_id = job_id
            row.replacement_requested_at = func.now()
            record_event(
                session,
                "node.slurm_replacement_requested",
                actor=ACTOR,
                node_id=node_id,
                reason=f"Slurm job {job_id} ({row.replacement_job_name}) {how}; it joins as "
                "a spare",
                attributes={"slurm_job_id": job_id, "slurm_job_name": row.replacement_job_name},
            )
        log.info("replacement for %s: Slurm job %s (%s)", node_id, job_id, how)

    def _warn_unknown(self, plan: DrainPlan) -> None:
        for want in plan.unknown:
            if want.node_id in self._unknown_warned:
                continue
            self._unknown_warned.add(want.node_id)
            log.warning(
                "slurm adapter: node %s failed but Slurm lists no node %s; nothing is "
                "drained (map its Slurm name in slurm_node_names if it differs)",
                want.node_id,
                want.slurm_node,
            )


def _record_of(row: models.SlurmDrain) -> DrainRecord:
    return DrainRecord(
        node_id=row.node_id,
        slurm_node=row.slurm_node,
        reason=row.reason,
        drained=row.drained_at is not None,
        replacement_name=row.replacement_job_name,
        replacement_job_id=row.replacement_job_id,
        allocation_ended=row.allocation_ended,
    )
