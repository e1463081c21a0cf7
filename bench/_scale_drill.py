"""bench/scale.py's drills on a running job: a mass loss (a share of the job's nodes cut
at once at their relays, then healed: a partition the scheduler should hold the job
through), a mass loss kept past the replace deadline (the nodes replaced from the
spares, a bounded number at a time), and the job's end (every rank exits 0)."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from bench._scale_fleet import NodeView
from bench._scale_run import Run
from bench._scale_sim import DECISIONS

SETTLE_SECONDS = 90.0
"""After a heal, how long the job has to be running again with every cut node back."""
RETURN_SECONDS = 3.0
END_SECONDS = 120.0
HOLD_EVENTS = ("job.held", "job.released")
ENDS = ("job.succeeded", "job.failed", "job.cancelled")
Event = tuple[int, str, str | None, str | None, float, dict[str, str]]


async def events_since(run: Run, first: int, kinds: tuple[str, ...]) -> list[Event]:
    assert run.events is not None
    rows = await asyncio.to_thread(run.events.between, first, kinds)
    return [e for e in rows if e[3] in (None, run.job_id) or e[1] == "node.lost"]


async def job_state(run: Run) -> dict[str, Any]:
    assert run.events is not None
    return await asyncio.to_thread(run.events.job, run.job_id)


def usable(run: Run) -> list[NodeView]:
    """The job's nodes that a drill may cut: up, registered, not failed before."""
    assert run.fleet is not None
    in_job = run.job_nodes()
    return [
        v
        for v in run.fleet.nodes
        if v.node_id in in_job and v.registered and not (v.dead or v.hung or v.unhealthy)
    ]


async def before_cut(
    run: Run, cut: list[NodeView], out: dict[str, Any]
) -> tuple[int, dict[str, int]]:
    """What the job was before the cut, into `out`; the newest event's id and how often
    each node to cut had registered."""
    assert run.fleet is not None
    assert run.events is not None
    await run.fleet.refresh()
    state = await job_state(run)
    out.update(
        nodes_cut=len(cut),
        generation_before=state.get("generation"),
        step_before=run.fleet.step(run.job_id),
        committed_step_before=state.get("committed_step"),
    )
    run.victims.update(v.node_id for v in cut)
    first = await asyncio.to_thread(run.events.newest)
    return first, {v.node_id: v.registrations for v in cut}


async def placed(run: Run) -> set[str]:
    """The nodes of the job's current generation, as the scheduler placed it."""
    assert run.events is not None
    return await asyncio.to_thread(run.events.job_nodes, run.job_id)


async def settle(
    run: Run, cut: list[NodeView], first: int, registrations: dict[str, int], timeout: float
) -> bool:
    """Until every cut node is back and the job runs (released first, if it was held) or
    ended; False when `timeout` passed first. Back: registered again since the cut if
    the scheduler declared it lost; else registered still RETURN_SECONDS after the heal
    (a stream the scheduler closed during the cut ends at the node as soon as the close
    gets through, well within that)."""
    assert run.fleet is not None
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        events = await events_since(run, first, (*HOLD_EVENTS, "node.lost"))
        kinds = {e[1] for e in events}
        lost = {e[2] for e in events if e[1] == "node.lost"}
        state = (await job_state(run)).get("state", "")
        if state in ("succeeded", "failed", "cancelled"):
            return True
        back = all(
            v.registered
            and (
                v.registrations > registrations[v.node_id]
                if v.node_id in lost
                else time.monotonic() - began >= RETURN_SECONDS
            )
            for v in cut
        )
        if back and state == "running" and ("job.held" not in kinds or "job.released" in kinds):
            return True
        await asyncio.sleep(0.25)
    return False


async def after_heal(
    run: Run,
    cut: list[NodeView],
    since: tuple[int, dict[str, int]],
    t_cut: float,
    t_heal: float,
    out: dict[str, Any],
) -> None:
    """What the drill did to the job, from the events since the cut, into `out`."""
    assert run.fleet is not None
    began = time.monotonic()
    first, registrations = since
    out["settled"] = await settle(run, cut, first, registrations, SETTLE_SECONDS)
    out["settle_seconds"] = round(time.monotonic() - began, 1)
    events = await events_since(run, first, (*HOLD_EVENTS, "node.lost", *DECISIONS))
    held = [e for e in events if e[1] == "job.held"]
    released = [e for e in events if e[1] == "job.released"]
    cut_ids = {v.node_id for v in cut}
    lost = {e[2] for e in events if e[1] == "node.lost" and e[2]}
    others = sorted(lost - cut_ids - run.victims)
    state = await job_state(run)
    generation_after = state.get("generation", 0)
    out.update(
        held=bool(held),
        released=bool(released),
        held_attributes=held[0][5] if held else None,
        released_attributes=released[0][5] if released else None,
        seconds_to_release=round(released[0][4] - t_heal, 3) if released else None,
        seconds_cut_to_release=round(released[0][4] - t_cut, 3) if released else None,
        nodes_lost=len(lost & cut_ids),
        nodes_replaced=len(cut_ids - await placed(run)),
        decisions=sum(e[1] in DECISIONS for e in events),
        generation_after=generation_after,
        state_after=state.get("state"),
        steps_lost=steps_lost(run, out["step_before"], out["generation_before"], generation_after),
        false_losses=len(others),
        false_loss_nodes=others,
    )
    await run.fleet.refresh()
    lag = run.fleet.lagged(t_cut, time.time())
    out.update(sim_lagged=lag > 0, sim_lag_max_seconds=round(lag, 3))


