"""The fault matrix without a fault: the example job (dp=4, one rank per node) ends with
the hash of the example run standalone; paused and resumed it skips and repeats no step;
the records of two runs differ only where their seeds reach."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kit.faultcluster import (
    EXAMPLE,
    SPARE,
    STEPS,
    Cluster,
    check_result,
    finish_all,
    steps_logged,
    wait_until,
)
from kit.stores import unique
from pitstop.client.cli import app
from pitstop.common.codeversion import code_version
from pitstop.v1 import common_pb2, jobs_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


def test_fault_free_run_matches_the_standalone_hash(cluster: Cluster, standalone_hash: str) -> None:
    job = cluster.submit()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1, cluster.logs(job.id)  # nothing was recovered
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))
    assert done.goodput.recoveries == 0
    assert done.goodput.productive_seconds > 0
    assert done.goodput.ratio == 1.0
    # The spare held a standby process for the job; it goes when the job ends.
    standby_log = cluster.nodes[SPARE].root / "agent" / "ranks" / job.id / "standby-gpu0.log"
    assert "--- pitstop: standby on GPU 0" in standby_log.read_text()
    wait_until(lambda: cluster.rank_pids(SPARE) == [], "the standby process stops")


def test_pause_then_resume_through_the_cli_skips_and_repeats_no_step(
    cluster: Cluster, standalone_hash: str
) -> None:
    job = cluster.submit(
        standby=False
    )  # returns once the ranks are stepping: the pause lands mid-run
    cli = CliRunner()
    server = cluster.cli_options()
    paused = cli.invoke(app, [*server, "job", "pause", job.id], catch_exceptions=False)
    assert paused.exit_code == 0, paused.output
    assert cluster.get(job.id).state == common_pb2.JOB_STATE_PAUSED
    resumed = cli.invoke(app, [*server, "job", "resume", job.id], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1  # paused and resumed in place: never restarted
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))


def test_the_records_of_two_runs_with_different_seeds_differ_only_where_the_seed_reaches(
    cluster: Cluster,
) -> None:
    """Two runs of the example, one with another seed: each record names the code the
    client submitted from, the ranks' software and the data digest; their diff shows
    the seed's command line, data digest and results, never the code or the software."""
    here = code_version(Path(__file__).parent)
    submitted = []
    for seed in ("1234", "99"):  # side by side: two workers each
        command = [*EXAMPLE, "--steps", "10", "--seed", seed, "--log-every", "0"]
        spec = jobs_pb2.JobSpec(name=unique("seed"), command=command, dp=2, gpus_per_node=1)
        submitted.append(cluster.jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec, code=here)).job)
    jobs = finish_all(cluster, [job.id for job in submitted])
    cli, server = CliRunner(), cluster.cli_options()
    shown = cli.invoke(app, [*server, "job", "record", jobs[0].id, "--json"])
    assert shown.exit_code == 0, shown.output
    record = json.loads(shown.output)
    assert record["submitted_code"]["git_commit"] == here.git_commit != ""
    (generation,) = record["generations"]
    assert generation["environment"]["torch"]
    assert generation["environment"]["python"]
    assert len(generation["data_digest"]) == 64
    assert record["final_weights_hash"] == jobs[0].result["final_weights_sha256"]
    diffed = cli.invoke(app, [*server, "job", "diff", jobs[0].id, jobs[1].id, "--json"])
    assert diffed.exit_code == 0, diffed.output
    differ = json.loads(diffed.output)["differ"]
    assert "generations.0.data_digest" in differ, differ
    assert "final_weights_hash" in differ, differ
    assert any(key.startswith("spec.command") for key in differ), differ
    unexpected = [
        key
        for key in differ
        if key.startswith(("submitted_code", "generations.0.environment", "generations.0.code"))
        or key in ("spec.dp", "state", "current_step", "spec.project")
    ]
    assert unexpected == [], differ
