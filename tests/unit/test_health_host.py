"""The host's verdicts: what a link, the memory, a disk or a PCIe device must do to drain
or replace a node, and what is only reported."""

from __future__ import annotations

import pytest

from pitstop.health.host import HostThresholds, assess_host
from pitstop.v1 import common_pb2

V = common_pb2


def host(**links: tuple[bool, float, int, int]) -> common_pb2.HostHealth:
    """A host with a disk with room and the links given as (up, rate, downs, errors)."""
    return V.HostHealth(
        links=[
            V.LinkReading(
                name=name.replace("_", "/"),
                kind="infiniband",
                up=up,
                rate_gbps=rate,
                down_count=downs,
                error_count=errors,
            )
            for name, (up, rate, downs, errors) in links.items()
        ],
        disks=[V.DiskReading(path="/data", free_bytes=500 << 30, total_bytes=1 << 40)],
    )


def test_a_healthy_host_has_no_reason() -> None:
    now = host(mlx5_0_1=(True, 400, 1, 5))
    judged = assess_host(now, now=100, earlier=[(50, now)], seen_up={"mlx5/0/1": 400})
    assert judged.verdict == V.HEALTH_VERDICT_HEALTHY
    assert list(judged.reasons) == []


def test_a_link_down_replaces_the_node_once_it_was_seen_up() -> None:
    down = host(mlx5_1_1=(False, 0, 1, 0))
    judged = assess_host(down, now=0, seen_up={"mlx5/1/1": 400})
    assert judged.verdict == V.HEALTH_VERDICT_FATAL
    assert judged.reasons == ["infiniband link mlx5/1/1 is down"]
    # A port never up since the agent started (no cable in it) is no fault.
    assert assess_host(down, now=0).verdict == V.HEALTH_VERDICT_HEALTHY


def test_a_flap_within_the_window_drains_but_downs_spread_out_do_not() -> None:
    before = host(mlx5_1_1=(True, 400, 2, 0))
    after = host(mlx5_1_1=(True, 400, 6, 0))
    flapped = assess_host(after, now=130, earlier=[(100, before)])
    assert flapped.verdict == V.HEALTH_VERDICT_WARNING
    assert flapped.reasons == ["infiniband link mlx5/1/1 flapped 4 times in 60 s"]
    # The same four downs, counted from a reading older than the window: no flap.
    spread = assess_host(after, now=200, earlier=[(100, before)])
    assert spread.verdict == V.HEALTH_VERDICT_HEALTHY
    # Two downs in the window are under the three a flap takes.
    assert assess_host(
        host(mlx5_1_1=(True, 400, 4, 0)), now=130, earlier=[(100, before)]
    ).verdict == (V.HEALTH_VERDICT_HEALTHY)


def test_errors_rising_drain_and_a_slower_rate_is_reported() -> None:
    before = host(mlx5_0_1=(True, 400, 0, 10))
    after = host(mlx5_0_1=(True, 200, 0, 150))
    judged = assess_host(after, now=30, earlier=[(0, before)], seen_up={"mlx5/0/1": 400})
    assert judged.verdict == V.HEALTH_VERDICT_WARNING
    assert judged.reasons == [
        "infiniband link mlx5/0/1: 140 new errors in 60 s",
        "infiniband link mlx5/0/1 runs at 200 Gb/s, below the 400 Gb/s it ran at",
    ]
    # Slower alone is no failure: reported, for the straggler policy to weigh.
    slower = host(mlx5_0_1=(True, 200, 0, 10))
    judged = assess_host(slower, now=30, earlier=[(0, before)], seen_up={"mlx5/0/1": 400})
    assert judged.verdict == V.HEALTH_VERDICT_DEGRADED


def test_a_counter_reset_is_judged_from_its_new_value() -> None:
    before = host(mlx5_0_1=(True, 400, 50, 5000))
    after = host(mlx5_0_1=(True, 400, 1, 3))  # the driver reloaded: counters from zero
    assert assess_host(after, now=10, earlier=[(0, before)]).verdict == V.HEALTH_VERDICT_HEALTHY


