"""Goodput over a month, by simulation: checkpoint-restart, torchrun, NVRx, torchft and
pitstop on 100,000 GPUs, under the same seeded failures.

A discrete-event simulation (no cluster, no torch; seconds to run). Each policy trains
one job for --days of wall time on --gpus GPUs. Failures arrive as a Poisson process
over wall time (they keep coming during a recovery, which then starts over). Goodput =
the training time whose work was kept (not recomputed, not a checkpoint stall, not a
recovery, not a missing replica's share) over the wall time; that is also Meta's ETTR
(effective training time ratio) under this model, so one number is reported for both.

Inputs and where each comes from (every value is printed in the JSON's "assumptions"):

* Failure rate: Llama 3 (Meta, "The Llama 3 Herd of Models", 2024): 419 unexpected
  interruptions in 54 days on 16,384 GPUs, scaled linearly per GPU: at 100,000 GPUs one
  every ~30 min (~1,420 in 30 days). ~78% of them hardware, split evenly over a node
  crash, a fatal Xid, a hung node and a silently dead node (no process reports those
  two: a deadline finds them); the other ~22% evenly over a rank kill and an application
  Xid.
* Measured recovery, --recovery-json (default bench/results/recovery.json, a
  bench/recovery.py run on 4 nodes): pitstop's median per kind; each peer's medians of
  failure -> training again (to_progress) and -> full strength (to_full) for a dead
  process and for a silent host (a peer meets the crash kinds as the first, the silent
  ones as the second). Each drawn recovery is its median times a lognormal factor
  (sigma --recovery-sigma 0.25). A peer that run did not measure is not simulated.
* Snapshot stalls, --checkpoint-json (default bench/results/checkpoint-h200.json, the
  GPU case of bench/checkpoint.py on an H200): pitstop's stall and tuned DCP
  async_save's, per GB, for --state-gb-per-gpu 6.4 (the 405B model's bf16 weights over
  TP 8 x PP 16 plus its ZeRO-1 optimizer shard).
* What 12,500 nodes add to a node's recovery in pitstop, --scale-json (default
  bench/results/scale.json): bench/scale.py's linear fit of decide p99 and fan-out p99
  taken to 12,500 nodes.
* Stated assumptions, not measured: the durable store writes or reads the whole state
  (6.5 TB) in --durable-save-seconds 65 (100 GB/s); a restart of every one of 100,000
  ranks takes --elastic-restart-seconds 90 (rendezvous, process start, NCCL init); a
  restart from durable storage takes --full-restart-minutes 8-12; a share
  --durable-fallback-share 2% of pitstop's failures lose both in-memory copies and go
  back to the durable copy flushed every --durable-flush-minutes 10.

Policies:

* checkpoint_restart: synchronous durable saves at Young/Daly's sqrt(2 * C * MTBF); every
  failure a full restart and the work since the last save.
* torchrun and nvrx: DCP async_save (the stall is its staging) at the Young/Daly
  interval for that stall, but no more often than one write takes; a failure costs the
  measured to_full with its restart (its rank_kill to_full) replaced by the 100,000-rank
  restart, the reload and the work since the last save. NVRx as bench/recovery.py runs
  it: in-job restart (its in-process restart and local checkpoints are not measured).
* torchft: the survivors stand still for the measured to_progress, then train one
  replica group (1/781) short for to_full - to_progress while the failed one heals from
  a peer; no committed step is lost and no save is waited for. Generous where nothing
  was measured: no stall for its durable checkpoints, no cost of a 781-group quorum.
* pitstop: snapshots at the Young/Daly interval for its stall, rounded to whole steps of
  --step-seconds; a failure costs the measured median (plus the 12,500-node extra for a
  node's failure) and the work since the snapshot, or on a fallback a full restart and
  the work since the durable flush.

Spares: --spares 250 hot spares (2% of nodes); a failed node is repaired in
--repair-hours 72 and returns as a spare. With none left, pitstop and torchft train one
data-parallel replica of 781 short until one returns; the others wait for it.

    .venv/bin/python bench/goodput_sim.py [--seeds 20] [--seed 0] [--days 30] [--sensitivity]

The last line of stdout is one JSON object: each policy's goodput (mean, p5, p95 over
--seeds runs), where the rest went, and the published anchors beside them (ByteRobust
97% ETTR on 9,600 GPUs, Gemini 97% goodput, Llama 3 > 90% effective training time).
Exit status 1 when pitstop's mean is under --target (0.98).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
LLAMA3_HARDWARE_SHARE = 0.78
DP_REPLICAS = 781
"""The 99,968-rank gang's data-parallel replicas (TP 8 x PP 16 x DP 781)."""
HARDWARE_KINDS = ("node_kill", "xid_fatal", "hung_node", "node_silent")
SOFTWARE_KINDS = ("rank_kill", "xid_app")
SILENT_KINDS = ("hung_node", "node_silent")
"""The kinds no process reports: seen only when a deadline passes."""
RECOVERY_KINDS = {
    "node_kill": "node_kill",
    "xid": "xid_fatal",
    "agent_hang": "hung_node",
    "node_silent": "node_silent",
    "rank_kill": "rank_kill",
    "app_xid": "xid_app",
}
"""bench/recovery.py's failure kinds -> this simulation's."""
PEERS = ("torchrun", "torchft", "nvrx")
"""The peers bench/recovery.py measures beside pitstop."""
RESULTS = Path(__file__).with_name("results")
STATE_GB_PER_GPU = 6.4
"""The 405B model's bf16 weights over TP 8 x PP 16 plus its ZeRO-1 optimizer shard."""
ANCHORS = {
    "ByteRobust (9,600 GPUs, ETTR)": 0.97,
    "Gemini (goodput)": 0.97,
    "Llama 3 (16,384 GPUs, effective training time, lower bound)": 0.90,
}


