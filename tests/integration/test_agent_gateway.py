"""The scheduler's side of the agent stream: Xids and verdicts become node states with
reasons and events; broken streams and missed deadlines make nodes LOST; malformed
traffic is refused with a clear status."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
import redis
from google.protobuf import timestamp_pb2

from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from kit.waits import wait_until
from pitstop.scheduler.services.health import LAST_SEEN_AT
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2, nodes_pb2, nodes_pb2_grpc

BEAT = 0.2  # seconds: liveness deadline 2.5 beats


@pytest.fixture(scope="module")
def fast(stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerThread]:
    """A scheduler with a short heartbeat interval and its own Redis keys."""
    settings = scheduler_settings(
        stores,
        tmp_path_factory.mktemp("fast"),
        database_url=stores.fresh_database(),
        leader_loops=True,  # the liveness scan runs in the leader
        heartbeat_interval_seconds=BEAT,
        refresh_interval_seconds=BEAT,  # every look a heartbeat: the deadline's tests
        redis_prefix=stores.redis_prefix + "fast:",
        liveness_startup_grace_seconds=0.0,
    )
    thread = SchedulerThread(settings)
    yield thread
    thread.stop()


@pytest.fixture
def nodes(fast: SchedulerThread) -> Any:
    return nodes_pb2_grpc.NodeServiceStub(fast.channel())


def wait_for_event(fast: SchedulerThread, node_id: str, kind: str, after: int = 0) -> Any:
    """Follow the node's events until one of ``kind`` arrives (or time out)."""
    events = nodes_pb2_grpc.EventServiceStub(fast.channel())
    stream = events.Watch(
        nodes_pb2.WatchEventsRequest(node_id=node_id, after_event_id=after), timeout=15
    )
    for event in stream:
        if event.kind == kind:
            stream.cancel()
            return event
    raise AssertionError(f"no {kind} event for {node_id}")


def healthy(gpus: int = 8) -> common_pb2.NodeHealth:
    return common_pb2.NodeHealth(
        verdict=common_pb2.HEALTH_VERDICT_HEALTHY,
        gpus=[
            common_pb2.GpuHealth(index=i, verdict=common_pb2.HEALTH_VERDICT_HEALTHY)
            for i in range(gpus)
        ],
    )


def test_fatal_xid_marks_the_node_unhealthy_with_the_xid_in_the_reason(
    fast: SchedulerThread, nodes: Any
) -> None:
    node_id = unique("xid")
    with fast.agent_stream(node_id) as agent:
        agent.send(heartbeat=agent_pb2.Heartbeat(health=healthy()))
        agent.send(xid=common_pb2.XidEvent(gpu_index=3, gpu_uuid=f"GPU-{node_id}-3", xid=79))
        event = wait_for_event(fast, node_id, "node.unhealthy")
        assert "Xid 79 on GPU 3" in event.reason
        assert (event.from_state, event.to_state) == ("ready", "unhealthy")
        node = nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id))
        assert node.state == common_pb2.NODE_STATE_UNHEALTHY
        assert "Xid 79" in node.reason
        assert [x.xid for x in node.xid_history] == [79]
        assert node.xid_history[0].verdict == common_pb2.HEALTH_VERDICT_FATAL


@pytest.mark.parametrize(
    ("xid", "kind", "state"),
    [
        (13, "node.xid", common_pb2.NODE_STATE_READY),  # application: the rank restarts
        (63, "node.draining", common_pb2.NODE_STATE_DRAINING),  # warning: drain
    ],
)
def test_application_and_warning_xids(
    fast: SchedulerThread, nodes: Any, xid: int, kind: str, state: int
) -> None:
    node_id = unique("xid")
    with fast.agent_stream(node_id) as agent:
        agent.send(xid=common_pb2.XidEvent(gpu_index=0, xid=xid))
        event = wait_for_event(fast, node_id, kind)
        assert f"Xid {xid} on GPU 0" in event.reason
        assert nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id)).state == state


