"""Goodput over a month, by simulation: checkpoint-restart, torchrun-style elastic restart
and pitstop on 100,000 GPUs, under the same seeded failures.

A discrete-event simulation (no cluster, no torch; seconds to run). Each policy trains
one job for --days of wall time on --gpus GPUs. Failures arrive as a Poisson process
over wall time (they keep coming during a recovery, which then starts over). Goodput =
the training time whose work was kept (not recomputed, not a checkpoint stall, not a
recovery) over the wall time; that is also Meta's ETTR (effective training time ratio)
under this model, so one number is reported for both.

Inputs and where each comes from (every default is printed in the JSON's "assumptions"):

* Failure rate: Llama 3 (Meta, "The Llama 3 Herd of Models", 2024): 419 unexpected
  interruptions in 54 days on 16,384 GPUs, scaled linearly per GPU: at 100,000 GPUs one
  every ~30 min (~1,420 in 30 days). ~78% of them hardware (issue 19 quotes the share):
  here a node is lost and replaced; the other ~22% a rank/job crash on healthy nodes.
* Checkpoint cost (checkpoint-restart and torchrun): a stated assumption, not measured:
  a 405B-parameter model's training state (bf16 weights + fp32 master and Adam moments,
  16 bytes/parameter, 6.5 TB) written synchronously to durable storage at 100 GB/s
  aggregate: --durable-save-seconds 65; reading it back costs the same. The interval is
  Young/Daly's sqrt(2 * C * MTBF).
* Checkpoint-restart from durable storage: every failure costs a full job restart of
  --full-restart-minutes 8-12 (uniform; the seeds' figure), from detection to training
  again, and the work since the last durable checkpoint.
* torchrun-style elastic restart: kill -9 to training again as bench/recovery.py measured
  it on 4 nodes (torchrun's p50 in --recovery-json, else --torchrun-p50), plus at 100,000
  ranks what that run does not have: re-rendezvous, process start and NCCL init of every
  rank (--elastic-restart-seconds 90, an assumption) and the reload of the durable
  checkpoint (--durable-save-seconds); a dead or hung node is seen through the
  rendezvous keep-alive (--elastic-detect-seconds 30, an assumption), a crashed worker
  at once. Same Young/Daly checkpoints as checkpoint-restart.
* pitstop, from measured inputs: the snapshot stall at the rate bench/checkpoint.py
  measured (--checkpoint-json, default bench/results/checkpoint-h200.json: the GPU case,
  pinned copies off an H200) for --state-gb-per-gpu 6.4 (the 405B model's bf16 weights
  over TP 8 x PP 16 plus its ZeRO-1 optimizer shard), at the Young/Daly interval for that
  stall, rounded to whole steps of --step-seconds; recovery time per failure kind:
  bench/recovery.py's medians (--recovery-json, default bench/results/recovery.json)
  times a lognormal factor (sigma --recovery-sigma 0.25), plus for a node's failure what
  12,500 nodes add (--scale-extra-seconds 14.6: bench/scale.py's linear fit of decide
  and fan-out p99 to 12,500 nodes, docs/scale.md). Hardware failures split evenly over
  node crash, fatal Xid and hung node; the others evenly over rank kill and application
  Xid. A share --durable-fallback-share (2%, an assumption) of failures lose both
  in-memory copies (a node and its buddy at once: a rack's switch or power) and cost a
  full restart from the durable checkpoint, written in the background every
  --durable-flush-minutes 10 (no stall: the checkpoint daemon flushes it).
* Spares: --spares 250 hot spares (2% of nodes); a failed node is repaired in
  --repair-hours 72 and returns as a spare. With no spare, pitstop shrinks the job by one
  data-parallel replica of 781 (its throughput drops by 1/781 until one returns); the
  other two policies wait for a repaired node.

    .venv/bin/python bench/goodput_sim.py [--seeds 20] [--seed 0] [--days 30]

The last line of stdout is one JSON object: each policy's goodput (mean, p5, p95 over
--seeds runs), where the rest went, and the published anchors beside them (ByteRobust
97% ETTR on 9,600 GPUs, Gemini 97% goodput, Llama 3 > 90% effective training time, as
issue 19 quotes them). Exit status 1 when pitstop's mean is under --target (0.98).
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
HARDWARE_KINDS = ("node_kill", "xid_fatal", "hung_node")
SOFTWARE_KINDS = ("rank_kill", "xid_app")
RECOVERY_KINDS = {
    "node_kill": "node_kill",
    "xid": "xid_fatal",
    "agent_hang": "hung_node",
    "rank_kill": "rank_kill",
    "app_xid": "xid_app",
}
"""bench/recovery.py's failure kinds -> this simulation's."""
RESULTS = Path(__file__).with_name("results")
STATE_GB_PER_GPU = 6.4
"""The 405B model's bf16 weights over TP 8 x PP 16 plus its ZeRO-1 optimizer shard."""
ANCHORS = {
    "ByteRobust (9,600 GPUs, ETTR)": 0.97,
    "Gemini (goodput)": 0.97,
    "Llama 3 (16,384 GPUs, effective training time, lower bound)": 0.90,
}