def last_json(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text().strip().splitlines()[-1])
    if not isinstance(report, dict):
        raise ValueError(f"{path}: its last line is not a JSON object")
    return report


@dataclass(frozen=True)
class PeerMedians:
    """One peer's medians from a bench/recovery.py run, by its kinds (rank_kill,
    node_silent): failure -> any step again, and -> full strength again."""

    to_progress: dict[str, float]
    to_full: dict[str, float]

    def of(self, kind: str) -> tuple[float, float]:
        """(to_progress, to_full) for one of this simulation's kinds: a silent one as
        the peer met a silent host, any other as it met a dead process."""
        measured = "node_silent" if kind in SILENT_KINDS else "rank_kill"
        return self.to_progress[measured], self.to_full[measured]


def recovery_inputs(path: Path) -> tuple[dict[str, float], dict[str, PeerMedians], str]:
    """pitstop's recovery medians by kind and each measured peer's, from a
    bench/recovery.py JSON line; and where they came from."""
    report = last_json(path)
    by_kind = report["pitstop"]["p50_by_kind"]
    missing = [kind for kind in RECOVERY_KINDS if kind not in by_kind]
    if missing:
        raise ValueError(f"{path}: pitstop.p50_by_kind lacks {missing}; run bench/recovery.py")
    medians = {ours: float(by_kind[theirs]) for theirs, ours in RECOVERY_KINDS.items()}
    peers: dict[str, PeerMedians] = {}
    for name in PEERS:
        entry = report.get(name, {})
        if all(kind in entry for kind in ("rank_kill", "node_silent")):
            peers[name] = PeerMedians(
                {k: float(entry[k]["to_progress_s"]["p50"]) for k in ("rank_kill", "node_silent")},
                {k: float(entry[k]["to_full_s"]["p50"]) for k in ("rank_kill", "node_silent")},
            )
    source = f"{path.name} (bench/recovery.py, {report.get('date', 'undated')})"
    if len(peers) < len(PEERS):
        source += f"; not measured there, so not simulated: {sorted(set(PEERS) - set(peers))}"
    return medians, peers, source


def stall_inputs(path: Path, gigabytes: float) -> tuple[float, float, str]:
    """The snapshot stall of pitstop and of DCP async_save (tuned) for `gigabytes` per
    GPU, at the rates bench/checkpoint.py measured its largest GPU case (else its
    largest CPU case) at."""
    report = last_json(path)
    cuda = report.get("cuda")
    cases = cuda if isinstance(cuda, dict) and cuda else report["cases"]
    label, case = max(cases.items(), key=lambda item: item[1].get("bytes", 0))
    per_gb = case["bytes"] / 1e9
    where = "GPU" if cases is cuda else "CPU"
    source = (
        f"{path.name} (bench/checkpoint.py on {report.get('gpu', 'this machine')}): the "
        f"{label} {where} case's pitstop stall {case['pitstop_stall_ms']} ms and async_save "
        f"{case['async_save_ms']} ms, scaled to {gigabytes:g} GB"
    )
    return (
        case["pitstop_stall_ms"] / 1e3 / per_gb * gigabytes,
        case["async_save_ms"] / 1e3 / per_gb * gigabytes,
        source,
    )


