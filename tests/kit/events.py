"""The scheduler's event stream, followed by a test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from pitstop.common.tls import channel_options
from pitstop.v1 import nodes_pb2, nodes_pb2_grpc


class follow_events:  # noqa: N801 (used like the generator it replaced)
    """Every event after ``after``, as recorded (a Watch stream). ``close()`` cancels it;
    one dropped unclosed is left to grpc's own finalizer: closing a channel from a
    garbage collection that runs inside grpc code holding the channel's lock deadlocks."""

    def __init__(
        self,
        address: str,
        after: int = 0,
        timeout: float = 60.0,
        wait_for_ready: bool = False,
        *,
        ca: Path | None = None,
        token: str = "",
    ) -> None:
        """`ca`: the cluster CA certificate of a scheduler with TLS on; `token`: a bearer
        token (viewer or above) for one with tokens."""
        if ca is None:
            self._channel = grpc.insecure_channel(address)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
            self._channel = grpc.secure_channel(address, credentials, options=channel_options())
        self._stream = nodes_pb2_grpc.EventServiceStub(self._channel).Watch(
            nodes_pb2.WatchEventsRequest(after_event_id=after),
            timeout=timeout,
            wait_for_ready=wait_for_ready,
            metadata=(("authorization", f"Bearer {token}"),) if token else None,
        )

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._stream)

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()


def wait_for(events: Iterator[Any], match: Callable[[Any], bool]) -> Any:
    """The first event ``match`` accepts (the stream's deadline bounds the wait)."""
    for event in events:
        if match(event):
            return event
    raise AssertionError("the event stream ended before the awaited event")