def recovery_inputs(path: Path, torchrun_p50: float | None) -> tuple[dict[str, float], float, str]:
    """pitstop's recovery medians by kind and torchrun's p50 (kill -9 -> training again)
    from a bench/recovery.py JSON line; torchrun's from `torchrun_p50` when given or when
    that run left torchrun out. Returns them and where each came from."""
    report = json.loads(path.read_text().strip().splitlines()[-1])
    by_kind = report["pitstop"]["p50_by_kind"]
    missing = [kind for kind in RECOVERY_KINDS if kind not in by_kind]
    if missing:
        raise ValueError(f"{path}: pitstop.p50_by_kind lacks {missing}; run bench/recovery.py")
    medians = {ours: float(by_kind[theirs]) for theirs, ours in RECOVERY_KINDS.items()}
    source = f"pitstop: {path.name} (bench/recovery.py, {report.get('date', 'undated')})"
    measured = report.get("torchrun", {}).get("detect_to_resume_seconds", {}).get("p50")
    if torchrun_p50 is not None:
        return medians, torchrun_p50, source + "; torchrun: --torchrun-p50"
    if measured is None:
        raise ValueError(
            f"{path} has no torchrun run (--skip-torchrun): give --torchrun-p50 SECONDS"
        )
    return medians, float(measured), source + f"; torchrun: {path.name}"


def stall_input(path: Path, gigabytes: float) -> tuple[float, str]:
    """pitstop's snapshot stall for `gigabytes` per GPU, at the rate bench/checkpoint.py
    measured its largest GPU case (else its largest CPU case) at."""
    report = json.loads(path.read_text().strip().splitlines()[-1])
    cuda = report.get("cuda")
    cases = cuda if isinstance(cuda, dict) and cuda else report["cases"]
    label, case = max(cases.items(), key=lambda item: item[1].get("bytes", 0))
    seconds_per_gb = case["pitstop_stall_ms"] / 1e3 / (case["bytes"] / 1e9)
    where = "GPU" if cases is cuda else "CPU"
    source = (
        f"{path.name} (bench/checkpoint.py on {report.get('gpu', 'this machine')}): the "
        f"{label} {where} case's {case['pitstop_stall_ms']} ms, scaled to {gigabytes:g} GB"
    )
    return seconds_per_gb * gigabytes, source


@dataclass
class Params:
    gpus: int
    days: float
    step_seconds: float
    durable_save_seconds: float
    full_restart_minutes: tuple[float, float]
    elastic_restart_seconds: float
    elastic_detect_seconds: float
    snapshot_stall_seconds: float
    recovery_sigma: float
    scale_extra_seconds: float
    durable_fallback_share: float
    durable_flush_minutes: float
    spares: int
    repair_hours: float
    pitstop_recovery_medians: dict[str, float] = field(default_factory=dict)
    torchrun_p50_seconds: float = 0.0

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


def failure_kind(rng: random.Random) -> str:
    kinds = HARDWARE_KINDS if rng.random() < LLAMA3_HARDWARE_SHARE else SOFTWARE_KINDS
    return rng.choice(kinds)


class Policy:
    """One way to survive failures: how often it saves, what a save stalls, what a failure
    costs. `simulate` is shared."""

    name = ""
    interval = 0.0  # seconds of training between saves
    stall = 0.0  # wall seconds a save stops training

    def __init__(self, p: Params) -> None:
        self.p = p

    def recovery(self, kind: str, rng: random.Random) -> tuple[float, bool]:
        """Wall seconds from the failure to training again, and whether the work since the
        last durable checkpoint (rather than the last save) is lost."""
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
            took, fallback = self.recovery(kind, rng)
            if fallback:
                ledger.fallbacks += 1
                ledger.kept -= max(since_durable - since_save, 0.0)
                ledger.recomputed += since_durable
                since_durable = 0.0
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
                again, fallback = self.recovery(kind, rng)
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

    def recovery(self, kind: str, rng: random.Random) -> tuple[float, bool]:
        low, high = self.p.full_restart_minutes
        return rng.uniform(low, high) * 60, False


class ElasticRestart(Policy):
    name = "torchrun_elastic"

    def __init__(self, p: Params) -> None:
        super().__init__(p)
        self.stall = p.durable_save_seconds
        self.interval = p.young_daly(self.stall)

    def recovery(self, kind: str, rng: random.Random) -> tuple[float, bool]:
        p = self.p
        detect = p.elastic_detect_seconds if kind in ("node_kill", "hung_node") else 0.0
        measured = p.torchrun_p50_seconds * rng.lognormvariate(0.0, p.recovery_sigma)
        return detect + measured + p.elastic_restart_seconds + p.durable_save_seconds, False