def scale_input(path: Path) -> tuple[float, str]:
    """What 12,500 nodes add to a node's recovery: bench/scale.py's fit of the decide and
    fan-out p99 taken to 12,500 nodes."""
    report = last_json(path)
    projected = report.get("at_12500") or {}
    decide, fanout = projected.get("decide_s"), projected.get("fanout_s")
    if decide is None or fanout is None:
        raise ValueError(f"{path}: no at_12500 decide_s and fanout_s (run bench/scale.py)")
    sizes = [size["nodes"] for size in report.get("sizes", [])]
    source = (
        f"{path.name} (bench/scale.py at {sizes} nodes, {report.get('date', 'undated')}): "
        f"decide p99 {decide:g} s + fan-out p99 {fanout:g} s at 12,500 nodes"
    )
    return float(decide) + float(fanout), source


@dataclass
class Params:
    gpus: int
    days: float
    step_seconds: float
    durable_save_seconds: float
    full_restart_minutes: tuple[float, float]
    elastic_restart_seconds: float
    snapshot_stall_seconds: float
    async_save_stall_seconds: float
    recovery_sigma: float
    scale_extra_seconds: float
    durable_fallback_share: float
    durable_flush_minutes: float
    spares: int
    repair_hours: float
    pitstop_recovery_medians: dict[str, float] = field(default_factory=dict)
    peer_medians: dict[str, PeerMedians] = field(default_factory=dict)
    torchft_scale_extra_seconds: float = 0.0

    @property
    def failures_per_second(self) -> float:
        per_gpu_second = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86_400 * LLAMA3_GPUS)
        return per_gpu_second * self.gpus

    @property
    def mtbf(self) -> float:
        return 1.0 / self.failures_per_second

    def young_daly(self, cost: float) -> float:
        return math.sqrt(2.0 * cost * self.mtbf)

    @property
    def snapshot_interval(self) -> float:
        steps = max(1, round(self.young_daly(self.snapshot_stall_seconds) / self.step_seconds))
        return steps * self.step_seconds


@dataclass
class Ledger:
    """Where one run's wall time went."""

    wall: float
    kept: float = 0.0
    stalls: float = 0.0
    recomputed: float = 0.0
    recovering: float = 0.0
    shrunk_loss: float = 0.0
    failures: int = 0
    fallbacks: int = 0
    min_spares: int = 0
    recoveries: list[float] = field(default_factory=list)

    def goodput(self) -> float:
        return (self.kept - self.shrunk_loss) / self.wall


class Spares:
    """The hot-spare pool: a failed node leaves for repair and comes back later."""

    def __init__(self, count: int, repair: float) -> None:
        self.count = count
        self.repair = repair
        self.back: list[float] = []
        self.lowest = count

    def take(self, now: float) -> bool:
        self.back = [t for t in self.back if not self._returns(t, now)]
        self.back.append(now + self.repair)
        if self.count == 0:
            return False
        self.count -= 1
        self.lowest = min(self.lowest, self.count)
        return True

    def _returns(self, at: float, now: float) -> bool:
        if at <= now:
            self.count += 1
            return True
        return False

    def next_return(self) -> float:
        return min(self.back) if self.back else math.inf


@dataclass(frozen=True)
class Recovery:
    """What one failure costs: wall seconds the whole job stands still, whether the work
    since the last durable checkpoint (not the last save) is lost, and the seconds after
    that the job trains one data-parallel replica short (torchft's survivors go on while
    the failed replica group heals)."""

    seconds: float
    fallback: bool = False
    degraded: float = 0.0


def failure_kind(rng: random.Random) -> str:
    kinds = HARDWARE_KINDS if rng.random() < LLAMA3_HARDWARE_SHARE else SOFTWARE_KINDS
    return rng.choice(kinds)


