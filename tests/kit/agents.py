"""Agents for tests: real `pitstop-agent` processes on simulated GPUs (`run_agents`),
and a whole agent in the test's own event loop (`running_agent`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.stores import unique
from pitstop.agent.config import AgentSettings
from pitstop.agent.gpu import GpuBackend, open_backend
from pitstop.agent.main import NodeAgent
from pitstop.client.launch import agent_command, binary, clean_env

AGENT_BINARY = binary("pitstop-agent")


@dataclass(frozen=True)
class AgentSpec:
    """One `pitstop-agent` to run: node id, GPUs (simulated), labels, requested role."""

    node_id: str
    gpus: int = 8
    rack: str = "r1"
    role: str = "worker"


@contextlib.contextmanager
def run_agents(
    address: str, root: Path, specs: list[AgentSpec]
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Real agent processes on simulated GPUs; SIGTERM and a clean exit at the end."""
    env = clean_env()
    procs = {
        spec.node_id: subprocess.Popen(
            agent_command(
                fork_server="off",  # fake ranks or none: no zygote to import torch
                node_id=spec.node_id,
                scheduler=address,
                gpus=f"sim:{spec.gpus}",
                zone="z1",
                block="b1",
                rack=spec.rack,
                role=spec.role,
                state_dir=root / spec.node_id,
                metrics_port=0,
                log_level="WARNING",
            ),
            stdout=subprocess.DEVNULL,
            env=env,
        )
        for spec in specs
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(30)


@contextlib.asynccontextmanager
async def running_agent(
    settings: AgentSettings, backend: GpuBackend | None = None, timeout: float = 20.0
) -> AsyncIterator[NodeAgent]:
    """A whole agent in this event loop (on `backend`, else the one its settings
    name), stopped (ranks and all) on exit; its run must end within `timeout` s."""
    backend = backend or open_backend(settings.gpus, settings.node_id)
    agent = NodeAgent(settings, backend)
    await agent.start()
    stop = asyncio.Event()
    run = asyncio.create_task(agent.run(stop))
    try:
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(run, timeout)
        await agent.close(grace_seconds=2.0)


def agent_settings(address: str, state_dir: Path, **overrides: Any) -> AgentSettings:
    """An agent's settings for a test: a node of its own on 8 simulated GPUs, labelled,
    talking to the scheduler at `address`, its state in `state_dir`."""
    values: dict[str, Any] = {
        "node_id": unique("agent"),
        "scheduler": address,
        "gpus": "sim:8",
        "state_dir": state_dir,
        "metrics_port": 0,
        "zone": "z1",
        "block": "b1",
        "rack": "r7",
        "nvlink_domain": "nvl-1",
        "fork_server": "off",  # fake ranks: no zygote to import torch
        **overrides,
    }
    return AgentSettings(**values)
