"""Naming the hung rank from the ranks' stacks (pitstop.health.hang), on stacks as
py-spy and faulthandler print them."""

from __future__ import annotations

from pitstop.health.hang import collective, frames, locate

WAITING = """Process 19418: /venv/bin/python -m pitstop.trainer.example
Python v3.11.7 (/usr/bin/python3.11)

Thread 19418 (idle): "MainThread"
    all_gather (torch/distributed/distributed_c10d.py:4001)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    train_step (pitstop/trainer/example.py:199)
    main (pitstop/trainer/example.py:320)
Thread 19433 (idle): "Thread-1 (_run)"
    wait (threading.py:327)
"""
STUCK = """Process 19420: /venv/bin/python -m pitstop.trainer.example

Thread 19420 (idle): "MainThread"
    Condition.wait (threading.py:327)
    Event.wait (threading.py:629)
    hang_here (pitstop/trainer/integrity.py:530)
    commit (pitstop/trainer/session.py:455)
"""
BARRIER_FAULTHANDLER = """Current thread 0x00007f (most recent call first):
  File "/venv/lib/torch/distributed/distributed_c10d.py", line 4800 in barrier
  File "/train.py", line 40 in main
"""


def test_frames_are_read_from_both_tools() -> None:
    assert frames(STUCK)[:3] == [
        ("wait", "threading.py:327"),
        ("wait", "threading.py:629"),
        ("hang_here", "pitstop/trainer/integrity.py:530"),
    ]
    assert frames(BARRIER_FAULTHANDLER)[0] == (
        "barrier",
        "/venv/lib/torch/distributed/distributed_c10d.py",
    )


def test_a_wait_outside_torch_distributed_is_no_collective() -> None:
    assert collective(WAITING) == "all_gather"
    assert collective(STUCK) == ""  # threading's wait is not torch.distributed's
    assert collective(BARRIER_FAULTHANDLER) == "barrier"


def test_the_rank_outside_any_collective_is_named() -> None:
    verdict = locate({0: WAITING, 1: STUCK, 2: WAITING, 3: WAITING})
    assert verdict.ranks == (1,)
    assert "wait in all_gather" in verdict.reason


def test_a_rank_in_another_collective_than_the_rest_is_named() -> None:
    verdict = locate({0: WAITING, 1: WAITING, 2: BARRIER_FAULTHANDLER})
    assert verdict.ranks == (2,)
    assert "barrier" in verdict.reason


def test_nobody_is_named_when_no_rank_stands_apart_or_nothing_was_taken() -> None:
    assert locate({0: WAITING, 1: WAITING}).ranks == ()
    assert locate({0: STUCK, 1: STUCK}).ranks == ()
    assert locate({0: "", 1: ""}).ranks == ()
    assert locate({}).reason == "no rank's stacks could be taken"
