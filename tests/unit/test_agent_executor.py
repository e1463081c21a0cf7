"""CommandExecutor: a handler for every command kind, one ack per command, a re-sent
generation command carried out once, an unknown kind acked with an error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection

from pitstop.agent.config import AgentSettings
from pitstop.agent.executor import CommandExecutor
from pitstop.agent.gpu.sim import SimulatedBackend
from pitstop.agent.metrics import AgentMetrics
from pitstop.v1 import agent_pb2, common_pb2, rank_pb2

NODE = "node-a"


class FakeSupervisor:
    """Starts nothing; records the StartRanks it was given."""

    def __init__(self) -> None:
        self.starts: list[agent_pb2.StartRanks] = []

    async def start_ranks(
        self, command: agent_pb2.StartRanks, only: Collection[int] | None = None
    ) -> list[int]:
        self.starts.append(command)
        return [0]

    async def stop_ranks(self, command: agent_pb2.StopRanks) -> list[int]:
        return []

    def running(self) -> list[agent_pb2.RunningRank]:
        return []

    def renumber(self, job_id: str, rank_map: common_pb2.RankMap) -> dict[int, int]:
        return {}

    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]:
        return []

    async def start_standbys(self, command: agent_pb2.StartRanks) -> list[int]:
        return []

    def standby_pid(self, job_id: str, gpu_index: int) -> int | None:
        return None

    def standby_command(self, job_id: str) -> agent_pb2.StartRanks | None:
        return None

    def adopt(self, job_id: str, gpu_index: int, rank: int, generation: int) -> int | None:
        return None


class FakeChannel:
    async def send_command(self, job_id: str, rank: int, command: rank_pb2.RankCommand) -> bool:
        return True

    def set_generation(
        self,
        job_id: str,
        generation: int,
        restore_step: int,
        windows: agent_pb2.StepWindows | None = None,
    ) -> None:
        pass

    async def assign_standby(
        self, job_id: str, assignment: rank_pb2.StandbyAssignment, pid: int | None = None
    ) -> bool:
        return False

    async def wait_standby_process(
        self, job_id: str, pid: int, timeout: float, alive: Callable[[], bool]
    ) -> bool:
        return False


def executor(
    supervisor: FakeSupervisor,
    heartbeat: Callable[[], Awaitable[agent_pb2.Heartbeat]] | None = None,
) -> tuple[CommandExecutor, list[agent_pb2.CommandAck]]:
    acks: list[agent_pb2.CommandAck] = []

    def send(*, ack: agent_pb2.CommandAck) -> None:
        acks.append(ack)

    commands = CommandExecutor(
        AgentSettings(node_id=NODE),
        SimulatedBackend(NODE, 1),
        supervisor,
        FakeChannel(),
        AgentMetrics(NODE),
        send=send,
        beat_soon=lambda: None,
        heartbeat=heartbeat,
    )
    return commands, acks


async def carry_out(commands: CommandExecutor, *messages: agent_pb2.SchedulerMessage) -> None:
    for message in messages:
        commands.submit(message)
    await asyncio.wait_for(asyncio.gather(*commands.in_flight), 5.0)


def test_every_command_kind_of_the_protocol_has_a_handler() -> None:
    body = agent_pb2.SchedulerMessage.DESCRIPTOR.oneofs_by_name["body"]
    commands, _ = executor(FakeSupervisor())
    assert commands.kinds == {field.name for field in body.fields} - {"registered"}


async def test_a_resent_start_is_acked_but_carried_out_once() -> None:
    supervisor = FakeSupervisor()
    commands, acks = executor(supervisor)

    def start(command_id: int, generation: int) -> agent_pb2.SchedulerMessage:
        body = agent_pb2.StartRanks(job_id="job-1", generation=generation)
        return agent_pb2.SchedulerMessage(command_id=command_id, start_ranks=body)

    await carry_out(commands, start(1, 2), start(2, 2), start(3, 1))

    assert [(a.command_id, a.ok) for a in acks] == [(1, True), (2, True), (3, True)]
    assert [s.generation for s in supervisor.starts] == [2]


async def test_a_command_without_a_handler_is_acked_with_an_error() -> None:
    commands, acks = executor(FakeSupervisor())

    await carry_out(commands, agent_pb2.SchedulerMessage(command_id=7))

    [ack] = acks
    assert (ack.command_id, ack.ok) == (7, False)
    assert ack.error == f"command 'empty' is unknown to the agent on node {NODE}; upgrade the agent"


async def test_the_ack_of_a_generation_command_carries_the_heartbeat_after_it() -> None:
    """One message per node per recovery: the ack says what the next heartbeat would."""
    looks: list[int] = []

    async def heartbeat() -> agent_pb2.Heartbeat:
        looks.append(1)
        running = agent_pb2.RunningRank(job_id="job-1", generation=len(looks) + 1, rank=0)
        return agent_pb2.Heartbeat(running_ranks=[running])

    commands, acks = executor(FakeSupervisor(), heartbeat)
    reconfigure = agent_pb2.Reconfigure(job_id="job-1", generation=2)
    pause = agent_pb2.PauseJob(job_id="job-1", generation=2)
    await carry_out(
        commands,
        agent_pb2.SchedulerMessage(command_id=1, reconfigure=reconfigure),
        agent_pb2.SchedulerMessage(command_id=2, pause=pause),
    )
    by_id = {a.command_id: a for a in acks}
    assert by_id[1].ok
    assert [r.generation for r in by_id[1].heartbeat.running_ranks] == [2]
    assert not by_id[2].HasField("heartbeat")  # a pause changes no generation
    assert len(looks) == 1


async def test_a_node_that_keeps_its_ranks_is_reconfigured_with_the_ranks_placed_there() -> None:
    """reconfigure_kept carries no ranks: the agent fills in its own, as last placed,
    and its running ranks are told the new generation with them."""

    class Running(FakeSupervisor):
        def running(self) -> list[agent_pb2.RunningRank]:
            return [agent_pb2.RunningRank(job_id="job-1", generation=1, rank=5)]

    class Recording(FakeChannel):
        def __init__(self) -> None:
            self.told: list[rank_pb2.RankCommand] = []

        async def send_command(self, job_id: str, rank: int, command: rank_pb2.RankCommand) -> bool:
            self.told.append(command)
            return True

    channel = Recording()
    acks: list[agent_pb2.CommandAck] = []
    commands = CommandExecutor(
        AgentSettings(node_id=NODE),
        SimulatedBackend(NODE, 1),
        Running(),
        channel,
        AgentMetrics(NODE),
        send=lambda *, ack: acks.append(ack),
        beat_soon=lambda: None,
    )
    mine = common_pb2.RankAssignment(rank=5, node_id=NODE, gpu_index=1, dp=1, pp=0, tp=1)
    start = agent_pb2.StartRanks(
        job_id="job-1",
        generation=1,
        rank_map=common_pb2.RankMap(generation=1, ranks=[mine], node_local=True),
    )
    kept = agent_pb2.Reconfigure(
        job_id="job-1",
        generation=2,
        rank_map=common_pb2.RankMap(generation=2, world_size=8, digest="d2"),
    )
    await carry_out(
        commands,
        agent_pb2.SchedulerMessage(command_id=1, start_ranks=start),
        agent_pb2.SchedulerMessage(command_id=2, reconfigure_kept=kept),
    )
    assert [(a.command_id, a.ok) for a in acks] == [(1, True), (2, True)]
    [told] = channel.told
    full = told.reconfigure
    assert (full.generation, full.rank_map.digest) == (2, "d2")
    assert list(full.rank_map.ranks) == [mine]
    assert full.rank_map.node_local


async def test_a_node_with_nothing_placed_refuses_to_keep_and_asks_for_the_full_command() -> None:
    commands, acks = executor(FakeSupervisor())
    kept = agent_pb2.Reconfigure(job_id="job-9", generation=3)
    await carry_out(commands, agent_pb2.SchedulerMessage(command_id=4, reconfigure_kept=kept))
    [ack] = acks
    assert not ack.ok
    assert "send it the full Reconfigure" in ack.error
