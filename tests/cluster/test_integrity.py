"""The fault matrix, failures that do not crash: a slow GPU (a straggler), silent data
corruption and NaN losses, a hung rank, a spare failing its preflight, an early warning
that drains a node."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kit.faultcluster import (
    SPARE,
    STEP_SECONDS,
    Cluster,
    Node,
    check_result,
    reference_hash,
    steps_never_run,
)
from kit.forking import ForkClient
from pitstop.client.cli import app
from pitstop.v1 import common_pb2, jobs_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


def test_a_slow_gpu_is_swapped_out_as_a_straggler(cluster: Cluster, standalone_hash: str) -> None:
    """A GPU turns 8x slower mid-run. Its rank's compute time (the step less the wait in
    the gradient exchange) stands out, the rank is flagged after two slow windows, and
    the job's swap policy moves it to the spare in place; the job ends bitwise equal.
    Beside a CPU load, a 3x slowdown of a 0.05 s step hid in the others' noise and the
    run ended before the swap: here steps take 0.1 s, so the slow GPU's 0.8 s steps
    leave the swap many steps to land in, however late the fault reaches the node."""
    policy = jobs_pb2.StragglerPolicy(
        action=jobs_pb2.STRAGGLER_ACTION_SWAP, windows=2, window_steps=3, warmup_steps=2
    )
    job = cluster.submit("--step-seconds", str(2 * STEP_SECONDS), straggler=policy)
    rank = random.randrange(4)
    victim = cluster.node_of(job, rank)
    cluster.wait_for_step(job, rank, 3)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, slow_multiplier=8.0))
    flagged = cluster.job_event(job.id, "job.straggler")
    assert flagged.attributes["rank"] == str(rank), flagged
    assert float(flagged.attributes["slowdown"]) > 1.5, flagged
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in placed, f"{placed}\n{cluster.logs(job.id)}"
    assert SPARE in placed, placed
    for each in range(4):
        assert steps_never_run(cluster, done, each) == set()
    assert f"{victim.node_id} swapped out" in done.goodput.incidents[0].cause, done.goodput


def test_silent_corruption_and_nan_losses_are_caught_rolled_back_and_moved_off(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """Failures that do not crash, drilled through the CLI on a dp=4 job (four replicas):
    a NaN loss on one rank rolls every rank back and skips the batch (kept in the job's
    record); a bit flipped in one replica's weights is caught at the next snapshot, that
    rank named against the three that agree, its node quarantined and its rank moved to
    the spare; a second NaN reaches the policy's maximum of two rollbacks and pauses the
    job with the reason. Resumed, the job ends with the hash of a fault-free run told to
    skip the same batches."""
    steps = 70
    policy = jobs_pb2.IntegrityPolicy(max_rollbacks=2)
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1", integrity=policy)
    cli, server = CliRunner(), cluster.cli_options()

    def inject(rank: int, flag: str) -> Node:
        node = cluster.node_of(cluster.get(job.id), rank)
        done = cli.invoke(
            app,
            [*server, "node", "inject-fault", node.node_id, "--gpu", "0", flag],
            catch_exceptions=False,
        )
        assert done.exit_code == 0, done.output
        return node

    cluster.wait_for_step(job, 1, 5)
    inject(1, "--nan")
    rolled = cluster.job_event(job.id, "job.rolled_back")
    assert rolled.attributes["kind"] == "nonfinite", rolled
    assert rolled.attributes["ranks"] == "1", rolled
    first = int(rolled.attributes["skipped_step"])
    assert int(rolled.attributes["rolled_back_to"]) == first - 1, rolled
    assert list(cluster.get(job.id).skipped_steps) == [first]

    corrupt = inject(2, "--sdc")
    found = cluster.job_event(job.id, "job.sdc_detected")
    assert found.attributes["rank"] == "2", found
    assert found.attributes["digest"] != found.attributes["expected_digest"], found
    quarantined = cluster.wait(
        lambda e: e.kind == "node.unhealthy" and e.node_id == corrupt.node_id,
        f"{corrupt.node_id} quarantined",
    )
    assert quarantined.reason.startswith("sdc: "), quarantined
    assert quarantined.attributes["step"] == found.attributes["step"], quarantined
    cluster.job_event(job.id, "job.recovered")

    inject(3, "--nan")
    rolled = cluster.job_event(job.id, "job.rolled_back")
    second = int(rolled.attributes["skipped_step"])
    paused = cluster.job_event(job.id, "job.pause")
    assert "max_rollbacks" in paused.reason, paused
    assert cluster.get(job.id).state == common_pb2.JOB_STATE_PAUSED
    resumed = cli.invoke(app, [*server, "job", "resume", job.id], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    done = cluster.finish(job.id)

    assert list(done.skipped_steps) == [first, second]
    placed = {a.node_id for a in done.rank_map.ranks}
    assert corrupt.node_id not in placed, placed
    assert SPARE in placed, placed
    expected = reference_hash(rank_forks, tmp_path, steps, skipped=[first, second])
    assert done.result["final_weights_sha256"] == expected, cluster.logs(job.id)


def test_with_two_replicas_a_replay_names_the_corrupt_one(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """dp=2: two replicas that disagree cannot outvote each other. Both roll back to the
    last checked step and replay; the fault was transient, so the replay is clean and
    the replica whose first result it does not reproduce is named, its node quarantined
    and its rank moved to the spare. The job ends with the fault-free hash."""
    steps = 60  # at 0.1 s a step, outlasting the fault's way to the rank
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1", dp=2)
    victim = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, 5)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, sdc=True))
    found = cluster.job_event(job.id, "job.sdc_detected")
    assert found.attributes["rank"] == "1", found
    assert found.attributes["ranks"] == "0,1", found
    assert "replay does not reproduce" in found.reason, found
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in placed, placed
    assert SPARE in placed, placed
    replayed = cluster.node_of(done, 0).rank_log(job.id, 0).read_text()
    assert "replaying to tell which is wrong" in replayed, replayed[-3000:]


@pytest.mark.parametrize("spares", [2])
def test_a_spare_that_fails_its_preflight_never_gets_ranks(
    cluster: Cluster, standalone_hash: str
) -> None:
    """A spare whose preflight fails (inject-fault --fail-preflight) is quarantined with
    the reason and never gets ranks: a node lost mid-run moves to the next spare, and
    the job ends with the fault-free hash."""
    failing, good = SPARE, f"{SPARE}1"
    flags = ["--gpu", "0", "--fail-preflight"]
    shown = CliRunner().invoke(
        app,
        [*cluster.cli_options(), "node", "inject-fault", failing, *flags],
        catch_exceptions=False,
    )
    assert shown.exit_code == 0, shown.output
    quarantined = cluster.wait(
        lambda e: e.kind == "node.unhealthy" and e.node_id == failing, f"{failing} quarantined"
    )
    assert "preflight failed: an injected preflight failure" in quarantined.reason, quarantined
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    victim = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, 5)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert failing not in placed, placed
    assert good in placed, placed
    assert victim.node_id not in placed, placed


def test_an_early_warning_drains_the_node_and_moves_its_rank_without_losing_a_step(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A pending row remap (inject-fault --pending-row-remap) is a warning, not a
    failure: the node drains, and once a step is committed its rank moves to the spare
    from that step, the node's own snapshot in memory (no step given up); the job ends
    with the fault-free hash."""
    steps = 80  # at 0.1 s a step: the drain lands mid-run (it waits for a committed step)
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1")
    victim = cluster.node_of(job, 1)
    flags = ["--gpu", "0", "--pending-row-remap"]
    shown = CliRunner().invoke(
        app,
        [*cluster.cli_options(), "node", "inject-fault", victim.node_id, *flags],
        catch_exceptions=False,
    )
    assert shown.exit_code == 0, shown.output
    draining = cluster.wait(
        lambda e: e.kind == "node.draining" and e.node_id == victim.node_id,
        f"{victim.node_id} draining",
    )
    assert "row remap" in draining.reason.lower(), draining
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in placed, cluster.logs(job.id)
    assert SPARE in placed, placed
    # One incident, resumed on its own decision: the rank moved to the waiting standby
    # and trained again, not at the 30 s deadline's full restart (a fallback incident).
    (incident,) = done.goodput.incidents
    assert incident.kind == jobs_pb2.INCIDENT_KIND_NODE, incident
    assert incident.resumed, incident
    assert victim.node_id in incident.cause, incident
    assert incident.lost_steps == 0, incident