def test_a_fatal_heartbeat_verdict_marks_unhealthy_once_and_uncordon_needs_a_repair(
    fast: SchedulerThread, nodes: Any
) -> None:
    node_id = unique("ecc")
    fatal = common_pb2.NodeHealth(
        verdict=common_pb2.HEALTH_VERDICT_FATAL, reasons=["GPU 2: 1 uncorrected ECC errors"]
    )
    with fast.agent_stream(node_id) as agent:
        agent.send(heartbeat=agent_pb2.Heartbeat(health=fatal))
        first = wait_for_event(fast, node_id, "node.unhealthy")
        assert first.reason == "GPU 2: 1 uncorrected ECC errors"
        with pytest.raises(grpc.RpcError) as err:
            nodes.Uncordon(nodes_pb2.NodeControlRequest(node_id=node_id))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "reports it healthy" in err.value.details()
        agent.send(heartbeat=agent_pb2.Heartbeat(health=fatal))  # same verdict: no new event
        agent.send(heartbeat=agent_pb2.Heartbeat(health=healthy()))
        # The healthy beat is recorded before the stream reads on; wait for it via a marker.
        agent.send(xid=common_pb2.XidEvent(gpu_index=0, xid=13))
        wait_for_event(fast, node_id, "node.xid", after=first.id)
        node = nodes.Uncordon(nodes_pb2.NodeControlRequest(node_id=node_id, reason="repaired"))
        assert node.state == common_pb2.NODE_STATE_READY
    log = nodes_pb2_grpc.EventServiceStub(fast.channel()).List(
        nodes_pb2.ListEventsRequest(node_id=node_id)
    )
    assert [e.kind for e in log.events].count("node.unhealthy") == 1


def test_a_heartbeat_carried_by_an_ack_is_a_heartbeat(fast: SchedulerThread, nodes: Any) -> None:
    """A recovery's one message per node: the ack carries what the heartbeat after the
    command would say, and the scheduler acts on it as on a heartbeat."""
    node_id = unique("ackbeat")
    fatal = common_pb2.NodeHealth(
        verdict=common_pb2.HEALTH_VERDICT_FATAL, reasons=["GPU 1: fell off the bus"]
    )
    with fast.agent_stream(node_id) as agent:
        beat = agent_pb2.Heartbeat(health=fatal)
        agent.send(ack=agent_pb2.CommandAck(command_id=12345, ok=True, heartbeat=beat))
        event = wait_for_event(fast, node_id, "node.unhealthy")
        assert event.reason == "GPU 1: fell off the bus"
        node = nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id))
        assert node.state == common_pb2.NODE_STATE_UNHEALTHY


def test_a_closed_stream_is_lost_and_a_reconnect_is_ready_again(
    fast: SchedulerThread, nodes: Any
) -> None:
    node_id = unique("lost")
    with fast.agent_stream(node_id):
        pass
    lost = wait_for_event(fast, node_id, "node.lost")
    assert lost.reason == "agent stream closed"
    with fast.agent_stream(node_id) as agent:
        assert agent.registered.state == common_pb2.NODE_STATE_READY
        node = nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id))
        assert (node.state, node.connected) == (common_pb2.NODE_STATE_READY, True)
    kinds = [
        e.kind
        for e in nodes_pb2_grpc.EventServiceStub(fast.channel())
        .List(nodes_pb2.ListEventsRequest(node_id=node_id))
        .events
    ]
    assert kinds[:4] == ["node.registered", "node.lost", "node.reconnected", "node.recovered"]


def test_an_old_stream_that_ends_after_its_agent_registered_again_loses_no_node(
    stores: StoreUrls, tmp_path: Path
) -> None:
    """A healed partition delivers an agent's old connection's end together with its new
    stream's Register, often after it, and the new stream may be at another scheduler
    process. The old stream's end is judged against the registration it made: the node,
    registered again since, stays READY and connected, and no node.lost is recorded."""
    old_home = SchedulerThread(scheduler_settings(stores, tmp_path / "old"))
    new_home = SchedulerThread(scheduler_settings(stores, tmp_path / "new"))
    try:
        node_id = unique("moved")
        old = old_home.open_stream(node_id)
        with new_home.agent_stream(node_id) as new:
            assert new.registered.state == common_pb2.NODE_STATE_READY
            old.close()  # its end comes after the new stream's registration
            agents = old_home.scheduler.agents
            wait_until(lambda: not agents.gateway.connected(node_id), "the old stream's end")
            old_home._call(agents.drain())  # its end judged: the loss it would record
            nodes = nodes_pb2_grpc.NodeServiceStub(new_home.channel())
            node = nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id))
            assert (node.state, node.connected) == (common_pb2.NODE_STATE_READY, True)
            events = nodes_pb2_grpc.EventServiceStub(new_home.channel()).List(
                nodes_pb2.ListEventsRequest(node_id=node_id)
            )
            kinds = [e.kind for e in events.events]
            assert kinds == ["node.registered", "node.reconnected"], kinds
    finally:
        new_home.stop()
        old_home.stop()


