"""The agent's host gauges (pitstop_host_*): the simulated host's readings, faults
injected, as Prometheus exposes them; series of unsupported sources and of links,
devices and paths that vanished are removed."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pitstop.agent.host.metrics import HostMetrics
from pitstop.agent.host.sim import PCIE_GEN5_GTS, RATE_GBPS, SimulatedHost
from pitstop.agent.metrics import AgentMetrics
from pitstop.health.host import assess_host
from pitstop.v1 import common_pb2

NODE = "n1"
GPU = {"node": NODE, "device": "0000:17:00.0", "role": "gpu"}
NIC = {"node": NODE, "device": "0000:18:00.0", "role": "nic"}


def port(name: str) -> dict[str, str]:
    return {"node": NODE, "link": name, "kind": "infiniband"}


class Exposed:
    """A HostMetrics in a fresh registry, and the values it exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = HostMetrics(self.registry, NODE)

    def __call__(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(f"pitstop_host_{name}", {"node": NODE, **labels})

    def names(self) -> set[str]:
        """The series names that have at least one sample."""
        return {s.name for family in self.registry.collect() for s in family.samples}


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """The daemons' path the simulated host reads (its filesystem is tmp_path's)."""
    return tmp_path / "checkpoints"


@pytest.fixture
def host(disk: Path) -> SimulatedHost:
    return SimulatedHost(disk_paths=[disk])


@pytest.fixture
def exposed() -> Exposed:
    return Exposed()


def observe(
    exposed: Exposed, reading: common_pb2.HostHealth, seen_up: dict[str, float] | None = None
) -> None:
    """Assess `reading` as the agent does (no earlier readings) and set the gauges."""
    exposed.metrics.observe(assess_host(reading, now=0.0, seen_up=seen_up))


def test_a_healthy_host_exposes_every_signal(
    host: SimulatedHost, exposed: Exposed, disk: Path
) -> None:
    reading = host.read()
    observe(exposed, reading)
    (read,) = reading.disks
    assert read.total_bytes > 0
    reg = exposed.registry
    assert exposed("verdict") == 0
    for name in ("mlx5_0/1", "mlx5_1/1"):
        assert reg.get_sample_value("pitstop_host_link_up", port(name)) == 1
        assert reg.get_sample_value("pitstop_host_link_rate_gbps", port(name)) == RATE_GBPS
        assert reg.get_sample_value("pitstop_host_link_downs", port(name)) == 0
        assert reg.get_sample_value("pitstop_host_link_errors", port(name)) == 0
    assert exposed("memory_pressure_full_avg10") == 0
    assert exposed("memory_edac_corrected") == 0
    assert exposed("memory_edac_uncorrected") == 0
    assert exposed("oom_kills") == 0
    path = str(disk)
    assert exposed("disk_free_bytes", path=path) == read.free_bytes
    assert exposed("disk_total_bytes", path=path) == read.total_bytes
    assert exposed("disk_free_inodes", path=path) == read.free_inodes
    assert exposed("disk_total_inodes", path=path) == read.total_inodes
    assert exposed("disk_read_only", path=path) == 0
    for device in (GPU, NIC):
        for aer_type in ("correctable", "nonfatal", "fatal"):
            labels = {**device, "type": aer_type}
            assert reg.get_sample_value("pitstop_host_pcie_aer_errors", labels) == 0
        assert reg.get_sample_value("pitstop_host_pcie_link_width", device) == 16
        assert reg.get_sample_value("pitstop_host_pcie_link_width_max", device) == 16
        assert reg.get_sample_value("pitstop_host_pcie_link_speed_gts", device) == PCIE_GEN5_GTS
        assert reg.get_sample_value("pitstop_host_pcie_link_speed_gts_max", device) == PCIE_GEN5_GTS


def test_link_faults_show_in_the_link_gauges(host: SimulatedHost, exposed: Exposed) -> None:
    seen_up = {"mlx5_0/1": RATE_GBPS, "mlx5_1/1": RATE_GBPS}
    host.link_down("mlx5_0/1")
    host.link_flap("mlx5_1/1", 3)
    host.link_errors("mlx5_1/1", 250)
    observe(exposed, host.read(), seen_up=seen_up)
    reg = exposed.registry
    assert reg.get_sample_value("pitstop_host_link_up", port("mlx5_0/1")) == 0
    assert reg.get_sample_value("pitstop_host_link_rate_gbps", port("mlx5_0/1")) == 0
    assert reg.get_sample_value("pitstop_host_link_downs", port("mlx5_0/1")) == 1
    assert reg.get_sample_value("pitstop_host_link_up", port("mlx5_1/1")) == 1
    assert reg.get_sample_value("pitstop_host_link_downs", port("mlx5_1/1")) == 3
    assert reg.get_sample_value("pitstop_host_link_errors", port("mlx5_1/1")) == 250
    assert exposed("verdict") == 3  # replace

    host.link_up("mlx5_0/1")
    host.link_degraded("mlx5_0/1", 200.0)
    observe(exposed, host.read(), seen_up=seen_up)
    assert reg.get_sample_value("pitstop_host_link_up", port("mlx5_0/1")) == 1
    assert reg.get_sample_value("pitstop_host_link_rate_gbps", port("mlx5_0/1")) == 200
    assert exposed("verdict") == 1  # slower, judged alone: reported


def test_memory_disk_and_pcie_faults_show(
    host: SimulatedHost, exposed: Exposed, disk: Path
) -> None:
    host.oom_kill(4321, "python")
    host.disk_full()
    host.pcie_aer(2, severity="fatal", role="gpu")
    host.pcie_aer(7, severity="correctable", role="nic")
    host.pcie_degraded("nic")
    reading = host.read()
    reading.memory.pressure_full_avg10 = 35.5
    reading.memory.edac_corrected = 12
    reading.memory.edac_uncorrected = 1
    reading.disks[0].read_only = True
    observe(exposed, reading)
    reg = exposed.registry
    assert exposed("oom_kills") == 1
    assert exposed("memory_pressure_full_avg10") == 35.5
    assert exposed("memory_edac_corrected") == 12
    assert exposed("memory_edac_uncorrected") == 1
    assert exposed("disk_free_bytes", path=str(disk)) == 0
    assert exposed("disk_total_bytes", path=str(disk)) == reading.disks[0].total_bytes > 0
    assert exposed("disk_read_only", path=str(disk)) == 1
    assert reg.get_sample_value("pitstop_host_pcie_aer_errors", {**GPU, "type": "fatal"}) == 2
    nic_correctable = {**NIC, "type": "correctable"}
    assert reg.get_sample_value("pitstop_host_pcie_aer_errors", nic_correctable) == 7
    assert reg.get_sample_value("pitstop_host_pcie_link_width", NIC) == 8
    assert reg.get_sample_value("pitstop_host_pcie_link_width_max", NIC) == 16
    assert reg.get_sample_value("pitstop_host_pcie_link_width", GPU) == 16


def test_the_host_verdict_says_what_pitstop_does_about_it(exposed: Exposed) -> None:
    expected = {
        common_pb2.HEALTH_VERDICT_HEALTHY: 0,
        common_pb2.HEALTH_VERDICT_DEGRADED: 1,  # reported: a low disk, a slower link
        common_pb2.HEALTH_VERDICT_APPLICATION: 1,  # an OOM kill: its rank restarts
        common_pb2.HEALTH_VERDICT_WARNING: 2,  # drain
        common_pb2.HEALTH_VERDICT_FATAL: 3,  # replace
    }
    for verdict, value in expected.items():
        exposed.metrics.observe(common_pb2.HostHealth(verdict=verdict))
        assert exposed("verdict") == value


@pytest.mark.parametrize(
    ("source", "gone"),
    [
        (
            "links",
            {
                "pitstop_host_link_up",
                "pitstop_host_link_rate_gbps",
                "pitstop_host_link_downs",
                "pitstop_host_link_errors",
            },
        ),
        ("psi", {"pitstop_host_memory_pressure_full_avg10"}),
        ("edac", {"pitstop_host_memory_edac_corrected", "pitstop_host_memory_edac_uncorrected"}),
        ("oom", {"pitstop_host_oom_kills"}),
        (
            "disks",
            {
                "pitstop_host_disk_free_bytes",
                "pitstop_host_disk_total_bytes",
                "pitstop_host_disk_free_inodes",
                "pitstop_host_disk_total_inodes",
                "pitstop_host_disk_read_only",
            },
        ),
        ("aer", {"pitstop_host_pcie_aer_errors"}),
    ],
)
def test_an_unsupported_source_has_no_series(
    host: SimulatedHost, exposed: Exposed, source: str, gone: set[str]
) -> None:
    observe(exposed, host.read())
    everything = exposed.names()
    assert gone <= everything
    reading = host.read()
    reading.unsupported.append(source)
    observe(exposed, reading)
    assert exposed.names() == everything - gone  # removed, the rest kept
    observe(exposed, host.read())  # the source is back: so are its series
    assert exposed.names() == everything


def test_a_fresh_registry_never_shows_an_unsupported_source(host: SimulatedHost) -> None:
    exposed = Exposed()
    reading = host.read()
    reading.unsupported.extend(["links", "edac", "psi", "oom", "disks", "aer"])
    observe(exposed, reading)
    assert not any(
        name.startswith(("pitstop_host_link_", "pitstop_host_memory_", "pitstop_host_disk_"))
        for name in exposed.names()
    )
    assert "pitstop_host_oom_kills" not in exposed.names()
    assert "pitstop_host_pcie_aer_errors" not in exposed.names()
    assert "pitstop_host_pcie_link_width" in exposed.names()  # a link's width is no AER
    assert exposed("verdict") == 0


def test_vanished_links_devices_and_paths_lose_their_series(
    exposed: Exposed, tmp_path: Path
) -> None:
    checkpoints, spill = tmp_path / "checkpoints", tmp_path / "spill"
    first = SimulatedHost(ports=("mlx5_0/1", "mlx5_1/1"), disk_paths=[checkpoints])
    observe(exposed, first.read())
    reg = exposed.registry
    assert reg.get_sample_value("pitstop_host_link_up", port("mlx5_1/1")) == 1
    assert exposed("disk_free_bytes", path=str(checkpoints)) is not None

    later = SimulatedHost(ports=("mlx5_0/1",), disk_paths=[spill]).read()
    del later.pcie[1]  # the NIC left the bus
    observe(exposed, later)
    for name in ("link_up", "link_rate_gbps", "link_downs", "link_errors"):
        assert reg.get_sample_value(f"pitstop_host_{name}", port("mlx5_1/1")) is None
        assert reg.get_sample_value(f"pitstop_host_{name}", port("mlx5_0/1")) is not None
    for name in ("free_bytes", "total_bytes", "free_inodes", "total_inodes", "read_only"):
        assert exposed(f"disk_{name}", path=str(checkpoints)) is None
        assert exposed(f"disk_{name}", path=str(spill)) is not None
    for name in ("link_width", "link_width_max", "link_speed_gts", "link_speed_gts_max"):
        assert reg.get_sample_value(f"pitstop_host_pcie_{name}", NIC) is None
        assert reg.get_sample_value(f"pitstop_host_pcie_{name}", GPU) is not None
    for aer_type in ("correctable", "nonfatal", "fatal"):
        labels = {**NIC, "type": aer_type}
        assert reg.get_sample_value("pitstop_host_pcie_aer_errors", labels) is None


def test_the_agent_metrics_delegate_to_their_host_gauges(host: SimulatedHost) -> None:
    metrics = AgentMetrics(NODE)
    assert isinstance(metrics.host, HostMetrics)
    host.oom_kill(1, "python")
    metrics.observe_host(assess_host(host.read(), now=0.0))
    assert metrics.registry.get_sample_value("pitstop_host_oom_kills", {"node": NODE}) == 1
    assert b'pitstop_host_link_up{kind="infiniband",link="mlx5_0/1",node="n1"} 1.0' in (
        metrics.render()
    )