class Policy:
    """One way to survive failures: how often it saves, what a save stalls, what a failure
    costs. `simulate` is shared."""

    name = ""
    interval = 0.0  # seconds of training between saves
    stall = 0.0  # wall seconds a save stops training
    keeps_work = False  # a failure loses no committed step (no save to go back to)

    def __init__(self, p: Params) -> None:
        self.p = p

    def recovery(self, kind: str, rng: random.Random) -> Recovery:
        """What a failure of `kind` costs."""
        raise NotImplementedError

    def waits_for_spare(self) -> bool:
        return True

    def simulate(self, rng: random.Random) -> Ledger:
        p = self.p
        wall = p.days * 86_400
        ledger = Ledger(wall=wall)
        spares = Spares(p.spares, p.repair_hours * 3600)
        durable_every = p.durable_flush_minutes * 60
        t = 0.0
        since_save = 0.0  # training since the last save (lost on a failure)
        since_durable = 0.0  # training since the last durable copy (pitstop's fallback)
        shrunk = 0  # replicas missing (pitstop without spares)
        next_failure = rng.expovariate(p.failures_per_second)
        while t < wall:
            to_save = self.interval - since_save
            segment_end = min(t + to_save, wall)
            if next_failure >= segment_end:
                trained = segment_end - t
                ledger.shrunk_loss += trained * shrunk / DP_REPLICAS
                since_save += trained
                since_durable += trained
                t = segment_end
                if t >= wall:
                    break
                stall_end = t + self.stall
                if next_failure >= stall_end:  # the save completes
                    ledger.stalls += self.stall
                    t = stall_end
                    ledger.kept += since_save
                    since_save = 0.0
                    if since_durable >= durable_every:
                        since_durable = 0.0
                    continue
                ledger.stalls += next_failure - t
                t = next_failure
            else:
                trained = next_failure - t
                ledger.shrunk_loss += trained * shrunk / DP_REPLICAS
                since_save += trained
                since_durable += trained
                t = next_failure
            # A failure at t.
            ledger.failures += 1
            kind = failure_kind(rng)
            first = self.recovery(kind, rng)
            took, fallback = first.seconds, first.fallback
            ledger.shrunk_loss += first.degraded / DP_REPLICAS
            if fallback:
                ledger.fallbacks += 1
                ledger.kept -= max(since_durable - since_save, 0.0)
                ledger.recomputed += since_durable
                since_durable = 0.0
            elif self.keeps_work:
                ledger.kept += since_save
            else:
                ledger.recomputed += since_save
            since_durable = max(since_durable - since_save, 0.0)
            since_save = 0.0
            if kind in HARDWARE_KINDS and not spares.take(t):
                if self.waits_for_spare():
                    took = max(took, spares.next_return() - t)
                else:
                    shrunk += 1
            # Failures keep coming while it recovers: each starts the recovery over.
            start = t
            end = t + took
            next_failure = t + rng.expovariate(p.failures_per_second)
            while next_failure < end and next_failure < wall:
                ledger.failures += 1
                kind = failure_kind(rng)
                next_one = self.recovery(kind, rng)
                again, fallback = next_one.seconds, next_one.fallback
                ledger.shrunk_loss += next_one.degraded / DP_REPLICAS
                if fallback:  # both copies lost while recovering: back to the durable one
                    ledger.fallbacks += 1
                    ledger.kept -= since_durable
                    ledger.recomputed += since_durable
                    since_durable = 0.0
                if kind in HARDWARE_KINDS:
                    spares.take(next_failure)
                end = next_failure + again
                next_failure += rng.expovariate(p.failures_per_second)
            end = min(end, wall)
            ledger.recovering += end - start
            ledger.recoveries.append(end - start)
            t = end
            if shrunk and spares.count > 0:  # a repaired node back: grow again
                spares.count -= 1
                shrunk -= 1
        ledger.kept += since_save  # the run ends: the last work counts as kept
        ledger.min_spares = spares.lowest
        return ledger


class CheckpointRestart(Policy):
    name = "checkpoint_restart"

    def __init__(self, p: Params) -> None:
        super().__init__(p)
        self.stall = p.durable_save_seconds
        self.interval = p.young_daly(self.stall)

    def recovery(self, kind: str, rng: random.Random) -> Recovery:
        low, high = self.p.full_restart_minutes
        return Recovery(rng.uniform(low, high) * 60)