def fell_silent_and_was_lost(scheduler: SchedulerThread) -> tuple[Any, float]:
    """An agent that sends one heartbeat on a stream of `scheduler` and then nothing is
    declared lost at its liveness deadline, and its stream is ended. Returns the
    node.lost event and when the heartbeat was about to be sent."""
    node_id = unique("hung")
    with scheduler.agent_stream(node_id) as agent:
        sending = time.time()
        agent.send(heartbeat=agent_pb2.Heartbeat(health=healthy()))
        lost = wait_for_event(scheduler, node_id, "node.lost")
        assert "liveness deadline" in lost.reason
        with pytest.raises(StopIteration):
            agent.next_command()  # the scheduler ended the stale stream
    return lost, sending


def silent_since(lost: Any, silent_for: float, after: float = 0.0, before: float = 0.0) -> None:
    """The node.lost event says when the agent was last heard from (after `after`, before
    `before` where given), at least `silent_for` before the loss was recorded: what a
    recovery's goodput account counts as detection, not zero."""
    heard = float(lost.attributes[LAST_SEEN_AT])
    assert heard >= after, (heard, after)
    assert not before or heard <= before, (heard, before)
    assert lost.time.ToNanoseconds() / 1e9 - heard >= silent_for, (lost, heard)


def test_a_silent_agent_is_lost_at_its_deadline_and_its_stream_is_closed(
    fast: SchedulerThread, nodes: Any
) -> None:
    # One heartbeat and then nothing, like a SIGSTOPped agent whose socket stays open.
    fell_silent_and_was_lost(fast)


SILENT_HOST = """
import sys
import threading

import grpc
from pitstop.v1 import agent_pb2, agent_pb2_grpc, common_pb2

node_id, address = sys.argv[1:3]
register = agent_pb2.AgentMessage(
    seq=1,
    register=agent_pb2.Register(
        node_id=node_id,
        inventory=common_pb2.Inventory(gpus=[common_pb2.GpuInfo(index=0, uuid="GPU-" + node_id)]),
    ),
)
def requests():
    yield register
    threading.Event().wait()  # then nothing, ever

channel = grpc.insecure_channel(address)
replies = agent_pb2_grpc.AgentServiceStub(channel).Connect(requests())
print(next(replies).WhichOneof("body"), flush=True)
for reply in replies:
    pass
"""


@pytest.fixture(scope="module")
def pinging(
    stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SchedulerThread]:
    """A scheduler whose liveness deadline is minutes away: only the stream's keepalive
    pings can find a node gone silent in time."""
    settings = scheduler_settings(
        stores,
        tmp_path_factory.mktemp("pinging"),
        database_url=stores.fresh_database(),
        leader_loops=True,
        heartbeat_interval_seconds=60.0,
        refresh_interval_seconds=120.0,  # the deadline: 300 s
        keepalive_seconds=0.5,
        keepalive_timeout_seconds=1.0,
        redis_prefix=stores.redis_prefix + "pinging:",
    )
    thread = SchedulerThread(settings)
    yield thread
    thread.stop()


