"""checkpointd's one mapping from errors to status codes (pitstop.checkpointd.interceptors)."""

from __future__ import annotations

import grpc
import pytest

from pitstop.checkpointd.errors import InvalidArgument, Unavailable
from pitstop.checkpointd.interceptors import INTERNAL_MESSAGE, status_for
from pitstop.checkpointd.replication import ShardStreamError
from pitstop.checkpointd.restore import ShardNotFound
from pitstop.checkpointd.slots import MemoryBudgetFull, SlotMismatch


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("key.job_id is empty: name the job"), grpc.StatusCode.INVALID_ARGUMENT),
        (ShardStreamError("got 3 of 9 bytes"), grpc.StatusCode.INVALID_ARGUMENT),
        (ShardNotFound("no good copy of job j rank 0 step 3"), grpc.StatusCode.NOT_FOUND),
        (SlotMismatch("slot 'x' is not the one given"), grpc.StatusCode.FAILED_PRECONDITION),
        (MemoryBudgetFull("memory budget full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unavailable("checkpointd n1 is stopping"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_domain_errors_keep_their_message(error: Exception, code: grpc.StatusCode) -> None:
    assert status_for(error) == (code, str(error))


@pytest.mark.parametrize(
    "error", [ValueError("bad"), KeyError("model.weight"), OSError(5, "I/O"), RuntimeError()]
)
def test_anything_else_is_internal_and_says_nothing(error: Exception) -> None:
    assert status_for(error) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
