"""The rank's torch.distributed process group: formed at start, dropped and re-formed on
a Reconfigure, always with a bounded timeout so a collective with a dead peer errors
instead of hanging.

gloo on CPU, NCCL when CUDA is available. The first group forms over env://
(MASTER_ADDR/MASTER_PORT, as the agent and torchrun set them); a re-formed group over
tcp://<rendezvous_address>, where the new rank 0 serves the store.

Abandoning a collective. A rank blocked in a collective whose peer is gone must not
wait out the collective timeout. gloo has no abort (`ProcessGroupGloo.abort()` and
`shutdown()` do nothing for a pending operation), and a rank waiting on a *live*
neighbour that has itself left the collective never sees an error at all. So the group
remembers the connections it opened (the sockets that appeared while it formed) and
`abandon()` shuts them down: the blocked operation here fails at once, and so does that
of every peer waiting on this rank at the other end, which abandons in turn. A rank
abandons when its collective fails (a peer lost), and its command reader abandons the
moment a newer generation's Reconfigure arrives: every rank of the job is told, so two
ranks blocked on each other, which no closed connection reaches (gloo fails only the
pair it reads), are freed by their own Reconfigure. On NCCL, the communicator's own
abort does the same. Nothing of this runs on the step's path.

One case the closed connections do not end: gloo never fails a send it had only
partly written when its connection breaks (`Pair::signalException` signals the queued
writes of bound buffers, not of the unbound ones collectives use), so that send waits
out the collective timeout. A thread whose collectives run inside `collectives()` is
watched when its group is abandoned: still inside the same block `grace` seconds later,
it cannot leave on its own, and the process exits with STUCK_EXIT_CODE; its agent
reports the exit and the scheduler recovers the rank as it does any other, instead of
the job waiting out the timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_PEER_LOSS_MARKERS = (
    "gloo",
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl",
    "socket",
)


def backend() -> str:
    """NCCL with a GPU, gloo without."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(local_rank: int) -> torch.device:
    """The device this rank computes on: its GPU (the one the agent made visible, or the
    LOCAL_RANK-th under torchrun), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank if local_rank < torch.cuda.device_count() else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class _Connections:
    """The sockets the formed group opened, and the generation it was formed for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation = -1
        self.sockets: list[tuple[int, str]] = []  # (descriptor, "socket:[inode]")


_group = _Connections()

STUCK_EXIT_CODE = 75
"""A rank's exit code when a collective it abandoned did not end within its grace (gloo
left a partly written send waiting for the collective timeout); the agent reports it as
any other exit and the scheduler recovers the rank."""
ABANDON_GRACE = 1.0
"""Seconds, at least, that an abandoned collective has to end before the process exits."""


class _Flight:
    """The `collectives()` block open on this process (one: the training thread's)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.serial = 0
        self.open: int | None = None  # serial of the block open now
        self.grace = ABANDON_GRACE
        self.watched: int | None = None  # the block a watcher already waits on


_flight = _Flight()


@contextmanager
def collectives(grace: float = ABANDON_GRACE) -> Iterator[None]:
    """Run the calling thread's collectives inside this block: when the group is
    abandoned while the block is open and the block does not end within `grace` seconds
    (at least ABANDON_GRACE), its collective is stuck where no abandon reaches, and the
    process exits with STUCK_EXIT_CODE. `grace` must cover the longest stretch of work
    between two collectives: a collective started after the abandon fails at once."""
    with _flight.changed:
        _flight.serial += 1
        mine = _flight.serial
        _flight.open, _flight.grace = mine, max(grace, ABANDON_GRACE)
    try:
        yield
    finally:
        with _flight.changed:
            if _flight.open == mine:
                _flight.open = None
            _flight.changed.notify_all()


def _watch_open_block() -> None:
    """After an abandon: exit the process if the open `collectives()` block outlives
    its grace (started once per block)."""
    with _flight.changed:
        block, grace = _flight.open, _flight.grace
        if block is None or _flight.watched == block:
            return
        _flight.watched = block
    threading.Thread(
        target=_leave_if_stuck, args=(block, grace), name="pitstop-abandon-watch", daemon=True
    ).start()


def _leave_if_stuck(block: int, grace: float) -> None:
    with _flight.changed:
        if _flight.changed.wait_for(lambda: _flight.open != block, timeout=grace):
            return
    log.error(
        "a collective abandoned %.1fs ago has not ended (gloo waits out its timeout for a "
        "send it had only partly written); exiting with code %d so the rank is recovered",
        grace,
        STUCK_EXIT_CODE,
    )
    os._exit(STUCK_EXIT_CODE)  # its stream handlers flushed the line above


def _open_sockets() -> dict[int, str]:
    """This process's socket descriptors, each with the kernel's name for it (which
    changes when the descriptor is closed and reused)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: nothing to remember, abandon then does nothing
        return {}
    found = {}
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def _remember(before: dict[int, str], generation: int) -> None:
    """Keep the sockets that appeared since `before` as the formed group's."""
    opened = [(fd, name) for fd, name in _open_sockets().items() if before.get(fd) != name]
    with _group.lock:
        _group.generation, _group.sockets = generation, opened
    log.debug("process group of generation %d holds %d connections", generation, len(opened))