def test_a_host_gone_silent_is_lost_by_its_streams_keepalive_long_before_any_deadline(
    pinging: SchedulerThread,
) -> None:
    """A frozen process (as a host that lost power or its network: no TCP reset) stops
    answering the HTTP/2 pings; the scheduler closes its connection and the node is LOST
    without waiting for a heartbeat deadline (here 300 s away, past the watch's 15 s)."""
    node_id = unique("silent")
    host = subprocess.Popen(
        [sys.executable, "-c", SILENT_HOST, node_id, pinging.address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        assert host.stdout.readline().strip() == "registered"
        registered = wait_for_event(pinging, node_id, "node.registered")
        stopped_at = time.time()
        host.send_signal(signal.SIGSTOP)
        lost = wait_for_event(pinging, node_id, "node.lost", after=registered.id)
        assert "liveness deadline" not in lost.reason  # the transport saw it, not the scan
        silent_since(lost, silent_for=1.0, before=stopped_at)  # a ping unanswered for 1 s
    finally:
        host.send_signal(signal.SIGCONT)
        host.kill()
        host.wait()


def test_the_process_holding_a_silent_stream_judges_it_without_a_leader(
    stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An agent hung in Python (its process answers the pings, its stream stays open) is
    found by the process that holds the stream: here one that never leads, beside no
    leader at all, so no liveness scan runs anywhere."""
    holding = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path_factory.mktemp("holding"),
            database_url=stores.fresh_database(),
            leader_loops=False,
            heartbeat_interval_seconds=BEAT,
            refresh_interval_seconds=BEAT,
            redis_prefix=stores.redis_prefix + "holding:",
        )
    )
    try:
        lost, sending = fell_silent_and_was_lost(holding)
        # Its heartbeat was the last it said; the deadline is 2.5 beats after it.
        silent_since(lost, silent_for=2 * BEAT, after=sending)
    finally:
        holding.stop()


def test_a_process_that_holds_no_agent_streams_refuses_an_agent_by_name(
    stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory
) -> None:
    deciding = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path_factory.mktemp("deciding"),
            agent_streams=False,
            redis_prefix=stores.redis_prefix + "deciding:",
        )
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            deciding.register_node(unique("refused"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "agent_streams: false" in err.value.details()
    finally:
        deciding.stop()


def test_a_deadline_whose_loss_failed_to_commit_is_claimed_again(
    fast: SchedulerThread, nodes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The liveness scan claims an expired deadline, then records the loss in PostgreSQL.
    When that transaction fails (here a table it writes is gone for a moment; in a CI run
    it was a deadlock), the claim goes back: a hung agent sends nothing more, so the
    next scan is the only chance to declare its node lost."""
    node_id = unique("unlucky")
    url = fast.settings.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as db, fast.agent_stream(node_id) as agent:
        db.execute("ALTER TABLE checkpoint_shards RENAME TO checkpoint_shards_away")
        try:
            agent.send(heartbeat=agent_pb2.Heartbeat(health=healthy()))
            deadline = time.monotonic() + 15
            while not any("liveness scan failed" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the scan never failed"
                time.sleep(0.05)
        finally:
            db.execute("ALTER TABLE checkpoint_shards_away RENAME TO checkpoint_shards")
        lost = wait_for_event(fast, node_id, "node.lost")
        assert "liveness deadline" in lost.reason


def test_an_unhealthy_node_returns_when_its_agent_restarts(
    fast: SchedulerThread, nodes: Any
) -> None:
    node_id = unique("repair")
    with fast.agent_stream(node_id) as agent:
        agent.send(xid=common_pb2.XidEvent(gpu_index=0, xid=48))
        wait_for_event(fast, node_id, "node.unhealthy")
    # Same agent process reconnecting: still unhealthy.
    with fast.agent_stream(node_id) as agent:
        assert agent.registered.state == common_pb2.NODE_STATE_UNHEALTHY
    # A restarted agent (new start time) after the repair: ready.
    stub = agent_pb2_grpc.AgentServiceStub(fast.channel())
    started = timestamp_pb2.Timestamp()
    started.GetCurrentTime()
    register = agent_pb2.AgentMessage(
        seq=1,
        register=agent_pb2.Register(
            node_id=node_id,
            inventory=common_pb2.Inventory(
                gpus=[common_pb2.GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}") for i in range(8)]
            ),
            agent_started_at=started,
        ),
    )
    reply = next(stub.Connect(iter([register]), timeout=10))
    assert reply.registered.state == common_pb2.NODE_STATE_READY


def test_a_second_agent_with_other_gpus_under_the_same_id_is_refused(fast: SchedulerThread) -> None:
    node_id = unique("dup")
    with fast.agent_stream(node_id, gpus=2):
        with pytest.raises(grpc.RpcError) as err:
            fast.register_node(node_id, gpus=4)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "different GPUs" in err.value.details()


def test_a_node_cannot_register_another_nodes_gpu(fast: SchedulerThread) -> None:
    owner, other = unique("own"), unique("spoof")
    with fast.agent_stream(owner, gpus=2):
        stub = agent_pb2_grpc.AgentServiceStub(fast.channel())
        register = agent_pb2.AgentMessage(
            seq=1,
            register=agent_pb2.Register(
                node_id=other,
                inventory=common_pb2.Inventory(
                    gpus=[common_pb2.GpuInfo(index=0, uuid=f"GPU-{owner}-1")]
                ),
            ),
        )
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Connect(iter([register]), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"belongs to node {owner}" in err.value.details()


@pytest.mark.parametrize(
    ("register", "field"),
    [
        (agent_pb2.Register(node_id="bad id!"), "register.node_id"),
        (
            agent_pb2.Register(
                node_id="twins",
                inventory=common_pb2.Inventory(
                    gpus=[common_pb2.GpuInfo(index=0, uuid="a"), common_pb2.GpuInfo(index=0)]
                ),
            ),
            "register.inventory.gpus",
        ),
        (agent_pb2.Register(node_id="ok", requested_role=9), "register.requested_role"),
    ],
)
def test_malformed_registrations_are_invalid_argument(
    fast: SchedulerThread, register: agent_pb2.Register, field: str
) -> None:
    stub = agent_pb2_grpc.AgentServiceStub(fast.channel())
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Connect(iter([agent_pb2.AgentMessage(seq=1, register=register)]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


def test_a_second_register_on_a_stream_is_refused(fast: SchedulerThread) -> None:
    node_id = unique("twice")
    with fast.agent_stream(node_id) as agent:
        agent.send(register=agent_pb2.Register(node_id=node_id))
        with pytest.raises(grpc.RpcError) as err:
            agent.next_command()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_step_summaries_land_in_the_jobs_redis_stream_under_the_streams_node(
    fast: SchedulerThread, stores: StoreUrls
) -> None:
    node_id = unique("steps")
    job_id = unique("j")
    summary = agent_pb2.StepSummary(
        job_id=job_id,
        generation=1,
        node_id="someone-else",  # the stream's node is what counts
        ranks=4,
        slowest_step=7,
        newest_step=7,
        windows=[agent_pb2.RankWindow(rank=r, window=0, steps=20, timed=20) for r in range(4)],
    )
    client = redis.Redis.from_url(stores.redis_url)
    key = f"{stores.redis_prefix}fast:steps:{job_id}"
    with fast.agent_stream(node_id) as agent:
        agent.send(step_summary=summary)
        # Written beside the stream's reader, batched with any other stream's of the job.
        entries = wait_until(lambda: client.xrange(key), "the summary in the job's stream", 15)
    client.close()
    assert len(entries) == 1
    (stored,) = agent_pb2.StepSummaries.FromString(entries[0][1][b"summaries"]).summaries
    summary.node_id = node_id
    assert stored == summary


def test_live_health_follows_every_change_and_a_changed_health_is_checked_again(
    scheduler: SchedulerThread, stores: StoreUrls
) -> None:
    """An unchanged health is stored as it was (not converted again); a changed one, or a
    standby that became ready, is stored anew, and a bad value in a changed health is
    refused though the health before it passed."""
    node_id = unique("live")
    client = redis.Redis.from_url(stores.redis_url)
    key = f"{stores.redis_prefix}live-health"

    def stored_after(**beat: Any) -> dict[str, Any]:
        agent.send(heartbeat=agent_pb2.Heartbeat(**beat))
        agent.send(xid=common_pb2.XidEvent(gpu_index=0, xid=13))  # a marker after the beat
        marker = wait_for_event(scheduler, node_id, "node.xid", after=seen[-1])
        seen.append(marker.id)
        return dict(json.loads(client.hget(key, node_id)))

    seen = [0]
    warm = healthy(2)
    warm.gpus[0].temperature_c = 80.0
    standby = agent_pb2.RunningRank(job_id="j-standby", standby=True, ready=True)
    try:
        # The run-wide scheduler judges no deadlines: this stream may beat slowly.
        with scheduler.agent_stream(node_id, gpus=2) as agent:
            first = stored_after(health=healthy(2))
            assert first["gpus"][0].get("temperature_c") is None
            assert first["standby_ready"] == []
            again = stored_after(health=healthy(2))
            assert again["received_at"] > first["received_at"]
            assert {k: v for k, v in again.items() if k != "received_at"} == {
                k: v for k, v in first.items() if k != "received_at"
            }
            assert stored_after(health=warm)["gpus"][0]["temperature_c"] == 80.0
            assert stored_after(health=warm, running_ranks=[standby])["standby_ready"] == [
                "j-standby"
            ]
            bad = healthy(2)
            bad.gpus[1].uuid = "GPU\x00"
            agent.send(heartbeat=agent_pb2.Heartbeat(health=bad))
            with pytest.raises(grpc.RpcError) as err:
                agent.next_command()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("heartbeat.health.gpus[1].uuid")
    finally:
        client.close()