class ElasticRestart(Policy):
    """torchrun: every worker restarted, the newest durable checkpoint reloaded. Saved
    with DCP async_save (tuned: the stall is its staging, bench/checkpoint.py), at the
    Young/Daly interval for that stall but no more often than one write takes."""

    name = "torchrun"

    def __init__(self, p: Params) -> None:
        super().__init__(p)
        self.stall = p.async_save_stall_seconds
        self.interval = max(p.young_daly(self.stall), p.durable_save_seconds)

    def recovery(self, kind: str, rng: random.Random) -> Recovery:
        """The measured recovery with its restart of every worker taken to 100,000 ranks:
        a dead process is seen within the monitor interval, so the measured `rank_kill`
        to_full is the benchmark's own restart; --elastic-restart-seconds stands in for
        it (not beside it), and the reload of the whole state follows."""
        p = self.p
        medians = p.peer_medians[self.name]
        _, to_full = medians.of(kind)
        _, restart = medians.of("rank_kill")
        measured = to_full * rng.lognormvariate(0.0, p.recovery_sigma)
        at_scale = max(p.elastic_restart_seconds - restart, 0.0)
        return Recovery(measured + at_scale + p.durable_save_seconds)


class NVRxRestart(ElasticRestart):
    """NVRx's ft_launcher as bench/recovery.py runs it (in-job restart: its in-process
    restart and local checkpoints are not measured), saving as torchrun does."""

    name = "nvrx"


class Torchft(Policy):
    """torchft: the survivors stand still until their new quorum (to_progress), then go
    on one replica group short while the failed one restarts and heals from a peer
    (to_full); a committed step is never lost, so no save is waited for. Without a spare
    the group stays out until a repaired node returns. Generous where not measured: no
    stall for its (rare, background) durable checkpoints, no cost of a quorum of 781
    groups, no loss of every replica at once."""

    name = "torchft"
    keeps_work = True

    def __init__(self, p: Params) -> None:
        super().__init__(p)
        self.interval = p.days * 86_400 + 1.0  # never waits for a save

    def waits_for_spare(self) -> bool:
        return False

    def recovery(self, kind: str, rng: random.Random) -> Recovery:
        p = self.p
        to_progress, to_full = p.peer_medians[self.name].of(kind)
        factor = rng.lognormvariate(0.0, p.recovery_sigma)
        extra = p.torchft_scale_extra_seconds if kind in HARDWARE_KINDS else 0.0
        return Recovery(
            to_progress * factor + extra, degraded=max(to_full - to_progress, 0.0) * factor
        )


class Pitstop(Policy):
    name = "pitstop"

    def __init__(self, p: Params) -> None:
        super().__init__(p)
        self.stall = p.snapshot_stall_seconds
        self.interval = p.snapshot_interval

    def waits_for_spare(self) -> bool:
        return False

    def recovery(self, kind: str, rng: random.Random) -> Recovery:
        p = self.p
        if rng.random() < p.durable_fallback_share:
            low, high = p.full_restart_minutes
            return Recovery(rng.uniform(low, high) * 60, fallback=True)
        median = p.pitstop_recovery_medians[kind]
        measured = median * rng.lognormvariate(0.0, p.recovery_sigma)
        extra = p.scale_extra_seconds if kind in HARDWARE_KINDS else 0.0
        return Recovery(measured + extra)


POLICIES: tuple[type[Policy], ...] = (
    CheckpointRestart,
    ElasticRestart,
    NVRxRestart,
    Torchft,
    Pitstop,
)


