"""The exits an agent reports again with each Register: its ranks' of the last ten
minutes, at most 256, a standby's never (it decides nothing)."""

from __future__ import annotations

from pitstop.agent.outbox import RECENT_EXITS_KEPT, RECENT_EXITS_SECONDS, RecentExits
from pitstop.v1 import agent_pb2


def test_recent_exits_are_a_jobs_ranks_of_the_last_minutes() -> None:
    now = [1000.0]
    exits = RecentExits(clock=lambda: now[0])
    exits.add(agent_pb2.RankExited(job_id="j-1", generation=1, rank=0))
    exits.add(agent_pb2.RankExited(job_id="", rank=0, exit_code=1))  # a standby
    now[0] += 60
    exits.add(agent_pb2.RankExited(job_id="j-1", generation=1, rank=1))
    assert [(e.job_id, e.rank) for e in exits.recent()] == [("j-1", 0), ("j-1", 1)]
    now[0] += RECENT_EXITS_SECONDS - 30  # the first is older than the window now
    assert [e.rank for e in exits.recent()] == [1]
    for rank in range(RECENT_EXITS_KEPT + 10):
        exits.add(agent_pb2.RankExited(job_id="j-2", generation=1, rank=rank))
    kept = exits.recent()
    assert len(kept) == RECENT_EXITS_KEPT
    assert kept[-1].rank == RECENT_EXITS_KEPT + 9
