"""What each node is sent for a generation: its own ranks, the job's sizes and the map's
digest, never the whole map (2.4 MB at 99,968 ranks, sent to each of 12,500 nodes)."""

from __future__ import annotations

from pitstop.scheduler.reconcile.commands import JobMessages
from pitstop.scheduler.services.node_commands import DueCommand, NodeAction
from pitstop.scheduler.topology import Placement, RankSlot, rank_coordinates
from pitstop.v1 import agent_pb2

TP, PP = 8, 16
LIMIT = 64 << 10


def placement(nodes: int) -> Placement:
    """The 99,968-rank job (docs/scale.md) on `nodes` 8-GPU nodes: TP 8 x PP 16 x DP, a
    node per TP group."""
    slots = []
    for rank in range(nodes * 8):
        dp, pp, tp = rank_coordinates(rank, TP, PP)
        slots.append(RankSlot(rank, f"node-{rank // 8:05d}", tp, tp, dp, pp, tp))
    return Placement(tuple(slots))


def messages(where: Placement) -> JobMessages:
    start = agent_pb2.StartRanks(
        job_id="job-big",
        generation=7,
        command=["python", "-m", "train"],
        env={"CONFIG": "llama-405b.toml"},
        rendezvous_address="node-00000:20007",
        restore_step=1200,
    )
    return JobMessages(start, where)


def due(node_id: str, action: NodeAction) -> DueCommand:
    return DueCommand(job_id="job-big", node_id=node_id, generation=7, action=action, sends=1)


def test_a_nodes_command_carries_its_own_ranks_the_sizes_and_the_digest() -> None:
    where = placement(32)
    build = messages(where)
    start = build.message(due("node-00009", NodeAction.START)).start_ranks
    assert [a.rank for a in start.rank_map.ranks] == list(range(72, 80))
    assert {a.node_id for a in start.rank_map.ranks} == {"node-00009"}
    shared = start.rank_map
    assert (shared.world_size, shared.dp_size, shared.pp_size, shared.tp_size) == (256, 2, 16, 8)
    assert shared.node_local
    assert shared.generation == 7
    assert (start.restore_step, start.rendezvous_address) == (1200, "node-00000:20007")
    adopt = build.message(due("node-00011", NodeAction.ADOPT)).reconfigure
    assert list(adopt.adopted_ranks) == list(range(88, 96))
    assert [a.rank for a in adopt.rank_map.ranks] == list(range(88, 96))
    assert adopt.rank_map.digest == shared.digest  # the same map, seen from two nodes
    assert (
        messages(placement(48))
        .message(due("node-00009", NodeAction.START))
        .start_ranks.rank_map.digest
        != shared.digest
    )


def test_at_99968_ranks_the_largest_command_stays_under_64_kib() -> None:
    full = placement(12_496)  # 99,968 ranks: DP 781 of TP 8 x PP 16
    big = messages(full)
    small = messages(placement(16))
    for action in (NodeAction.START, NodeAction.RECONFIGURE, NodeAction.ADOPT):
        at_scale = big.message(due("node-12495", action)).ByteSize()
        assert at_scale < LIMIT
        # Only the numbers widen (a rank of 99,967 is a 3-byte varint, of 127 one byte).
        assert at_scale <= small.message(due("node-00015", action)).ByteSize() + 100
