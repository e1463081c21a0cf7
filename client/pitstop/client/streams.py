"""Following a server stream of events: read on a thread of its own, so that Ctrl-C
never lands inside gRPC, and opened again after a dropped connection, after the last
event seen."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, cast

import grpc

from pitstop.client.errors import PitstopError
from pitstop.v1 import common_pb2


def is_unavailable(error: BaseException) -> bool:
    return isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE


def follow(
    open_stream: Callable[[int], Any], after_event_id: int, max_attempts: int
) -> Generator[common_pb2.Event, None, None]:
    """The events of the stream `open_stream(cursor)` opens, read on a thread of its own
    (`_StreamPump`); after a dropped connection, opened again after the last event seen.
    PitstopError after `max_attempts` failures in a row, or one that is not UNAVAILABLE."""
    # A dropped connection (scheduler restart, failover) resumes after the last
    # event seen, so a watcher sees every event once; only repeated failures without
    # a single event in between give up.
    cursor = after_event_id
    failures = 0
    while True:
        pump = _StreamPump(open_stream, cursor)
        try:
            while (item := pump.received.get()) is not _STREAM_END:
                if isinstance(item, BaseException):
                    raise item
                event = cast(common_pb2.Event, item)
                failures = 0
                cursor = max(cursor, event.id)
                yield event
            return
        except grpc.RpcError as error:
            failures += 1
            if not is_unavailable(error) or failures >= max_attempts:
                raise PitstopError.from_rpc_error(error) from None
        finally:
            pump.close()
        time.sleep(min(2.0, 0.1 * 2**failures) + random.uniform(0, 0.1))


_STREAM_END = object()
PUMP_CLOSE_SECONDS = 5.0
"""How long ending a watch waits for its reading thread to leave gRPC (a cancelled read
returns at once)."""


class _StreamPump:
    """Opens a server stream and reads it on its own thread, onto a queue.

    Ctrl-C is raised in the main thread. Were the stream opened or read there, it could
    land inside gRPC's call bookkeeping and leave the channel unable to close (close()
    then waits forever). Here it lands in ``queue.get()``, which is safe to interrupt.
    """

    def __init__(self, open_stream: Callable[[int], Any], cursor: int) -> None:
        self.received: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._call: Any = None
        self._cancelled = False
        self._thread = threading.Thread(
            target=self._run, args=(open_stream, cursor), name="pitstop-stream", daemon=True
        )
        self._thread.start()

    def _run(self, open_stream: Callable[[int], Any], cursor: int) -> None:
        try:
            call = open_stream(cursor)
            with self._lock:
                self._call = call
                cancelled = self._cancelled
            if cancelled:
                call.cancel()
            for message in call:
                self.received.put(message)
        except Exception as error:  # handed to the reader, who raises it in its own thread
            self.received.put(error)
        else:
            self.received.put(_STREAM_END)

    def cancel(self) -> None:
        """End the stream; safe before it is open and after it has ended."""
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def close(self, timeout: float = PUMP_CLOSE_SECONDS) -> None:
        """End the stream and wait (at most `timeout`) until the reading thread is out of
        gRPC, so the channel is not closed, nor the interpreter ended, under a read."""
        self.cancel()
        self._thread.join(timeout)
