"""The GPU's health as the scheduler hears it from a real `pitstop-agent --gpus nvml`: the
agent reads NVML on this machine, judges each GPU and sends the readings in its
heartbeats; the scheduler's API then shows every GPU torch sees, none lost, none fatal,
and readings a working GPU gives."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from kit.gpu import cuda, machine, needs_gpu, report
from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from pitstop.client import PitstopClient
from pitstop.client.errors import PitstopError
from pitstop.client.launch import agent_command, clean_env
from pitstop.v1 import common_pb2, nodes_pb2

pytestmark = [pytest.mark.gpu, needs_gpu, pytest.mark.timeout(180)]

WAIT = 60.0  # for the agent to start, open NVML, register and send its first heartbeat
FATAL = common_pb2.HEALTH_VERDICT_FATAL


@pytest.fixture
def nvml_agent(stores: StoreUrls, tmp_path: Path) -> Iterator[tuple[SchedulerThread, str, Path]]:
    """A scheduler serving the API, and a real agent on this machine's GPUs (NVML)."""
    scheduler = SchedulerThread(
        scheduler_settings(stores, tmp_path / "scheduler", heartbeat_interval_seconds=0.5)
    )
    node_id = unique("gpu-node")
    log = tmp_path / "agent.log"
    env = clean_env()
    command = agent_command(
        fork_server="off",  # fake ranks or none: no zygote to import torch
        node_id=node_id,
        scheduler=scheduler.address,
        gpus="nvml",
        zone="z1",
        block="b1",
        rack="r1",
        state_dir=tmp_path / "agent",
        metrics_port=0,
        log_level="INFO",
    )
    with log.open("wb") as out:
        agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield scheduler, node_id, log
    finally:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        scheduler.stop()


def first_health(address: str, node_id: str, log: Path) -> nodes_pb2.Node:
    """The node once the scheduler holds its inventory and a heartbeat's readings."""
    deadline = time.monotonic() + WAIT
    with PitstopClient(address, timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                node = client.get_node(node_id)
            except PitstopError:  # not registered yet
                node = None
            if node is not None and node.inventory.gpus and node.health.gpus:
                return node
            time.sleep(0.2)  # a poll of the scheduler's record, bounded by the deadline
    raise AssertionError(f"no health of {node_id} within {WAIT:.0f} s; agent log:\n" + tail(log))


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def test_the_agent_reports_every_gpu_healthy_from_nvml(
    nvml_agent: tuple[SchedulerThread, str, Path],
) -> None:
    torch = cuda()
    scheduler, node_id, log = nvml_agent
    node = first_health(scheduler.address, node_id, log)
    inventory, health = node.inventory, node.health
    readings = {g.index: g for g in health.gpus}
    report(
        "nvml_health",
        {
            **machine(),
            "backend": inventory.gpu_backend,
            "nvml_driver": inventory.driver_version,
            "node_verdict": common_pb2.HealthVerdict.Name(health.verdict),
            "node_reasons": list(health.reasons),
            "gpus_read": [
                {
                    "index": gpu.index,
                    "name": gpu.name,
                    "uuid": gpu.uuid,
                    "memory_bytes": gpu.memory_bytes,
                    "pci_bus_id": gpu.pci_bus_id,
                    **MessageToDict(readings[gpu.index], preserving_proto_field_name=True),
                }
                for gpu in inventory.gpus
            ],
        },
    )
    context = f"node {MessageToDict(node)}\nagent log:\n{tail(log)}"
    assert inventory.gpu_backend == "nvml", context
    assert inventory.driver_version, context
    # What NVML lists is what CUDA computes on (unless CUDA_VISIBLE_DEVICES hides some).
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert len(inventory.gpus) == torch.cuda.device_count(), context
        cuda_names = sorted(torch.cuda.get_device_name(i) for i in range(len(inventory.gpus)))
        assert sorted(gpu.name for gpu in inventory.gpus) == cuda_names, context
        cuda_memory = sorted(
            torch.cuda.get_device_properties(i).total_memory for i in range(len(inventory.gpus))
        )
        for nvml_bytes, cuda_bytes in zip(
            sorted(gpu.memory_bytes for gpu in inventory.gpus), cuda_memory, strict=True
        ):
            # NVML counts the whole framebuffer, CUDA what it can hand out: within a tenth.
            assert 0.9 < cuda_bytes / nvml_bytes <= 1.0, (nvml_bytes, cuda_bytes, context)
    assert [g.index for g in health.gpus] == [g.index for g in inventory.gpus], context
    assert health.verdict != FATAL, context
    for gpu, reading in zip(inventory.gpus, health.gpus, strict=True):
        assert gpu.uuid.startswith(("GPU-", "MIG-")), context
        assert gpu.pci_bus_id, context
        assert reading.uuid == gpu.uuid, context
        assert not reading.lost, context
        assert reading.verdict != FATAL, context
        unsupported = set(reading.unsupported)
        if "temperature_c" not in unsupported:
            assert 5.0 < reading.temperature_c < 100.0, context
        if "power_w" not in unsupported:
            assert 0.0 < reading.power_w < 2000.0, context
        if "pcie_link_gen" not in unsupported:
            assert reading.pcie_link_gen >= 1, context
    fatal = [x for x in node.xid_history if x.verdict == FATAL]
    assert not fatal, context
