"""bench/goodput_sim.py charges each peer what it would pay at 100,000 GPUs, once."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench.* as the scripts are
from bench import goodput_sim as sim


def test_an_elastic_restart_is_charged_its_restart_at_scale_once() -> None:
    # torchrun measured at 4 nodes: a dead process back in 11 s (noticed at once: that
    # is its restart of every worker), a silent host in 24 s (13 s more to notice it).
    medians = sim.PeerMedians(
        to_progress={"rank_kill": 10.9, "node_silent": 24.0},
        to_full={"rank_kill": 11.0, "node_silent": 24.0},
    )
    params = sim.Params(
        gpus=100_000,
        days=30,
        step_seconds=2.0,
        durable_save_seconds=65.0,
        full_restart_minutes=(8.0, 12.0),
        elastic_restart_seconds=90.0,
        snapshot_stall_seconds=0.1,
        async_save_stall_seconds=0.15,
        recovery_sigma=0.0,
        scale_extra_seconds=0.0,
        durable_fallback_share=0.0,
        durable_flush_minutes=10.0,
        spares=250,
        repair_hours=72.0,
        peer_medians={"torchrun": medians},
    )
    torchrun = sim.ElasticRestart(params)
    rng = random.Random(0)
    # The 100,000-rank restart stands in for the measured one; the reload follows.
    assert torchrun.recovery("rank_kill", rng).seconds == pytest.approx(90 + 65)
    # What a silent host adds to notice stays on top.
    assert torchrun.recovery("node_silent", rng).seconds == pytest.approx(24 - 11 + 90 + 65)