def summarize(ledgers: list[Ledger], policy: Policy) -> dict[str, Any]:
    goodputs = sorted(ledger.goodput() for ledger in ledgers)

    def share(attr: str) -> float:
        return round(statistics.fmean(getattr(x, attr) / x.wall for x in ledgers), 5)

    recoveries = sorted(r for x in ledgers for r in x.recoveries)
    return {
        "goodput_mean": round(statistics.fmean(goodputs), 5),
        "goodput_p5": round(goodputs[int(0.05 * (len(goodputs) - 1))], 5),
        "goodput_p95": round(goodputs[int(0.95 * (len(goodputs) - 1))], 5),
        "save_interval_seconds": None if policy.keeps_work else round(policy.interval, 1),
        "save_stall_seconds": policy.stall,
        "lost_to": {
            "save_stalls": share("stalls"),
            "recomputed_work": share("recomputed"),
            "recovering": share("recovering"),
            "shrunk_replicas": share("shrunk_loss"),
        },
        "failures_mean": round(statistics.fmean(x.failures for x in ledgers), 1),
        "durable_fallbacks_mean": round(statistics.fmean(x.fallbacks for x in ledgers), 1),
        "recovery_p50_seconds": round(recoveries[len(recoveries) // 2], 2) if recoveries else 0,
        "recovery_p99_seconds": (
            round(recoveries[int(0.99 * (len(recoveries) - 1))], 2) if recoveries else 0
        ),
        "fewest_spares_left": min(x.min_spares for x in ledgers),
    }


def run(p: Params, seeds: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in POLICIES:
        if cls.name in PEERS and cls.name not in p.peer_medians:
            continue  # not measured: the JSON's recovery_source says so
        policy = cls(p)
        # The same seeds for every policy: the same failure draws at the start of each run.
        ledgers = [policy.simulate(random.Random(seed * 1_000_003 + i)) for i in range(seeds)]
        out[policy.name] = summarize(ledgers, policy)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--gpus", type=int, default=100_000)
    add("--days", type=float, default=30.0)
    add("--seeds", type=int, default=20, help="runs per policy")
    add("--seed", type=int, default=0)
    add("--step-seconds", type=float, default=2.0, help="training step (stated assumption)")
    add("--durable-save-seconds", type=float, default=65.0)
    add("--full-restart-minutes", type=float, nargs=2, default=(8.0, 12.0), metavar=("LO", "HI"))
    add(
        "--elastic-restart-seconds",
        type=float,
        default=90.0,
        help="a restart of every one of 100,000 workers (torchrun, NVRx): rendezvous, "
        "process start and NCCL init, in place of the benchmark's own (an assumption)",
    )
    add(
        "--recovery-json",
        type=Path,
        default=RESULTS / "recovery.json",
        help="a bench/recovery.py JSON line: every system's recovery medians by kind",
    )
    add(
        "--checkpoint-json",
        type=Path,
        default=RESULTS / "checkpoint-h200.json",
        help="a bench/checkpoint.py JSON line: pitstop's and async_save's stall per GB",
    )
    add(
        "--scale-json",
        type=Path,
        default=RESULTS / "scale.json",
        help="a bench/scale.py JSON line: what 12,500 nodes add to a node's recovery",
    )
    add("--state-gb-per-gpu", type=float, default=STATE_GB_PER_GPU)
    add(
        "--snapshot-stall-seconds",
        type=float,
        default=None,
        help="instead of the stall --checkpoint-json gives",
    )
    add("--recovery-sigma", type=float, default=0.25)
    add(
        "--scale-extra-seconds",
        type=float,
        default=None,
        help="instead of what --scale-json gives",
    )
    add(
        "--torchft-scale-extra-seconds",
        type=float,
        default=0.0,
        help="what a quorum change of 781 replica groups on 12,500 nodes adds to torchft's "
        "survivors' wait after a node's failure (not measured; 0: nothing, generous)",
    )
    add("--durable-fallback-share", type=float, default=0.02)
    add("--durable-flush-minutes", type=float, default=10.0)
    add("--spares", type=int, default=250)
    add("--repair-hours", type=float, default=72.0)
    add("--target", type=float, default=0.98)
    add(
        "--sensitivity",
        action="store_true",
        help="also pitstop's goodput at other fallback shares, stalls and scale extras",
    )
    args = parser.parse_args(argv)
    for name in ("gpus", "days", "seeds", "step_seconds", "durable_save_seconds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive value")
    if not 0 <= args.durable_fallback_share <= 1:
        parser.error(f"--durable-fallback-share {args.durable_fallback_share}: give 0..1")
    try:
        medians, peer_medians, recovery_source = recovery_inputs(args.recovery_json)
        stall, async_stall, stall_source = stall_inputs(args.checkpoint_json, args.state_gb_per_gpu)
        if args.snapshot_stall_seconds is not None:
            stall, stall_source = args.snapshot_stall_seconds, "--snapshot-stall-seconds"
        if args.scale_extra_seconds is None:
            scale_extra, scale_source = scale_input(args.scale_json)
        else:
            scale_extra, scale_source = args.scale_extra_seconds, "--scale-extra-seconds"
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        parser.error(f"reading the measured inputs: {exc}")
    params = Params(
        gpus=args.gpus,
        days=args.days,
        step_seconds=args.step_seconds,
        durable_save_seconds=args.durable_save_seconds,
        full_restart_minutes=tuple(args.full_restart_minutes),
        elastic_restart_seconds=args.elastic_restart_seconds,
        snapshot_stall_seconds=stall,
        async_save_stall_seconds=async_stall,
        recovery_sigma=args.recovery_sigma,
        scale_extra_seconds=scale_extra,
        durable_fallback_share=args.durable_fallback_share,
        durable_flush_minutes=args.durable_flush_minutes,
        spares=args.spares,
        repair_hours=args.repair_hours,
        pitstop_recovery_medians=medians,
        peer_medians=peer_medians,
        torchft_scale_extra_seconds=args.torchft_scale_extra_seconds,
    )
    began = time.perf_counter()
    policies = run(params, args.seeds, args.seed)
    result: dict[str, Any] = {
        "bench": "goodput_sim",
        "seed": args.seed,
        "seeds": args.seeds,
        "assumptions": {
            **{k: v for k, v in vars(params).items() if k != "peer_medians"},
            "peer_medians": {
                name: {"to_progress_p50_s": m.to_progress, "to_full_p50_s": m.to_full}
                for name, m in params.peer_medians.items()
            },
            "mtbf_minutes": round(params.mtbf / 60, 2),
            "failures_per_day": round(params.failures_per_second * 86_400, 1),
            "hardware_share": LLAMA3_HARDWARE_SHARE,
            "failure_source": f"Llama 3: {LLAMA3_INTERRUPTIONS} interruptions in "
            f"{LLAMA3_DAYS} days on {LLAMA3_GPUS:,} GPUs, scaled per GPU",
            "recovery_source": recovery_source,
            "snapshot_stall_source": stall_source,
            "scale_extra_source": scale_source,
        },
        "policies": policies,
        "anchors": ANCHORS,
        "target": {"pitstop_goodput": args.target},
    }
    if args.sensitivity:
        rows = []
        for share in (0.0, 0.02, 0.05, 0.10):
            for stall in (params.snapshot_stall_seconds * f for f in (0.0, 0.5, 1.0, 4.0)):
                for extra in (0.5, params.scale_extra_seconds, 2 * params.scale_extra_seconds):
                    varied = Params(
                        **{
                            **vars(params),
                            "durable_fallback_share": share,
                            "snapshot_stall_seconds": stall,
                            "scale_extra_seconds": extra,
                        }
                    )
                    ledgers = [
                        Pitstop(varied).simulate(random.Random(args.seed * 1_000_003 + i))
                        for i in range(max(args.seeds // 4, 3))
                    ]
                    rows.append(
                        {
                            "durable_fallback_share": share,
                            "snapshot_stall_seconds": round(stall, 4),
                            "scale_extra_seconds": extra,
                            "goodput_mean": round(
                                statistics.fmean(x.goodput() for x in ledgers), 5
                            ),
                        }
                    )
        result["pitstop_sensitivity"] = rows
        if "torchft" in params.peer_medians:
            # torchft's unmeasured cost at scale: none, or as much as pitstop's decision
            # and fan-out take to reach 12,500 nodes.
            result["torchft_sensitivity"] = [
                {
                    "torchft_scale_extra_seconds": extra,
                    "goodput_mean": round(
                        statistics.fmean(
                            Torchft(
                                Params(**{**vars(params), "torchft_scale_extra_seconds": extra})
                            )
                            .simulate(random.Random(args.seed * 1_000_003 + i))
                            .goodput()
                            for i in range(max(args.seeds // 4, 3))
                        ),
                        5,
                    ),
                }
                for extra in (0.0, params.scale_extra_seconds)
            ]
    pitstop = policies["pitstop"]["goodput_mean"]
    others = {name: row["goodput_mean"] for name, row in policies.items() if name != "pitstop"}
    result["target"]["met"] = pitstop >= args.target
    result["target"]["ahead_of"] = {name: pitstop > theirs for name, theirs in others.items()}
    result["wall_seconds"] = round(time.perf_counter() - began, 2)
    for name, row in policies.items():
        print(
            f"{name:20s} goodput {row['goodput_mean']:.4f} (p5 {row['goodput_p5']:.4f}); "
            f"lost to {row['lost_to']}",
            file=sys.stderr,
        )
    print(json.dumps(result))
    return 0 if result["target"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