def test_memory_uncorrected_replaces_corrected_burst_drains_pressure_and_oom_report() -> None:
    before = V.HostHealth(memory=V.MemoryReading(edac_corrected=10))
    after = V.HostHealth(
        memory=V.MemoryReading(
            edac_corrected=200,
            edac_uncorrected=1,
            pressure_full_avg10=35.5,
            oom_kills=1,
            last_oom_killed="pid 4321 (python)",
        )
    )
    judged = assess_host(after, now=10, earlier=[(0, before)])
    assert judged.verdict == V.HEALTH_VERDICT_FATAL
    assert judged.reasons == [
        "host memory: 1 new uncorrected errors (EDAC)",
        "host memory: 190 new corrected errors (EDAC) in 60 s",
        "host memory: the kernel killed 1 process(es) for memory (OOM), "
        "the latest pid 4321 (python)",
        "host memory pressure: every task stalled 35.5% of the last 10 s",
    ]
    # An OOM kill alone restarts the rank; nothing on the node is broken.
    oom = V.HostHealth(memory=V.MemoryReading(oom_kills=1, last_oom_killed="pid 7 (python)"))
    assert assess_host(oom, now=10, earlier=[(0, V.HostHealth())]).verdict == (
        V.HEALTH_VERDICT_APPLICATION
    )
    # ... once: the next reading with no new kill is healthy again.
    assert assess_host(oom, now=20, earlier=[(10, oom)]).verdict == V.HEALTH_VERDICT_HEALTHY


def test_a_full_read_only_or_inodeless_disk_is_reported_never_drained() -> None:
    disks = [
        V.DiskReading(path="/ckpt", free_bytes=1 << 30, total_bytes=1 << 40),
        V.DiskReading(path="/spill", free_bytes=500 << 30, total_bytes=1 << 40, read_only=True),
        V.DiskReading(
            path="/tmp", free_bytes=500 << 30, total_bytes=1 << 40, total_inodes=10, free_inodes=0
        ),
    ]
    judged = assess_host(V.HostHealth(disks=disks), now=0)
    assert judged.verdict == V.HEALTH_VERDICT_DEGRADED
    assert judged.reasons == [
        "disk /ckpt: 1.0 GiB free of 1024.0 GiB",
        "disk /spill is read-only",
        "disk /tmp: no inodes free",
    ]


def test_pcie_fatal_aer_replaces_narrow_links_and_bursts_drain_a_gpu_slower_is_its_own() -> None:
    def device(role: str, **fields: float) -> common_pb2.PcieDeviceReading:
        full = {
            "link_width": 16,
            "link_width_max": 16,
            "link_speed_gts": 32,
            "link_speed_gts_max": 32,
        }
        address = "0000:17:00.0" if role == "gpu" else "0000:18:00.0"
        return V.PcieDeviceReading(address=address, role=role, **(full | fields))

    before = V.HostHealth(pcie=[device("gpu"), device("nic")])
    after = V.HostHealth(
        pcie=[
            device("gpu", aer_fatal=1, link_speed_gts=2.5),  # idle GPU: slower is no fault
            device("nic", aer_correctable=500, link_width=8, link_speed_gts=16),
        ]
    )
    judged = assess_host(after, now=5, earlier=[(0, before)])
    assert judged.verdict == V.HEALTH_VERDICT_FATAL
    assert judged.reasons == [
        "PCIe gpu 0000:17:00.0: 1 new fatal AER errors",
        "PCIe nic 0000:18:00.0: 500 new correctable AER errors in 60 s",
        "PCIe nic 0000:18:00.0 runs x8 of x16",
        "PCIe nic 0000:18:00.0 runs at 16 of 32 GT/s",
    ]


def test_an_unsupported_source_is_skipped() -> None:
    reading = V.HostHealth(
        memory=V.MemoryReading(edac_uncorrected=5, pressure_full_avg10=90),
        unsupported=["edac", "psi"],
    )
    assert assess_host(reading, now=10, earlier=[(0, V.HostHealth())]).verdict == (
        V.HEALTH_VERDICT_HEALTHY
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("flap_downs", 0),
        ("link_error_growth", 0),
        ("flap_window_seconds", 0),
        ("disk_free_fraction", 1.5),
    ],
)
def test_thresholds_refuse_what_would_never_or_always_fire(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"HostThresholds.{field} is"):
        HostThresholds(**{field: value})