@contextmanager
def adding_connections() -> Iterator[None]:
    """Count the connections opened inside this block as the formed group's too: the
    sub-groups of a DeviceMesh (or any `new_group`) made after the group formed. Their
    collectives (FSDP's reduce-scatter over "dp", a pipeline's sends over "pp") are then
    abandoned with the rest; without it a rank blocked on one waited out its grace."""
    with _group.lock:
        generation = _group.generation
    before = _open_sockets()
    try:
        yield
    finally:
        opened = [(fd, name) for fd, name in _open_sockets().items() if before.get(fd) != name]
        with _group.lock:
            if _group.generation == generation:
                _group.sockets += [c for c in opened if c not in _group.sockets]


def abandon(older_than: int | None = None) -> int:
    """End the collective in flight on this rank's group now, from any thread: shut
    down the group's connections (gloo) or abort its communicator (NCCL). Its peers'
    collectives fail as the connections close. With `older_than`, only a group formed
    for an older generation is abandoned (a command for a generation already joined
    changes nothing). Returns how many connections were shut down."""
    with _group.lock:
        if older_than is not None and _group.generation >= older_than:
            return 0
        sockets = list(_group.sockets)
    if backend() == "nccl" and dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as exc:  # already destroyed, or aborted by its watchdog
            log.debug("aborting the NCCL communicator: %s", exc)
    shut = sum(_shut_down(fd, name) for fd, name in sockets)
    if shut:
        log.info("abandoned the process group: %d connections shut down", shut)
    _watch_open_block()
    return shut


def _shut_down(fd: int, name: str) -> bool:
    """Shut down the connection on descriptor `fd` if it is still the socket `name`
    (checked on a duplicate, so a descriptor closed and reused meanwhile is never
    touched) and not a listener: gloo's accept thread dies on an error there and takes
    the process down (std::terminate)."""
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile
        return False
    try:
        if os.readlink(f"/proc/self/fd/{copy}") != name:
            return False
        with socket.socket(fileno=copy) as connection:
            copy = -1  # closed with the socket object
            if connection.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            connection.shutdown(socket.SHUT_RDWR)
            return True
    except OSError:  # not a socket any more, or not connected
        return False
    finally:
        if copy >= 0:
            os.close(copy)


class Superseded(Exception):
    """A newer generation was decided while this rank waited for its group to form."""


ARRIVAL_POLL = timedelta(seconds=0.5)
"""How long one attempt to reach the generation's store lasts before checking whether
this rank is superseded."""
ARRIVAL_CHECK_SECONDS = 0.05
"""How often a rank waiting at the store looks for the ranks still to come."""


