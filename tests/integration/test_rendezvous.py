"""The pitstop rendezvous backend against a real scheduler: torch's RendezvousBackend
contract (get, compare-and-set, corrupt state, lost scheduler), the scheduler's checks,
the isolation of one run's records and tokens from another's, and the c10d store the
agents of one run share."""

from __future__ import annotations

import socket
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

import grpc
import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)

from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.domain import Role
from pitstop.trainer.rendezvous import (
    STORE_KEY_SUFFIX,
    PitstopRendezvousBackend,
    create_backend,
    encode_envelope,
)
from pitstop.v1 import rendezvous_pb2, rendezvous_pb2_grpc

AGENT_TOKEN = "agent-token-0123456789"
ANY_TOKEN: Any = mock.ANY


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def connect(address: str, run_id: str, rpc_timeout: float = 10.0) -> PitstopRendezvousBackend:
    return PitstopRendezvousBackend(
        run_id, grpc.insecure_channel(address), target=address, rpc_timeout=rpc_timeout
    )


def params(address: str, run_id: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("pitstop", address, run_id, 1, 2, local_addr="127.0.0.1", **conf)


def cas(backend: PitstopRendezvousBackend, state: bytes, token: object = None) -> tuple[Any, ...]:
    """set_state where something is stored afterwards (it returns None only when not)."""
    outcome = backend.set_state(state, token)
    assert outcome is not None
    return outcome


@pytest.fixture
def backend(scheduler: SchedulerThread) -> Iterator[PitstopRendezvousBackend]:
    backend = connect(scheduler.address, unique("rdzv"))
    yield backend
    backend.close()


@pytest.fixture
def stub(scheduler: SchedulerThread) -> Any:
    return rendezvous_pb2_grpc.RendezvousServiceStub(scheduler.channel())


def test_get_state_is_none_before_any_set(backend: PitstopRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_first_set_without_token_stores(backend: PitstopRendezvousBackend) -> None:
    state, token, stored = cas(backend, b"round-0")
    assert (state, stored) == (b"round-0", True)
    assert isinstance(token, str)
    assert backend.get_state() == (b"round-0", token)


def test_set_with_current_token_stores_under_a_new_token(
    backend: PitstopRendezvousBackend,
) -> None:
    _, first, _ = cas(backend, b"round-0")
    state, second, stored = cas(backend, b"round-1", first)
    assert (state, stored) == (b"round-1", True)
    assert second != first
    assert backend.get_state() == (b"round-1", second)


@pytest.mark.parametrize(
    "token",
    ["stale", None, "no-such-token", "", "99999999999", 2, b"2"],
    ids=["stale", "none", "unknown", "empty", "future", "int", "bytes"],
)
def test_set_with_a_token_that_is_not_current_returns_the_current_state(
    backend: PitstopRendezvousBackend, token: object
) -> None:
    _, stale, _ = cas(backend, b"round-0")
    _, current, _ = cas(backend, b"round-1", stale)
    offered = stale if token == "stale" else token
    assert backend.set_state(b"intruder", offered) == (b"round-1", current, False)
    assert backend.get_state() == (b"round-1", current)


def test_set_with_a_token_when_nothing_is_stored_returns_none(
    backend: PitstopRendezvousBackend,
) -> None:
    # torch's contract: the "existing state" to hand back does not exist.
    assert backend.set_state(b"round-0", "1") is None
    assert backend.get_state() is None


def test_concurrent_sets_with_one_token_store_exactly_once(
    backend: PitstopRendezvousBackend,
) -> None:
    _, token, _ = cas(backend, b"round-0")
    writers = 8
    start = threading.Barrier(writers)

    def offer(i: int) -> tuple[bytes, object, bool] | None:
        start.wait(10)
        return backend.set_state(f"writer-{i}".encode(), token)

    with ThreadPoolExecutor(writers) as pool:
        outcomes = [o for o in pool.map(offer, range(writers)) if o is not None]
    winners = [o for o in outcomes if o[2]]
    assert len(outcomes) == writers
    assert len(winners) == 1
    winning_state, winning_token, _ = winners[0]
    assert backend.get_state() == (winning_state, winning_token)


def _header(magic: bytes, version: int, payload: bytes) -> bytes:
    return struct.pack(">4sBI", magic, version, zlib.crc32(payload)) + payload


@pytest.mark.parametrize(
    "raw",
    [
        b"\x80\x04garbage",
        b"",
        _header(b"PSRZ", 2, b"from the future"),
        _header(b"XXXX", 1, b"not ours"),
        encode_envelope(b"payload")[:-1] + b"P",
    ],
    ids=["garbage", "empty", "version", "magic", "checksum"],
)
def test_undecodable_stored_state_raises_state_error(
    backend: PitstopRendezvousBackend, stub: Any, raw: bytes
) -> None:
    # Written straight through the RPC, past the backend's envelope.
    stub.SetState(rendezvous_pb2.SetRendezvousStateRequest(run_id=backend.run_id, state=raw))
    with pytest.raises(RendezvousStateError, match=backend.run_id):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"round-0")


def test_unreachable_scheduler_raises_connection_error() -> None:
    backend = connect(f"127.0.0.1:{closed_port()}", unique("rdzv"), rpc_timeout=2.0)
    try:
        with pytest.raises(RendezvousConnectionError, match="cannot reach"):
            backend.get_state()
        with pytest.raises(RendezvousConnectionError):
            backend.set_state(b"round-0")
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("run_id", "state", "field"),
    [
        ("", b"s", "run_id"),
        ("r" * 254, b"s", "run_id"),
        ("nul\x00id", b"s", "run_id"),
        ("big", b"s" * ((3 << 20) + 1), "state"),
    ],
    ids=["empty", "long", "nul", "big"],
)
def test_scheduler_rejects_bad_requests_naming_the_field(
    stub: Any, run_id: str, state: bytes, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.SetState(rendezvous_pb2.SetRendezvousStateRequest(run_id=run_id, state=state))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:")


def test_refused_request_raises_rendezvous_error(scheduler: SchedulerThread) -> None:
    backend = connect(scheduler.address, "r" * 254)
    try:
        with pytest.raises(RendezvousError, match="INVALID_ARGUMENT") as caught:
            backend.get_state()
        assert not isinstance(caught.value, RendezvousConnectionError)
    finally:
        backend.close()


def refusal(call: Any, request: Any) -> str:
    """The details of the INVALID_ARGUMENT that ``call(request)`` must raise."""
    with pytest.raises(grpc.RpcError) as caught:
        call(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(caught.value.details())


def test_a_token_of_one_run_is_refused_for_another(scheduler: SchedulerThread) -> None:
    first = connect(scheduler.address, unique("rdzv"))
    second = connect(scheduler.address, unique("rdzv"))
    try:
        # Both records are at their first version: equal counters, different tokens.
        _, first_token, _ = cas(first, b"first-round-0")
        _, second_token, _ = cas(second, b"second-round-0")
        assert first_token != second_token
        with pytest.raises(RendezvousError, match="INVALID_ARGUMENT") as caught:
            second.set_state(b"intruder", first_token)
        assert second.run_id in str(caught.value)
        assert second.get_state() == (b"second-round-0", second_token)
        assert first.get_state() == (b"first-round-0", first_token)
    finally:
        first.close()
        second.close()


def test_a_token_of_another_run_is_refused_where_nothing_is_stored(
    backend: PitstopRendezvousBackend, stub: Any
) -> None:
    _, token, _ = cas(backend, b"round-0")
    empty = unique("rdzv")
    details = refusal(
        stub.SetState, rendezvous_pb2.SetRendezvousStateRequest(run_id=empty, token=token)
    )
    assert details.startswith(f"token: {token!r} is invalid: it was issued for another")
    assert repr(empty) in details
    assert not stub.GetState(rendezvous_pb2.GetRendezvousStateRequest(run_id=empty)).found


def test_a_token_of_a_runs_state_is_refused_for_its_store_record(
    backend: PitstopRendezvousBackend,
) -> None:
    key = backend.run_id + STORE_KEY_SUFFIX
    _, state_token, _ = cas(backend, b"round-0")
    published = backend.records.compare_set(key, b"127.0.0.1:1", None)
    assert published is not None
    with pytest.raises(RendezvousError, match="INVALID_ARGUMENT"):
        backend.records.compare_set(key, b"127.0.0.1:2", state_token)
    assert backend.records.get(key) == (b"127.0.0.1:1", published[1])


@pytest.mark.parametrize(
    "suffix",
    ["/c10d-store/c10d-store", "/c10d-store/", "/state", "/", "//c10d-store", "/C10D-STORE"],
)
def test_the_scheduler_refuses_keys_that_reach_into_a_runs_records(stub: Any, suffix: str) -> None:
    key = unique("rdzv") + suffix
    for call, request in (
        (stub.GetState, rendezvous_pb2.GetRendezvousStateRequest(run_id=key)),
        (stub.SetState, rendezvous_pb2.SetRendezvousStateRequest(run_id=key, state=b"s")),
    ):
        details = refusal(call, request)
        assert details.startswith(f"run_id: {key!r} is invalid: ")
        assert "--rdzv-id without '/'" in details


def test_the_scheduler_refuses_a_record_without_its_run(stub: Any) -> None:
    details = refusal(stub.GetState, rendezvous_pb2.GetRendezvousStateRequest(run_id="/c10d-store"))
    assert details.startswith("run_id: '/c10d-store' is invalid: give the rendezvous id")


def test_a_run_id_naming_another_runs_store_record_is_refused(
    scheduler: SchedulerThread,
) -> None:
    run_id = unique("rdzv")
    owner, store = create_backend(params(scheduler.address, run_id))
    crafted = run_id + STORE_KEY_SUFFIX
    try:
        with pytest.raises(ValueError, match=r"contains '/'.*use another character"):
            create_backend(params(scheduler.address, crafted))
        with pytest.raises(ValueError, match="contains '/'"):
            connect(scheduler.address, crafted)
        # The owner's record is as it published it.
        assert owner.records.get(crafted) == (f"127.0.0.1:{store.port}".encode(), ANY_TOKEN)
    finally:
        owner.close()


@pytest.mark.parametrize("tail", ["c10d-store", "-c10d-store", ".c10d-store", " "])
def test_runs_whose_ids_share_a_prefix_keep_their_own_records(
    scheduler: SchedulerThread, tail: str
) -> None:
    run_id = unique("rdzv")
    shorter, shorter_store = create_backend(params(scheduler.address, run_id))
    longer, longer_store = create_backend(params(scheduler.address, run_id + tail))
    try:
        assert longer_store.port != shorter_store.port
        assert cas(shorter, b"shorter")[2]
        assert longer.get_state() is None
        assert cas(longer, b"longer")[2]
        assert shorter.get_state() == (b"shorter", ANY_TOKEN)
    finally:
        shorter.close()
        longer.close()


def test_torchrun_finds_the_backend_by_name(scheduler: SchedulerThread) -> None:
    handler = rendezvous_handler_registry.create_handler(params(scheduler.address, unique("rdzv")))
    assert handler.get_backend() == "pitstop"


def test_agents_of_one_run_share_the_first_agents_store(scheduler: SchedulerThread) -> None:
    run_id = unique("rdzv")
    first, hosted = create_backend(params(scheduler.address, run_id))
    second, joined = create_backend(params(scheduler.address, run_id))
    try:
        hosted.set("greeting", "hello")
        assert joined.get("greeting") == b"hello"
    finally:
        first.close()
        second.close()


def test_a_store_left_by_an_earlier_run_is_taken_over(scheduler: SchedulerThread) -> None:
    run_id = unique("rdzv")
    key = run_id + STORE_KEY_SUFFIX
    earlier = connect(scheduler.address, run_id)
    dead = f"127.0.0.1:{closed_port()}".encode()
    assert earlier.records.compare_set(key, dead, None) is not None
    backend, store = create_backend(params(scheduler.address, run_id, store_connect_timeout=1))
    try:
        published = earlier.records.get(key)
        assert published is not None
        assert published[0] == f"127.0.0.1:{store.port}".encode()
    finally:
        backend.close()
        earlier.close()


@pytest.fixture(scope="module")
def guarded(stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    settings = scheduler_settings(
        stores,
        tmp_path_factory.mktemp("guarded"),
        tokens=[ApiToken(token=AGENT_TOKEN, role=Role.AGENT, name="agents")],
    )
    thread = SchedulerThread(settings)
    yield thread
    thread.stop()


def test_the_token_in_rdzv_conf_authorizes_the_agent(guarded: SchedulerThread) -> None:
    run_id = unique("rdzv")
    with pytest.raises(RendezvousError, match="UNAUTHENTICATED"):
        create_backend(params(guarded.address, run_id))
    backend, _ = create_backend(params(guarded.address, run_id, token=AGENT_TOKEN))
    try:
        assert cas(backend, b"round-0")[2]
    finally:
        backend.close()