def steps_lost(run: Run, step_before: int, generation_before: int, generation_after: int) -> int:
    """The newest step the nodes reported before the cut minus the step the job resumed
    from: a new generation's restore step, else (no restart) nothing lost."""
    assert run.fleet is not None
    if generation_after <= generation_before:
        return 0
    restores = run.fleet.restore_steps
    resumed = restores.get(generation_after)
    if resumed is None:
        later = [restores[g] for g in restores if g > generation_before]
        resumed = min(later, default=step_before)
    return max(0, step_before - resumed)


async def mass_loss(run: Run, fraction: float, seconds: float, out: dict[str, Any]) -> None:
    """Cut `fraction` of the job's nodes at once for `seconds`, heal them, and measure
    what the scheduler made of it (into `out`, as it goes)."""
    assert run.fleet is not None
    members = usable(run)
    count = max(1, round(fraction * len(run.job_nodes())))
    if len(members) < count:
        out["error"] = f"{len(members)} usable nodes in the job, {count} to cut"
        return
    cut = random.sample(members, count)
    since = await before_cut(run, cut, out)
    t_cut = await run.fleet.network("cut", cut)
    await asyncio.sleep(seconds)
    t_heal = await run.fleet.network("heal", cut)
    out["cut_for_seconds"] = round(t_heal - t_cut, 2)
    await after_heal(run, cut, since, t_cut, t_heal, out)


async def mass_loss_replace(run: Run, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Cut as many of the job's nodes as the free spares cover (at least the mass-loss
    threshold) and keep them cut until each is out of the job's newest generation or the
    replace deadline is a minute past; then heal them."""
    assert run.fleet is not None
    least, after = args.replace_nodes, args.replace_after
    free = [
        v
        for v in run.fleet.nodes
        if v.registered and v.generation == 0 and not (v.dead or v.hung or v.unhealthy)
    ]
    members = usable(run)
    count = min(len(free), max(least, round(args.mass_loss * len(run.job_nodes()))))
    out.update(replace_after_seconds=after, replace_batch=args.replace_batch, free_spares=len(free))
    if count < least or len(members) < count:
        out["error"] = f"{len(free)} free spares, {len(members)} usable job nodes: {least} needed"
        return
    cut = random.sample(members, count)
    since = await before_cut(run, cut, out)
    t_cut = await run.fleet.network("cut", cut)
    cut_ids = {v.node_id for v in cut}
    deadline = time.monotonic() + after + 60
    while True:
        left = cut_ids & await placed(run)
        if not left or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    out["seconds_to_replaced"] = None if left else round(time.time() - t_cut, 2)
    t_heal = await run.fleet.network("heal", cut)
    out["cut_for_seconds"] = round(t_heal - t_cut, 2)
    await after_heal(run, cut, since, t_cut, t_heal, out)
    # Replaced in how many decisions: the generations the job went through meanwhile.
    out["replace_decisions"] = out["generation_after"] - out["generation_before"]


async def end_job(run: Run) -> dict[str, Any]:
    """Every rank of the job's newest generation exits 0 with its result; the job's end
    as the scheduler records it (job.succeeded expected)."""
    assert run.fleet is not None
    assert run.events is not None
    generation = max((v.generation for v in run.fleet.nodes), default=0)
    first = await asyncio.to_thread(run.events.newest)
    t0 = time.time()
    ranks = await run.fleet.finish(run.job_id, generation)
    deadline = time.monotonic() + END_SECONDS
    end: Event | None = None
    while end is None and time.monotonic() < deadline:
        ended = await events_since(run, first, ENDS)
        end = ended[0] if ended else None
        await asyncio.sleep(0.25)
    state = await job_state(run)
    return {
        "state": str(state.get("state", "")).upper(),
        "event": None if end is None else end[1],
        "seconds": None if end is None else round(end[4] - t0, 3),
        "generation": generation,
        "ranks_exited": ranks,
        "error": None if end is not None else f"no end of the job within {END_SECONDS:.0f} s",
    }
