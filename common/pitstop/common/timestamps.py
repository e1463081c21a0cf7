"""Whether a protobuf Timestamp a caller sent is one a server can hold: protobuf allows
years 1-9999 (UTC) and nanos in [0, 10^9); a value outside either makes `ToDatetime`
raise, and PostgreSQL's timestamptz refuse it, deep inside a handler."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

SECONDS_RANGE = (-62_135_596_800, 253_402_300_799)
"""0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z, the range protobuf's Timestamp allows."""
FIX = "send a time between years 1 and 9999 (UTC), nanos in [0, 999999999]"


def out_of_range(value: Timestamp) -> str | None:
    """None for a Timestamp protobuf allows; else its value as `<seconds>s <nanos>ns`,
    for the error that names it."""
    seconds, nanos = value.seconds, value.nanos
    if SECONDS_RANGE[0] <= seconds <= SECONDS_RANGE[1] and 0 <= nanos < 10**9:
        return None
    return f"{seconds}s {nanos}ns"
