"""A collective no abandon can end leaves the process instead of waiting out its timeout.

gloo never fails a send it had only partly written when the connection breaks, so an
abandoned rank can stay in its collective until the collective timeout. The training
thread's collectives run inside `group.collectives()`; when the group is abandoned and
the block outlives its grace, the process exits with STUCK_EXIT_CODE. Here the block
waits on an event no abandon touches (the stuck send), in a real child process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
from pitstop.trainer import group

CHILD = textwrap.dedent(
    """
    import sys, threading
    from pitstop.trainer import group

    ends = threading.Event()  # the collective: ends only if set
    def abandon_then(end):
        group.abandon()
        if end:
            ends.set()
    end = sys.argv[1] == "ends"
    with group.collectives(grace=0.0):
        threading.Thread(target=abandon_then, args=(end,)).start()
        ends.wait(60)
    print("out of the block", flush=True)
    group.abandon()  # outside any block, an abandon watches nothing
    print("still here", flush=True)
    """
)


def run_child(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60
    )


def test_a_block_that_outlives_its_grace_after_an_abandon_exits_the_process() -> None:
    child = run_child("stuck")
    assert child.returncode == group.STUCK_EXIT_CODE, child
    assert "out of the block" not in child.stdout
    assert "has not ended" in child.stderr  # says why it left


def test_a_block_that_ends_after_an_abandon_keeps_the_process() -> None:
    child = run_child("ends")
    assert child.returncode == 0, child
    assert "out of the block" in child.stdout
    assert "still here" in child.stdout


def test_a_peer_loss_wrapped_by_a_pipeline_stage_is_still_a_peer_loss() -> None:
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    wrapped = RuntimeError("[Stage 1] failed to run forward: args: (...)")
    wrapped.__cause__ = gone  # as `raise ... from exc` in torch's PipelineStage
    assert group.is_peer_loss(wrapped)
    assert not group.is_peer_loss(RuntimeError("[Stage 1] failed to run forward: bad shape"))
    assert not group.is_peer_loss(ValueError("connection closed"))  # not a collective's error
