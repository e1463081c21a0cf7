"""The benchmarks stay runnable: a tiny run of each prints one JSON object last."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.client.launch import clean_env

ROOT = Path(__file__).resolve().parents[2]
# As the dashboard tests (test_dashboard.py) skip: without Chromium there is no browser.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_api_benchmark_prints_one_json_line() -> None:
    env = clean_env()
    result = subprocess.run(
        [
            sys.executable,
            "bench/api.py",
            "--requests",
            "20",
            "--serial-requests",
            "20",
            "--concurrency",
            "2",
            "--json-only",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "api"
    assert report["stores"] == "embedded"
    for phase in ("submit", "get"):
        assert report[phase]["throughput_rps"] > 0
        assert 0 < report[phase]["p50_ms"] <= report[phase]["p99_ms"]


def test_placement_benchmark_prints_one_json_line() -> None:
    result = subprocess.run(
        [sys.executable, "bench/placement.py", "--runs", "1", "--skip-redis"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # 1: a target missed, which a busy machine may do: the bench measures, this test
    # checks that it runs and reports (a crash is another status and no JSON).
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "placement"
    assert report["gang"]["ranks"] == 8 * 16 * 781
    assert report["place"]["ranks"] == report["gang"]["ranks"]


def test_goodput_simulation_prints_one_json_line() -> None:
    result = subprocess.run(
        [sys.executable, "bench/goodput_sim.py", "--seeds", "2", "--days", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stderr  # 1: pitstop under its target
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "goodput_sim"
    policies = report["policies"]
    measured = json.loads((ROOT / "bench/results/recovery.json").read_text())
    # Every peer the recovery run measured is simulated beside pitstop, and no other.
    peers = {name for name in ("torchrun", "torchft", "nvrx") if "rank_kill" in measured[name]}
    assert set(policies) == {"checkpoint_restart", "pitstop", *peers}
    for row in policies.values():
        assert 0 < row["goodput_mean"] < 1
        assert row["failures_mean"] > 0
    # Its inputs are the result files the benchmarks wrote (bench/results/), not typed in.
    assumptions = report["assumptions"]
    assert "recovery.json" in assumptions["recovery_source"]
    assert "checkpoint-h200.json" in assumptions["snapshot_stall_source"]
    assert "scale.json" in assumptions["scale_extra_source"]
    assert assumptions["pitstop_recovery_medians"]["node_silent"] == pytest.approx(
        measured["pitstop"]["p50_by_kind"]["node_silent"]
    )
    for name in peers:
        assert assumptions["peer_medians"][name]["to_full_p50_s"]["rank_kill"] == pytest.approx(
            measured[name]["rank_kill"]["to_full_s"]["p50"]
        )
    scale = json.loads((ROOT / "bench/results/scale.json").read_text())["at_12500"]
    assert assumptions["scale_extra_seconds"] == pytest.approx(
        scale["decide_s"] + scale["fanout_s"]
    )
    assert result.returncode == (0 if report["target"]["met"] else 1)


def run_scale(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "bench/scale.py",
            "--nodes",
            "16",
            "--window",
            "2",
            "--trials",
            "1",
            "--step-seconds",
            "0.5",
            "--kinds",
            "stream",
            "xid",
            "silent",
            "--ingest",
            "1",
            "--skip-scaleout",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


@pytest.mark.timeout(240)  # the run's own limit below governs, and shows its output
def test_scale_benchmark_prints_one_json_line() -> None:
    """Real schedulers (one deciding, one holding the streams), PostgreSQL and Redis, with
    mutual TLS; 16 simulated nodes and spares; a broken stream, a fatal Xid and a silent
    death (the node's network cut: no reset) detected, decided and fanned out to every
    node of the job, and the headline the issue asks for."""
    env = clean_env()
    try:
        result = run_scale(env)
    except subprocess.TimeoutExpired as exc:  # what it printed says where it waited
        err = exc.stderr or b""
        tail = (err.decode(errors="replace") if isinstance(err, bytes) else err)[-3000:]
        pytest.fail(f"bench/scale.py ran past {exc.timeout} s; its stderr ends:\n{tail}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "scale"
    (size,) = report["details"]
    assert size["nodes"] == 16
    assert size["job"]["ranks"] == 128
    assert size["load"]["heartbeats_ingested_per_s"] > 0
    assert size["load"]["step_summaries_per_s"] > 0
    assert size["load"]["streams_reopened"] == 0
    kinds = [f["kind"] for f in size["failures"]]
    assert kinds == ["stream", "xid", "silent"]
    for failure in size["failures"]:
        assert "error" not in failure, failure
        assert failure["detect_seconds"] >= 0
        assert failure["decide_to_commit_seconds"] >= failure["decide_seconds"]
        assert failure["nodes_told"] >= 16  # every node of the job has its command
        assert failure["fanout_seconds"] is not None
    (headline,) = report["sizes"]
    assert headline == report["largest"]
    assert headline["nodes"] == 16 + size["spares"]
    assert headline["false_losses"] == 0
    assert headline["processes"] == {"deciding": 1, "ingest": 1}
    assert headline["samples"] == {"silent": 1, "pushed": 2, "decide": 3, "fanout": 3}
    # One silent death: too few samples for a p99 (30 needed), its time the median; in
    # the lagged samples' block instead if a simulator process lagged meanwhile.
    assert headline["detect_silent_p99_s"] is None
    assert headline["detect_silent"]["p99_needs"] == 30
    silent = [headline["detect_silent"]["p50"], *headline["sim_lagged"].get("detect_silent", [])]
    assert [t for t in silent if t is not None and t > 0] != []
    assert 0 < headline["command_bytes_max"] < 64 << 10
    assert report["at_12500"] is None  # one size: nothing to fit a line through


@pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None,
    reason="playwright is not installed: pip install -e '.[dev]'",
)
@pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (scripts/system_packages.sh installs it "
    "as root: apt-get install chromium)",
)
@pytest.mark.timeout(240)
def test_dashboard_benchmark_prints_one_json_line() -> None:
    """Embedded stores, a small synthetic fleet, one measured load in headless Chromium."""
    env = clean_env()
    result = subprocess.run(
        [sys.executable, "bench/dashboard.py", "--nodes", "50", "--ranks", "200", "--loads", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    # 1: the render target missed, which a busy machine may do (see the placement test).
    assert result.returncode in (0, 1), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bench"] == "dashboard"
    assert (report["nodes"], report["ranks"], report["loads"]) == (50, 200, 1)
    assert report["stores"] == "embedded"
    (render_ms,) = report["render_ms"]
    assert render_ms > 0
    assert result.returncode == (0 if report["met"] else 1)


def test_checkpoint_benchmark_prints_one_json_line_and_stops_its_daemons() -> None:
    """A tiny run of every case: the floors and the peers beside pitstop's stall, the
    tuned async_save's settings in the output, and no daemon or segment left behind."""
    env = clean_env()
    command = [sys.executable, "bench/checkpoint.py", "--sizes-mb", "8", "--sharded-mb", "8"]
    command += ["--loop-sizes-mb", "8"]  # the loop case too, at the smoke's size
    bench = subprocess.Popen(
        [*command, "--reps", "1", "--cuda"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        out, err = bench.communicate(timeout=180)
    finally:
        bench.kill()
    assert bench.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["bench"] == "checkpoint"
    plain, sharded = report["cases"]["8MB"], report["cases"]["sharded-8MB-per-rank"]
    for case in (plain, sharded):
        assert case["memcpy_threads"] >= 1
        for key in ("memcpy_ms", "memcpy_1thread_ms", "pitstop_stall_ms", "async_save_ms"):
            assert case[key] > 0, key
    assert plain["async_save_cold_ms"] > 0
    assert plain["torch_save_ms"] > 0
    config = report["async_save_config"]
    assert config["use_async_staging"] is True
    assert config["timed_until"] == "staging_completion"
    assert config["process_group"] == "gloo, one rank"
    for mode in ("split", "shared"):  # a computing loop, its CPUs shared or split
        loop = report["loop"]["8MB"][mode]
        rounds = loop["rounds_ms"]  # each way timed; what a snapshot adds is their
        for way in ("bare", "pitstop", "async_save", "memcpy"):  # difference, noise at 8 MB
            assert len(rounds[way]) == 1, (mode, way, loop)  # --reps 1
            assert rounds[way][0] > 0, (mode, way, loop)
        added = rounds["pitstop"][0] - rounds["bare"][0]  # one round each: its median
        assert loop["pitstop_added_ms"] == pytest.approx(added, abs=0.02), loop
    if not report.get("gpu"):
        assert report["cuda"] == "skipped: torch.cuda.is_available() is False"
    # Its daemons (node ids bench-a-PID, bench-b-PID) are gone, with their segments.
    names = {f"bench-{side}-{bench.pid}".encode() for side in "ab"}
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if b"pitstop.checkpointd.main" in argv and names & set(argv):
            left.append(cmdline.parent.name)
    assert left == [], f"daemons left running: {left}"
    assert list(Path("/dev/shm").glob(f"pitstop-ckpt-bench-[ab]-{bench.pid}-*")) == []