class Pitstop(Policy):
    name = "pitstop"

    def __init__(self, p: Params) -> None:
        super().__init__(p)
        self.stall = p.snapshot_stall_seconds
        self.interval = p.snapshot_interval

    def waits_for_spare(self) -> bool:
        return False

    def recovery(self, kind: str, rng: random.Random) -> tuple[float, bool]:
        p = self.p
        if rng.random() < p.durable_fallback_share:
            low, high = p.full_restart_minutes
            return rng.uniform(low, high) * 60, True
        median = p.pitstop_recovery_medians[kind]
        measured = median * rng.lognormvariate(0.0, p.recovery_sigma)
        extra = p.scale_extra_seconds if kind in HARDWARE_KINDS else 0.0
        return measured + extra, False


POLICIES = (CheckpointRestart, ElasticRestart, Pitstop)


def summarize(ledgers: list[Ledger], policy: Policy) -> dict[str, Any]:
    goodputs = sorted(ledger.goodput() for ledger in ledgers)

    def share(attr: str) -> float:
        return round(statistics.fmean(getattr(x, attr) / x.wall for x in ledgers), 5)

    recoveries = sorted(r for x in ledgers for r in x.recoveries)
    return {
        "goodput_mean": round(statistics.fmean(goodputs), 5),
        "goodput_p5": round(goodputs[int(0.05 * (len(goodputs) - 1))], 5),
        "goodput_p95": round(goodputs[int(0.95 * (len(goodputs) - 1))], 5),
        "save_interval_seconds": round(policy.interval, 1),
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
    add("--elastic-restart-seconds", type=float, default=90.0)
    add("--elastic-detect-seconds", type=float, default=30.0)
    add(
        "--recovery-json",
        type=Path,
        default=RESULTS / "recovery.json",
        help="a bench/recovery.py JSON line: pitstop's recovery medians by kind and torchrun's p50",
    )
    add(
        "--torchrun-p50",
        type=float,
        default=None,
        help="torchrun's kill -9 -> training again, seconds, where --recovery-json has none",
    )
    add(
        "--checkpoint-json",
        type=Path,
        default=RESULTS / "checkpoint-h200.json",
        help="a bench/checkpoint.py JSON line: pitstop's snapshot stall per GB",
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
        default=14.6,
        help="what 12,500 nodes add to a node recovery: bench/scale.py's linear fit of decide "
        "p99 (2.5 s) and fan-out p99 (12.1 s) over 538, 1,038 and 2,568 simulated nodes "
        "(docs/scale.md)",
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
        medians, torchrun_p50, recovery_source = recovery_inputs(
            args.recovery_json, args.torchrun_p50
        )
        if args.snapshot_stall_seconds is None:
            stall, stall_source = stall_input(args.checkpoint_json, args.state_gb_per_gpu)
        else:
            stall, stall_source = args.snapshot_stall_seconds, "--snapshot-stall-seconds"
    except (OSError, ValueError, KeyError, IndexError) as exc:
        parser.error(f"reading the measured inputs: {exc}")
    params = Params(
        gpus=args.gpus,
        days=args.days,
        step_seconds=args.step_seconds,
        durable_save_seconds=args.durable_save_seconds,
        full_restart_minutes=tuple(args.full_restart_minutes),
        elastic_restart_seconds=args.elastic_restart_seconds,
        elastic_detect_seconds=args.elastic_detect_seconds,
        snapshot_stall_seconds=stall,
        recovery_sigma=args.recovery_sigma,
        scale_extra_seconds=args.scale_extra_seconds,
        durable_fallback_share=args.durable_fallback_share,
        durable_flush_minutes=args.durable_flush_minutes,
        spares=args.spares,
        repair_hours=args.repair_hours,
        pitstop_recovery_medians=medians,
        torchrun_p50_seconds=torchrun_p50,
    )
    began = time.perf_counter()
    policies = run(params, args.seeds, args.seed)
    result: dict[str, Any] = {
        "bench": "goodput_sim",
        "seed": args.seed,
        "seeds": args.seeds,
        "assumptions": {
            **{k: v for k, v in vars(params).items()},
            "mtbf_minutes": round(params.mtbf / 60, 2),
            "failures_per_day": round(params.failures_per_second * 86_400, 1),
            "hardware_share": LLAMA3_HARDWARE_SHARE,
            "failure_source": f"Llama 3: {LLAMA3_INTERRUPTIONS} interruptions in "
            f"{LLAMA3_DAYS} days on {LLAMA3_GPUS:,} GPUs, scaled per GPU",
            "recovery_source": recovery_source,
            "snapshot_stall_source": stall_source,
            "scale_extra_source": "--scale-extra-seconds (docs/scale.md's fit)",
        },
        "policies": policies,
        "anchors": ANCHORS,
        "target": {"pitstop_goodput": args.target},
    }
    if args.sensitivity:
        rows = []
        for share in (0.0, 0.02, 0.05, 0.10):
            for stall in (params.snapshot_stall_seconds * f for f in (0.5, 1.0, 4.0)):
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
    pitstop = policies["pitstop"]["goodput_mean"]
    result["target"]["met"] = pitstop >= args.target
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
