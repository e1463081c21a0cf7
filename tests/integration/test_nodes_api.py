"""NodeService and EventService over real gRPC; nodes come from real agent streams."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from kit.schedulers import SchedulerThread
from kit.stores import unique
from pitstop.v1 import agent_pb2, common_pb2, nodes_pb2, nodes_pb2_grpc


@pytest.fixture
def nodes(scheduler: SchedulerThread) -> Any:
    return nodes_pb2_grpc.NodeServiceStub(scheduler.channel())


@pytest.fixture
def events(scheduler: SchedulerThread) -> Any:
    return nodes_pb2_grpc.EventServiceStub(scheduler.channel())


def test_a_registered_node_is_listed_with_its_inventory(
    scheduler: SchedulerThread, nodes: Any
) -> None:
    node_id = unique("node")
    scheduler.register_node(node_id, gpus=4, zone="z9", block="b9", rack="r9")
    node = nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id))
    assert node.state == common_pb2.NODE_STATE_READY
    assert node.role == common_pb2.NODE_ROLE_WORKER
    assert [g.index for g in node.inventory.gpus] == [0, 1, 2, 3]
    assert (node.labels.zone, node.labels.block, node.labels.rack) == ("z9", "b9", "r9")
    assert node.connected
    listed = nodes.List(nodes_pb2.ListNodesRequest(states=[common_pb2.NODE_STATE_READY]))
    assert node_id in [n.id for n in listed.nodes]


def test_cordon_uncordon_drain_each_record_one_event(
    scheduler: SchedulerThread, nodes: Any, events: Any
) -> None:
    node_id = unique("node")
    scheduler.register_node(node_id)
    cordoned = nodes.Cordon(nodes_pb2.NodeControlRequest(node_id=node_id, reason="bad fan"))
    assert cordoned.state == common_pb2.NODE_STATE_CORDONED
    assert cordoned.reason == "bad fan"
    again = nodes.Cordon(nodes_pb2.NodeControlRequest(node_id=node_id))
    assert again.state == common_pb2.NODE_STATE_CORDONED  # idempotent, no new event
    drained = nodes.Drain(nodes_pb2.NodeControlRequest(node_id=node_id, reason="swap psu"))
    assert drained.state == common_pb2.NODE_STATE_DRAINING
    ready = nodes.Uncordon(nodes_pb2.NodeControlRequest(node_id=node_id))
    assert ready.state == common_pb2.NODE_STATE_READY

    log = events.List(nodes_pb2.ListEventsRequest(node_id=node_id)).events
    assert [e.kind for e in log] == [
        "node.registered",
        "node.cordoned",
        "node.draining",
        "node.uncordoned",
    ]
    assert [(e.from_state, e.to_state) for e in log[1:]] == [
        ("ready", "cordoned"),
        ("cordoned", "draining"),
        ("draining", "ready"),
    ]
    assert log[1].reason == "bad fan"


def test_set_role_makes_a_spare_and_rejects_unspecified(
    scheduler: SchedulerThread, nodes: Any
) -> None:
    node_id = unique("node")
    scheduler.register_node(node_id)
    spare = nodes.SetRole(
        nodes_pb2.SetNodeRoleRequest(node_id=node_id, role=common_pb2.NODE_ROLE_SPARE)
    )
    assert spare.role == common_pb2.NODE_ROLE_SPARE
    listed = nodes.List(nodes_pb2.ListNodesRequest(roles=[common_pb2.NODE_ROLE_SPARE]))
    assert node_id in [n.id for n in listed.nodes]
    with pytest.raises(grpc.RpcError) as err:
        nodes.SetRole(nodes_pb2.SetNodeRoleRequest(node_id=node_id))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in err.value.details()


def test_a_reregistration_keeps_the_schedulers_role_and_state(
    scheduler: SchedulerThread, nodes: Any
) -> None:
    node_id = unique("node")
    scheduler.register_node(node_id)
    nodes.Cordon(nodes_pb2.NodeControlRequest(node_id=node_id, reason="kept"))
    scheduler.register_node(node_id, role="spare")
    node = nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id))
    assert node.state == common_pb2.NODE_STATE_CORDONED
    assert node.role == common_pb2.NODE_ROLE_WORKER


def test_unknown_node_is_not_found(nodes: Any) -> None:
    for call in (nodes.Get, nodes.Cordon):
        request = (
            nodes_pb2.GetNodeRequest(node_id="no-such-node")
            if call is nodes.Get
            else nodes_pb2.NodeControlRequest(node_id="no-such-node")
        )
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-node" in err.value.details()


def test_inject_fault_reaches_the_connected_agent(scheduler: SchedulerThread, nodes: Any) -> None:
    node_id = unique("node")
    with scheduler.agent_stream(node_id, gpus=2) as agent:
        assert agent.registered.node_id == node_id
        reply = nodes.InjectFault(
            nodes_pb2.InjectFaultRequest(
                node_id=node_id, fault=common_pb2.Fault(gpu_index=1, xid=79)
            )
        )
        command = agent.next_command()
        assert command.command_id == reply.command_id
        assert command.inject_fault.xid == 79
        assert command.inject_fault.gpu_index == 1
        with pytest.raises(grpc.RpcError) as err:
            nodes.InjectFault(
                nodes_pb2.InjectFaultRequest(
                    node_id=node_id, fault=common_pb2.Fault(gpu_index=5, xid=79)
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "fault.gpu_index" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        nodes.InjectFault(
            nodes_pb2.InjectFaultRequest(node_id=node_id, fault=common_pb2.Fault(xid=79))
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_agent_stream_that_skips_register_or_sequence_is_rejected(
    scheduler: SchedulerThread,
) -> None:
    from pitstop.v1 import agent_pb2_grpc

    stub = agent_pb2_grpc.AgentServiceStub(scheduler.channel())
    heartbeat_first = [agent_pb2.AgentMessage(seq=1, heartbeat=agent_pb2.Heartbeat())]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Connect(iter(heartbeat_first), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Register" in err.value.details()

    node_id = unique("node")
    with scheduler.agent_stream(node_id) as agent:
        agent.send_raw(agent_pb2.AgentMessage(seq=7, heartbeat=agent_pb2.Heartbeat()))
        with pytest.raises(grpc.RpcError) as err:
            agent.next_command()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "seq" in err.value.details()


def test_watch_events_replays_then_sees_new_events_live(
    scheduler: SchedulerThread, nodes: Any, events: Any
) -> None:
    node_id = unique("node")
    scheduler.register_node(node_id)
    stream = events.Watch(nodes_pb2.WatchEventsRequest(node_id=node_id), timeout=30)
    assert next(stream).kind == "node.registered"
    # The stream is established (it delivered the backlog): this event must arrive live.
    nodes.Cordon(nodes_pb2.NodeControlRequest(node_id=node_id, reason="live"))
    live = next(stream)
    assert (live.kind, live.reason) == ("node.cordoned", "live")
    stream.cancel()


def test_list_events_negative_after_gives_the_newest(
    scheduler: SchedulerThread, nodes: Any, events: Any
) -> None:
    node_id = unique("node")
    scheduler.register_node(node_id)
    nodes.Cordon(nodes_pb2.NodeControlRequest(node_id=node_id))
    newest = events.List(nodes_pb2.ListEventsRequest(node_id=node_id, after_event_id=-1, limit=1))
    assert [e.kind for e in newest.events] == ["node.cordoned"]


def degraded_beat(*reasons: str) -> agent_pb2.Heartbeat:
    verdict = common_pb2.HEALTH_VERDICT_DEGRADED if reasons else common_pb2.HEALTH_VERDICT_HEALTHY
    host = common_pb2.HostHealth(verdict=verdict, reasons=reasons)
    return agent_pb2.Heartbeat(
        health=common_pb2.NodeHealth(verdict=verdict, reasons=reasons, host=host)
    )


def test_a_degraded_host_is_news_when_it_starts_says_something_new_and_ends(
    scheduler: SchedulerThread, nodes: Any, events: Any
) -> None:
    """A disk filling says a new number every heartbeat: one event when it starts, none
    as it fills, one for a new problem, one when it is over; the node stays READY."""
    node_id = unique("node")
    disk = "disk /data/ckpt: {} GiB free of 2048.0 GiB"
    with scheduler.agent_stream(node_id, gpus=1) as agent:
        for beat in (
            degraded_beat(disk.format("9.5")),
            degraded_beat(disk.format("7.1")),
            degraded_beat(disk.format("3.0")),
            degraded_beat(disk.format("3.0"), "disk /data/ckpt is read-only"),
            degraded_beat(),
        ):
            agent.send(heartbeat=beat)

        def said() -> list[tuple[str, str]]:
            listed = events.List(nodes_pb2.ListEventsRequest(node_id=node_id, limit=100))
            return [(e.kind, e.reason) for e in listed.events if "degraded" in e.kind]

        deadline = time.monotonic() + 30
        while not any(kind == "node.degraded_cleared" for kind, _ in said()):
            assert time.monotonic() < deadline, said()
            time.sleep(0.05)
        assert said() == [
            ("node.degraded", disk.format("9.5")),
            ("node.degraded", f"{disk.format('3.0')}; disk /data/ckpt is read-only"),
            ("node.degraded_cleared", "nothing degrades the node any more"),
        ]
        node = nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id))
        assert node.state == common_pb2.NODE_STATE_READY