def test_a_hung_rank_is_named_by_its_stacks_and_replaced(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """A rank blocks outside any collective (inject-fault --hang); the others wait for it
    in the gradient exchange, every process alive. After the hang threshold (3 s here)
    the scheduler takes every rank's stacks (py-spy), names the one that is not in the
    all_gather, and replaces it; the job recovers within twice the threshold of its last
    step and ends with the fault-free hash. `pitstop job stacks` shows what was seen."""
    steps, floor = 60, 3.0
    policy = jobs_pb2.IntegrityPolicy(hang_floor_seconds=floor)
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1", integrity=policy)
    victim = cluster.node_of(job, 2)
    cluster.wait_for_step(job, 2, 5)
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, hang=True))
    hang = cluster.job_event(job.id, "job.hang")
    assert float(hang.attributes["threshold_seconds"]) == floor, hang
    located = cluster.job_event(job.id, "job.hang_located", "job.hang_unlocated")
    assert located.kind == "job.hang_located", (located, cluster.logs(job.id))
    assert located.attributes["ranks"] == "2", located
    assert located.attributes["incident"] == str(hang.id), located
    recovered = cluster.job_event(job.id, "job.recovered")
    silent = float(hang.attributes["silent_seconds"])
    since_last_step = silent + (recovered.time.ToNanoseconds() - hang.time.ToNanoseconds()) / 1e9
    assert since_last_step <= 2 * floor, (since_last_step, cluster.logs(job.id))
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    shown = CliRunner().invoke(
        app, [*cluster.cli_options(), "job", "stacks", job.id], catch_exceptions=False
    )
    assert shown.exit_code == 0, shown.output
    assert f"hang incident {hang.id} of job {job.id}" in shown.output, shown.output
    assert "hung ranks: 2 (" in shown.output, shown.output
    assert "hang_here" in shown.output, shown.output  # the hung rank's own frame
    assert "all_gather" in shown.output, shown.output  # where the others waited
