"""Network namespaces made side by side (two local clusters, two tests at once on one
machine) each get a subnet of their own."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from pitstop.client.netns import Network, create, destroy

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2",
)


def test_networks_made_at_once_never_share_a_subnet() -> None:
    count = 4
    start = threading.Barrier(count)
    made: list[Network] = []
    failed: list[BaseException] = []

    def make() -> None:
        start.wait()
        try:
            made.append(create(["a"]))
        except BaseException as exc:  # reported below
            failed.append(exc)

    threads = [threading.Thread(target=make) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert failed == []
        gateways = [network.gateway for network in made]
        assert len(set(gateways)) == count, gateways
    finally:
        problems = [problem for network in made for problem in destroy(network)]
    assert problems == []  # each removed completely
