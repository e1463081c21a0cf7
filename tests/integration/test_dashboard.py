"""The web dashboard in a real browser (Debian's Chromium, headless, driven by
Playwright): live through a fatal Xid on a local cluster, signed in with bearer tokens,
and complete on a synthetic fleet of 1,000 nodes and a 4,000-rank job (how fast that
renders is bench/dashboard.py's to measure, not a test's to assert).

Screenshots go to test-artifacts/dashboard/ (PITSTOP_TEST_ARTIFACTS overrides).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from pitstop.client import PitstopClient
from pitstop.client.localcluster import LocalCluster, stop_cluster
from pitstop.client.scenario import example_spec
from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.dashboard import synthetic as synthetic_fleet
from pitstop.v1 import common_pb2, jobs_pb2

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = (
    Path(os.environ.get("PITSTOP_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
    / "dashboard"
)

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
)
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="Debian's chromium is not installed (scripts/system_packages.sh installs it "
        "as root: apt-get install chromium)",
    ),
    pytest.mark.timeout(240),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield chromium
        chromium.close()


def new_page(browser: Any) -> tuple[Any, list[str]]:
    """A page, and the script errors it raises (a test ends by checking there are none)."""
    page = browser.new_page(ignore_https_errors=True, viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    return page, errors


# A live fault on a local cluster ----------------------------------------------------------


@pytest.fixture
def local(stores: StoreUrls) -> Iterator[LocalCluster]:
    state_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="pd-"))
    try:
        cluster = LocalCluster.up(
            state_dir,
            nodes=2,
            spares=1,
            port=0,
            database_url=stores.fresh_database(),
            redis_url=stores.redis_url,
            env={"PITSTOP_REDIS_PREFIX": f"{stores.redis_prefix}{unique('dash')}:"},
            timeout=90,
        )
        cluster.wait_ready(timeout=90)
        yield cluster
    finally:
        stop_cluster(state_dir, timeout=10.0)
        shutil.rmtree(state_dir, ignore_errors=True)


def test_a_fatal_xid_shows_live_the_node_unhealthy_and_the_recovery_bar(
    local: LocalCluster, browser: Any
) -> None:
    assert local.dashboard_url.startswith("https://"), "a secure cluster serves it on TLS"
    token = local.admin_token()
    assert token
    with local.client() as client:
        job = client.submit_job(example_spec("dash", dp=2, steps=3000, step_seconds=0.05, spares=1))
        page, errors = new_page(browser)
        page.goto(f"{local.dashboard_url}?token={token}")
        # The token went into a cookie and out of the address bar.
        assert "token=" not in page.url
        page.wait_for_selector("body[data-rendered='1']")
        page.wait_for_selector("#job-state[data-state='running']", timeout=90_000)
        page.wait_for_selector("#loss polyline", timeout=30_000)  # steps are flowing
        page.evaluate("window.sameDocument = true")
        page.screenshot(path=ARTIFACTS / "1-running.png", full_page=True)

        running = client.get_job(job.id)
        victim = next(r.node_id for r in running.rank_map.ranks if r.rank == 1)
        cell = f".node[data-node='{victim}']"
        assert page.get_attribute(cell, "data-state") == "ready"
        client.inject_fault(victim, common_pb2.Fault(gpu_index=0, xid=79))

        page.wait_for_selector(f"{cell}[data-state='unhealthy']", timeout=30_000)
        page.wait_for_selector(".incident[data-outcome='resumed']", timeout=60_000)
        # Live: the same document all along, never reloaded.
        assert page.evaluate("window.sameDocument") is True
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
        # Once every rank of the new generation reported, the bar splits the resume into
        # restore (the spare loaded the snapshot) and re-form (the group, the first step).
        split = ".incident[data-outcome='resumed'][data-split='1']"
        page.wait_for_selector(split, timeout=30_000)
        bar = page.locator(split).first
        assert victim in bar.inner_text()
        for phase in ("detect", "decide", "restore", "reform"):
            assert bar.locator(f".seg.{phase}").count() == 1, phase
        assert page.locator("#events tbody tr[data-kind='job.restored']").count() == 1
        page.screenshot(path=ARTIFACTS / "2-after-fatal-xid.png", full_page=True)

        # The node's Xid history on click; the event log filtered to the node.
        page.click(cell)
        page.wait_for_selector("#xid-history tr")
        assert "Xid 79" in page.inner_text("#xid-history")
        page.fill("#event-filter", victim)
        page.wait_for_function(
            "node => [...document.querySelectorAll('#events tbody tr')].every("
            "r => r.innerText.includes(node))",
            arg=victim,
        )
        assert page.locator("#events tbody tr[data-kind='node.unhealthy']").count() >= 1
        page.screenshot(path=ARTIFACTS / "3-node-xid-history.png", full_page=True)
        assert errors == []
        client.cancel_job(job.id, reason="the test is over")


# Signing in, and a large synthetic fleet ---------------------------------------------------

VIEWER = "viewer-token-for-the-dashboard-test"
ADMIN = "admin-token-for-the-dashboard-test"
NODES, RANKS = synthetic_fleet.NODES, synthetic_fleet.RANKS


@pytest.fixture
def synthetic(stores: StoreUrls, tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    thread = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path,
            database_url=stores.fresh_database(),
            redis_prefix=f"{stores.redis_prefix}{unique('dash')}:",
            dashboard_port=0,
            tokens=[
                ApiToken(token=VIEWER, role="viewer", name="viewer"),
                ApiToken(token=ADMIN, role="admin", name="admin"),
            ],
        )
    )
    try:
        job_id = unique("j")[:24]
        thread._call(synthetic_fleet.seed_fleet(thread.scheduler, job_id), timeout=120)
        url = thread.scheduler.dashboard_url
        assert url.startswith("http://")
        yield url, job_id, thread.address
    finally:
        thread.stop()


def get(url: str, token: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_only_a_token_holder_sees_the_fleet(synthetic: tuple[str, str, str]) -> None:
    url, job_id, address = synthetic
    status, body = get(f"{url}api/fleet")
    assert status == 401
    assert "Bearer" in body["error"]
    status, body = get(f"{url}api/fleet", token="not-a-token-anyone-issued")
    assert (status, body["error"]) == (401, "unknown token; ask an administrator for a valid one")
    status, body = get(f"{url}api/fleet", token=VIEWER)
    assert status == 200
    assert len(body["nodes"]) == NODES
    status, body = get(f"{url}api/jobs/{job_id}", token=VIEWER)
    assert status == 200
    assert len(body["ranks"]) == RANKS
    # The job page links the job's experiment record; the queue shows what waits.
    status, body = get(f"{url}api/jobs/{job_id}/record", token=VIEWER)
    assert status == 200, body
    assert body["job_id"] == job_id
    with PitstopClient(address, token=ADMIN) as client:
        spec = jobs_pb2.JobSpec(name="waits", command=["x"], dp=2, gpus_per_node=1, priority=3)
        waiting = client.submit_job(spec)
    status, body = get(f"{url}api/jobs", token=VIEWER)
    assert status == 200
    (listed,) = [j for j in body["jobs"] if j["id"] == waiting.id]
    assert listed["queue_position"] == 1
    assert listed["reason"] == "waiting for placement"
    assert (listed["project"], listed["priority"]) == ("default", 3)
    status, body = get(f"{url}api/nodes/no-such-node", token=VIEWER)
    assert status == 404
    assert "no-such-node" in body["error"]
    # A stale link to a job that does not exist: the page is told, and shows the rest.
    request = urllib.request.Request(f"{url}api/stream?job=j-no-such-job")
    request.add_header("Authorization", f"Bearer {VIEWER}")
    with urllib.request.urlopen(request, timeout=30) as stream:
        kinds = []
        while "missing" not in kinds and len(kinds) < 6:
            line = stream.readline()
            if line.startswith(b"event: "):
                kinds.append(line.removeprefix(b"event: ").strip().decode())
    assert kinds == ["hello", "fleet", "jobs", "events", "missing"]


def test_a_token_revoked_mid_stream_ends_the_stream(synthetic: tuple[str, str, str]) -> None:
    url, job_id, address = synthetic
    with PitstopClient(address, token=ADMIN) as client:
        issued = client.create_api_token(unique("watcher"), common_pb2.ROLE_VIEWER)
        request = urllib.request.Request(f"{url}api/stream?job={job_id}")
        request.add_header("Authorization", f"Bearer {issued.token}")
        with urllib.request.urlopen(request, timeout=30) as stream:
            assert stream.readline() == b"event: hello\n"
            client.revoke_api_token(issued.record.name)
            revoked = time.monotonic()
            kinds = []
            for line in stream:  # ends when the server ends the stream
                if line.startswith(b"event: "):
                    kinds.append(line.removeprefix(b"event: ").strip().decode())
                # A hang guard only: the stream ends at its next tick (each second).
                assert time.monotonic() - revoked < 60, f"still streaming: {kinds}"
    assert kinds[-1] == "denied", kinds
    status, _ = get(f"{url}api/fleet", token=issued.token)
    assert status == 401


def test_1000_nodes_and_a_4000_rank_job_render_completely(
    synthetic: tuple[str, str, str], browser: Any
) -> None:
    url, job_id, _ = synthetic
    page, errors = new_page(browser)
    page.goto(url)
    assert page.url.endswith("/login"), "no token: the sign-in form"
    page.fill("input[name=token]", "wrong-token-0123456789")
    page.click("button[type=submit]")
    assert "unknown token" in page.inner_text(".error")
    page.fill("input[name=token]", VIEWER)
    page.click("button[type=submit]")
    page.wait_for_selector("body[data-rendered='1']")

    # A fresh load, signed in, of the job: the fleet and the job drawn in full.
    page.goto(f"{url}?job={job_id}")
    page.wait_for_selector("body[data-rendered='1']")
    page.wait_for_function(f"document.querySelector('[data-field=ranks]')?.innerText === '{RANKS}'")
    assert page.locator("#fleet .node").count() == NODES
    assert page.locator("#fleet .node[data-state='unhealthy']").count() == 10
    assert page.locator(".incident").count() == 3
    assert "1234" in page.inner_text("[data-field=stragglers]")
    # The heatmap is painted (not the empty background) once the steps arrived.
    page.wait_for_function(
        "(() => { const c = document.getElementById('heatmap');"
        " const d = c.getContext('2d').getImageData(c.width - 4, 10, 1, 1).data;"
        " return d[3] > 0; })()"
    )
    page.screenshot(path=ARTIFACTS / "4-1000-nodes-4000-ranks.png", full_page=True)
    assert errors == []