def form(
    rank: int,
    world_size: int,
    timeout: timedelta,
    rendezvous_address: str = "",
    device: torch.device | None = None,
    wait: timedelta | None = None,
    superseded: Callable[[], bool] | None = None,
    generation: int = 0,
) -> None:
    """Form the default process group at `rendezvous_address` (else MASTER_ADDR and
    MASTER_PORT). Collectives time out after `timeout`; forming first waits up to
    `wait` for every rank to arrive at the store (a replacement may still be
    starting), so the collective timeout can be short. While it waits it asks
    `superseded()` and raises Superseded when a newer generation makes
    this one moot: its peers will never come. The group is remembered as `generation`'s,
    for `abandon`. Under torchrun the group forms over
    env://, on the store its agent serves. A group the script formed itself is kept (and
    dropped on a Reconfigure)."""
    if dist.is_initialized():
        log.info("process group already formed by the script: using it")
        return
    with _group.lock:  # a command for this generation, arriving meanwhile, is no news
        _group.generation, _group.sockets = generation, []
    device_id = device if device is not None and device.type == "cuda" else None
    if not rendezvous_address and os.environ.get("TORCHELASTIC_RUN_ID"):
        before = _open_sockets()
        dist.init_process_group(
            backend(),
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
        _remember(before, generation)
        log.info("process group formed: rank %d of %d via torchrun's store", rank, world_size)
        return
    host, _, port = rendezvous_address.rpartition(":")
    if not rendezvous_address:
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        raise RuntimeError(
            f"rank {rank} of {world_size}: MASTER_ADDR/MASTER_PORT are not set; start the "
            "ranks through the pitstop agent or torchrun, or set them"
        )
    store = _arrive(rank, world_size, host, int(port), max(wait or timeout, timeout), superseded)
    before = _open_sockets()
    dist.init_process_group(
        backend(),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    _remember(before, generation)
    log.info("process group formed: rank %d of %d via %s:%s", rank, world_size, host, port)


def _arrive(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    wait: timedelta,
    superseded: Callable[[], bool] | None,
) -> dist.TCPStore:  # type: ignore[name-defined]
    """Connect to the generation's store (rank 0 serves it) and wait there until every
    rank has arrived: gloo's own connect gives up after the short collective timeout."""
    deadline = time.monotonic() + wait.total_seconds()

    def check() -> None:
        if superseded is not None and superseded():
            raise Superseded(f"rank {rank}: a newer generation was decided while forming")

    while True:
        check()
        if rank != 0:
            _wait_listening(host, port, deadline, check)
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host,
                port,
                world_size,
                is_master=rank == 0,
                timeout=min(ARRIVAL_POLL, wait) if rank != 0 else wait,
                wait_for_workers=False,
            )
            break
        except (RuntimeError, dist.DistError) as exc:  # rank 0's store is not up yet
            if rank == 0 or time.monotonic() >= deadline:
                raise
            log.debug("store at %s:%d not up yet: %s", host, port, exc)
    store.set(f"pitstop/arrived/{rank}", "1")
    everyone = [f"pitstop/arrived/{r}" for r in range(world_size)]
    # Polled with check(), which answers at once: a timed-out wait() would log a c10d
    # warning twice a second for as long as a replacement takes to start.
    while not store.check(everyone):
        check()
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"rank {rank}: not every rank of {world_size} reached {host}:{port} within "
                f"{wait.total_seconds():.0f}s"
            )
        time.sleep(ARRIVAL_CHECK_SECONDS)
    store.set_timeout(wait)
    return store


def _wait_listening(host: str, port: int, deadline: float, check: Callable[[], None]) -> None:
    """Wait until something listens at host:port (rank 0's store), trying every
    ARRIVAL_CHECK_SECONDS: a TCPStore client that finds nobody there backs off for half
    a second or more, and survivors reach a new generation's store before rank 0 does."""
    while time.monotonic() < deadline:
        check()
        try:
            with socket.create_connection((host, port), timeout=ARRIVAL_CHECK_SECONDS):
                return
        except OSError:
            time.sleep(ARRIVAL_CHECK_SECONDS)


def drop() -> None:
    """Destroy the default process group, whatever state its peers are in (its
    connections close as they would; `abandon` first to fail peers still waiting)."""
    with _group.lock:
        _group.generation, _group.sockets = -1, []
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a group with a dead peer may fail to close cleanly
        log.warning("destroying the process group failed (dropped anyway): %s", exc)


def is_peer_loss(exc: BaseException) -> bool:
    """Whether `exc` says a collective failed because a peer is gone or hung, rather
    than a bug in the training step. The error's causes count too: a pipeline stage
    re-raises a failed send or receive as its own "failed to run forward"."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        if isinstance(current, RuntimeError):
            text = str(current).lower()
            if any(marker in text for marker in _PEER_LOSS_MARKERS):
                return True
        current = current.__cause__ or current.__context__
    return False
