"""What a node may send, checked before it is stored (api/agent_input.py): a value
PostgreSQL cannot hold is refused naming the field's full path, the value and the fix,
wherever in the message it sits and whichever part of it is checked on its own."""

from __future__ import annotations

import json

import pytest
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from pitstop.scheduler.api.agent_input import check_agent_message
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.hotstate import with_received_at
from pitstop.v1 import agent_pb2, common_pb2


def beat(uuid: str = "GPU-1", job_id: str = "j-1", reason: str = "") -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(
        seq=2,
        heartbeat=agent_pb2.Heartbeat(
            time=Timestamp(seconds=1_800_000_000),
            health=common_pb2.NodeHealth(
                reasons=[reason] if reason else [],
                gpus=[common_pb2.GpuHealth(index=0, uuid="GPU-0"), common_pb2.GpuHealth(uuid=uuid)],
            ),
            running_ranks=[
                agent_pb2.RunningRank(job_id="j-1"),
                agent_pb2.RunningRank(job_id=job_id),
            ],
        ),
    )


def refusal(message: Message, **how: str) -> str:
    with pytest.raises(InvalidArgument) as err:
        check_agent_message(message, **how)
    return str(err.value)


@pytest.mark.parametrize(
    ("message", "path"),
    [
        (beat(uuid="GPU\x00"), "heartbeat.health.gpus[1].uuid"),
        (beat(job_id="j\x00"), "heartbeat.running_ranks[1].job_id"),
        (beat(reason="bad\x00"), "heartbeat.health.reasons[0]"),
        (
            agent_pb2.AgentMessage(
                rank_exited=agent_pb2.RankExited(job_id="j", result={"k": "v\x00"})
            ),
            "rank_exited.result['k']",
        ),
        (
            agent_pb2.AgentMessage(
                rank_exited=agent_pb2.RankExited(job_id="j", result={"k\x00": "v"})
            ),
            "rank_exited.result['k\\x00'] (key)",
        ),
    ],
)
def test_a_nul_anywhere_is_refused_by_its_full_path(message: Message, path: str) -> None:
    assert refusal(message).startswith(path)
    assert "remove the NUL character" in refusal(message)


def test_bounded_strings_integers_and_times_are_refused_with_their_limit() -> None:
    long_host = agent_pb2.AgentMessage(
        register=agent_pb2.Register(inventory=common_pb2.Inventory(hostname="h" * 254))
    )
    assert refusal(long_host).startswith("register.inventory.hostname")
    assert "at most 253 characters" in refusal(long_host)
    check_agent_message(agent_pb2.AgentMessage(rank_exited=agent_pb2.RankExited(job_id="j" * 32)))
    long_job = agent_pb2.AgentMessage(rank_exited=agent_pb2.RankExited(job_id="j" * 33))
    assert refusal(long_job).startswith("rank_exited.job_id")
    big = agent_pb2.AgentMessage(xid=common_pb2.XidEvent(xid=2**31))
    assert refusal(big).startswith("xid.xid")
    assert "at most 2147483647" in refusal(big)
    late = agent_pb2.AgentMessage(xid=common_pb2.XidEvent(time=Timestamp(seconds=253_402_300_800)))
    assert refusal(late).startswith("xid.time")
    assert "between years 1 and 9999" in refusal(late)


def test_a_storable_message_passes_whole_and_in_parts() -> None:
    message = beat()
    check_agent_message(message)
    check_agent_message(message.heartbeat, path="heartbeat")
    check_agent_message(message.heartbeat.health, path="heartbeat.health")


def test_a_part_checked_on_its_own_is_named_by_its_place_and_can_be_left_out() -> None:
    message = beat(uuid="GPU\x00")
    health = message.heartbeat.health
    assert refusal(health, path="heartbeat.health").startswith("heartbeat.health.gpus[1].uuid")
    # What the scheduler does with a heartbeat whose health it checked before:
    check_agent_message(message.heartbeat, path="heartbeat", skip="heartbeat.health")
    bad_rank = beat(uuid="GPU\x00", job_id="j\x00")
    assert refusal(bad_rank.heartbeat, path="heartbeat", skip="heartbeat.health").startswith(
        "heartbeat.running_ranks[1].job_id"
    )
    # Lengths follow the field's place too: a job id is bounded where it is stored.
    long_job = agent_pb2.AgentMessage(rank_exited=agent_pb2.RankExited(job_id="j" * 33))
    assert refusal(long_job.rank_exited, path="rank_exited").startswith("rank_exited.job_id")


def test_live_health_gains_its_receipt_time_without_being_parsed() -> None:
    assert json.loads(with_received_at("{}", 12.5)) == {"received_at": 12.5}
    kept = json.loads(with_received_at('{"verdict": "HEALTH_VERDICT_HEALTHY", "gpus": []}', 3.0))
    assert kept == {"received_at": 3.0, "verdict": "HEALTH_VERDICT_HEALTHY", "gpus": []}
    with pytest.raises(ValueError, match="JSON object"):
        with_received_at("[1]", 1.0)
