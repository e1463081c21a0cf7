"""What the chaos benchmark needs of a local cluster's record: several schedulers reached
through one gRPC target, a second scheduler's stray found as no node's, its state dir
wiped with the rest, and the metrics address and the agent-kept checkpoint daemon kept
in cluster.json."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pitstop.client.localcluster import ClusterProcess, LocalCluster, TaggedProcess, wipe_state_dir
from pitstop.client.localcluster.processes import holding_a_rank
from pitstop.client.localcluster.statefile import NodeSpec


def scheduler(name: str, port: int) -> ClusterProcess:
    return ClusterProcess(
        name=name,
        kind="scheduler",
        pid=100 + port % 100,
        log=Path(f"/tmp/{name}.log"),
        address=f"127.0.0.1:{port}",
        metrics=f"127.0.0.1:{port + 1}",
    )


def test_one_scheduler_is_reached_at_its_address() -> None:
    cluster = LocalCluster(Path("/tmp/c"), "127.0.0.1:5000", [], [scheduler("scheduler", 5000)])
    assert cluster.scheduler_target == "127.0.0.1:5000"


def test_several_schedulers_are_one_target_tried_in_turn() -> None:
    procs = [scheduler("scheduler", 5000), scheduler("scheduler-2", 6000)]
    cluster = LocalCluster(Path("/tmp/c"), "127.0.0.1:5000", [], procs)
    assert cluster.scheduler_target == "ipv4:127.0.0.1:5000,127.0.0.1:6000"
    assert [p.name for p in cluster.schedulers] == ["scheduler", "scheduler-2"]


def test_a_second_scheduler_found_by_its_environment_is_no_nodes() -> None:
    tagged = TaggedProcess(
        pid=42,
        daemon="scheduler-2",
        argv=("/venv/bin/pitstop-scheduler", "--port", "0"),
        rank=False,
        session_leader=True,
    )
    proc = ClusterProcess.from_tagged(tagged, Path("/tmp/logs"))
    assert (proc.kind, proc.node_id, proc.log.name) == ("scheduler", "", "scheduler-2.log")


def test_the_record_keeps_metrics_and_who_keeps_the_checkpoint_daemons(tmp_path: Path) -> None:
    procs = [scheduler("scheduler", 5000), scheduler("scheduler-2", 6000)]
    nodes = [NodeSpec("node-1", "worker", "r1")]
    cluster = LocalCluster(tmp_path, "127.0.0.1:5000", nodes, procs, agent_owns_checkpointd=True)
    cluster._save()
    loaded = LocalCluster.load(tmp_path)
    assert loaded is not None
    assert loaded.agent_owns_checkpointd
    assert [p.metrics for p in loaded.schedulers] == ["127.0.0.1:5001", "127.0.0.1:6001"]
    assert loaded.scheduler_target == cluster.scheduler_target


def test_wipe_removes_every_schedulers_state_dir(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    for name in ("scheduler", "scheduler-2", "nodes", "logs"):
        (root / name).mkdir(parents=True)
    assert wipe_state_dir(root)
    assert not root.exists()


def test_the_rank_is_told_from_the_standby_beside_it_by_the_log_it_writes(
    tmp_path: Path,
) -> None:
    """A rank_kill must hit the rank: after a restart of every rank the standby beside
    one may be the older process, so the lowest pid is not the rank."""
    folder = tmp_path / "ranks" / "j-1"
    folder.mkdir(parents=True)
    started = []
    try:
        for log, own_session in [
            ("standby-gpu0.log", True),  # started first: the lower pid
            ("rank-0.log", True),
            ("rank-0.log", False),  # what the rank forked: not a session of its own
            ("rank-0.1.log", True),  # an earlier rank's log, kept under another name
        ]:
            with open(folder / log, "ab") as out:
                started.append(
                    subprocess.Popen(["sleep", "60"], stdout=out, start_new_session=own_session)
                )
        pids = [p.pid for p in started]
        assert holding_a_rank(pids) == [pids[1]]
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
