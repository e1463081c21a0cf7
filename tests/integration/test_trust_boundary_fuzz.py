"""Bad input at the trust boundary (issue 17): fuzzing what a node may send.

(a) The scheduler's agent stream (AgentService.Connect), as an enrolled node over mutual
TLS: hypothesis-built AgentMessage streams, and raw frames (random, truncated, oversized).
(b) A checkpoint daemon's CheckpointService, the same way, plus a rank's slot holding
any bytes when it is sealed.

Whatever comes in: the process stays up and still answers a valid call, nothing is
recorded for any node but the caller's, and every refusal is a clear status code with
details (never UNKNOWN or INTERNAL, never a traceback).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf.message import Message
from hypothesis import event, example, given
from hypothesis import strategies as st

from kit.checkpointd import DaemonProcess, FakeCatalog
from kit.fuzzing import (
    FUZZ_TIMEOUT,
    Enrolled,
    assert_clear,
    enrolled_node,
    fuzz_settings,
    integers,
    register,
    some,
    text,
    truncations,
)
from kit.stores import StoreUrls, unique
from pitstop.rankside.shards import shard_checksum
from pitstop.rankside.shm import SHM_DIR
from pitstop.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, checkpoint_pb2_grpc, common_pb2

pytestmark = FUZZ_TIMEOUT
ADMIN = "admin-token-fuzz-0123456789"
FUZZ = fuzz_settings(40)
CONNECT = "/pitstop.v1.AgentService/Connect"
SERVICE = "/pitstop.v1.CheckpointService/"
TIMEOUT = 15.0


# (a) The scheduler, with TLS on, and one enrolled node.


@pytest.fixture(scope="module")
def enrolled(stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Enrolled]:
    with enrolled_node(stores, tmp_path_factory.mktemp("trust"), ADMIN) as node:
        yield node


def drain(responses: Iterator[Any], what: object) -> list[Any]:
    """Every answer on a stream; a refusal must be a clear one."""
    got: list[Any] = []
    try:
        got.extend(responses)
        event("served")
    except grpc.RpcError as err:
        assert_clear(err, what)  # type: ignore[arg-type]
        event(f"{err.code().name} after {len(got)} answers")  # type: ignore[attr-defined]
    return got


def foreign_rows(node: Enrolled) -> list[tuple[str, str]]:
    """Rows recorded for any node but the enrolled one."""
    with psycopg.connect(node.database_url, autocommit=True) as db:
        rows = db.execute(
            """
            SELECT 'nodes', id FROM nodes WHERE id <> %(n)s
            UNION ALL SELECT 'gpus', node_id FROM gpus WHERE node_id <> %(n)s
            UNION ALL SELECT 'xid_events', node_id FROM xid_events WHERE node_id <> %(n)s
            UNION ALL SELECT 'node_commands', node_id FROM node_commands WHERE node_id <> %(n)s
            UNION ALL SELECT 'checkpoint_shards', node_id FROM checkpoint_shards
                WHERE node_id <> %(n)s
            UNION ALL SELECT 'events', coalesce(node_id, actor) FROM events
                WHERE node_id <> %(n)s OR (actor LIKE 'agent:%%' AND actor <> %(a)s)
            """,
            {"n": node.node_id, "a": f"agent:{node.node_id}"},
        ).fetchall()
    return [(str(table), str(who)) for table, who in rows]


def assert_still_serving(node: Enrolled) -> None:
    """The scheduler is up, takes the node's valid Register, and wrote nothing for
    another node."""
    assert node.scheduler.proc.poll() is None, node.scheduler.log.read_text()[-3000:]
    stub = agent_pb2_grpc.AgentServiceStub(node.channel)
    answers = list(stub.Connect(iter([register(node.node_id)]), timeout=TIMEOUT))
    assert answers[0].registered.node_id == node.node_id
    assert foreign_rows(node) == []


bodies = st.one_of(
    *(
        some(cls).map(lambda body, name=name: agent_pb2.AgentMessage(**{name: body}))
        for name, cls in [
            ("heartbeat", agent_pb2.Heartbeat),
            ("xid", common_pb2.XidEvent),
            ("step_summary", agent_pb2.StepSummary),
            ("rank_exited", agent_pb2.RankExited),
            ("ack", agent_pb2.CommandAck),
            ("register", agent_pb2.Register),
        ]
    ),
    some(agent_pb2.AgentMessage),
)


@st.composite
def agent_streams(draw: st.DrawFn, node_id: str) -> list[agent_pb2.AgentMessage]:
    """A stream an agent might send: mostly a Register as itself first, then messages
    of every kind numbered in order; sometimes another node's id or a wrong number."""
    first = register(node_id)
    if draw(st.booleans()):
        first.register.CopyFrom(draw(some(agent_pb2.Register)))
    others = ["other-node", node_id.upper(), f"{node_id}x", ""]
    first.register.node_id = draw(
        st.integers(0, 9).flatmap(lambda n: st.just(node_id) if n < 7 else st.sampled_from(others))
    )
    if draw(st.integers(0, 9)) == 0:
        first = draw(some(agent_pb2.AgentMessage))
    stream = [first, *draw(st.lists(bodies, max_size=6))]
    for seq, message in enumerate(stream[1:], start=2):
        message.seq = seq if draw(st.integers(0, 7)) else draw(integers(0, 2**64 - 1))
    return stream


@FUZZ
@given(data=st.data())
def test_any_agent_stream_is_served_or_refused_clearly(enrolled: Enrolled, data: Any) -> None:
    stream = data.draw(agent_streams(enrolled.node_id))
    stub = agent_pb2_grpc.AgentServiceStub(enrolled.channel)
    drain(stub.Connect(iter(stream), timeout=TIMEOUT), stream)
    assert_still_serving(enrolled)


@pytest.mark.parametrize("kind", [-1, 99])
def test_a_finding_of_a_kind_the_scheduler_does_not_know_is_recorded(
    enrolled: Enrolled, kind: int
) -> None:
    """A finding of a FindingKind this scheduler does not know (an agent newer than it,
    or garbage) is recorded under that number, not answered INTERNAL (the fuzz test's
    `finding { kind: -1 }` was)."""
    finding = agent_pb2.IntegrityFinding(job_id="j-unknown", step=7)
    finding.kind = kind  # type: ignore[assignment]
    stream = [register(enrolled.node_id), agent_pb2.AgentMessage(seq=2, finding=finding)]
    stub = agent_pb2_grpc.AgentServiceStub(enrolled.channel)
    answers = list(stub.Connect(iter(stream), timeout=TIMEOUT))  # served: no error
    assert answers[0].registered.node_id == enrolled.node_id
    with psycopg.connect(enrolled.database_url, autocommit=True) as db:
        kinds = db.execute(
            "SELECT attributes->>'kind' FROM events WHERE node_id = %s AND reason = %s",
            (enrolled.node_id, f"step 7: unknown kind {kind}"),
        ).fetchall()
    assert kinds == [(f"unknown kind {kind}",)]
    assert_still_serving(enrolled)


frames = st.one_of(
    st.binary(max_size=256),
    truncations(register("truncated-node")),
    some(agent_pb2.AgentMessage).flatmap(truncations),
    some(agent_pb2.AgentMessage).map(lambda m: m.SerializeToString() + b"\xff\xff\xff"),
)


def raw_stream(channel: grpc.Channel, method: str, requests: list[bytes]) -> Iterator[bytes]:
    call = channel.stream_stream(
        method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    responses: Iterator[bytes] = call(iter(requests), timeout=TIMEOUT)
    return responses


@FUZZ
@given(registered=st.booleans(), rest=st.lists(frames, min_size=1, max_size=4))
def test_raw_agent_frames_are_refused_clearly(
    enrolled: Enrolled, registered: bool, rest: list[bytes]
) -> None:
    """Random, truncated and trailing-garbage frames, first or after a valid Register."""
    requests = [register(enrolled.node_id).SerializeToString()] if registered else []
    drain(raw_stream(enrolled.channel, CONNECT, requests + rest), rest)
    assert_still_serving(enrolled)


@pytest.mark.parametrize("registered", [False, True])
def test_an_oversized_agent_frame_is_refused_as_too_large(
    enrolled: Enrolled, registered: bool
) -> None:
    requests = [register(enrolled.node_id).SerializeToString()] if registered else []
    big = register(enrolled.node_id)
    big.register.inventory.hostname = "h" * (5 << 20)
    with pytest.raises(grpc.RpcError) as refused:
        list(raw_stream(enrolled.channel, CONNECT, [*requests, big.SerializeToString()]))
    assert_clear(refused.value, "a 5 MiB frame")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_still_serving(enrolled)


# (b) A checkpoint daemon (plaintext today), reporting to a fake catalog.


@dataclass
class Daemon:
    process: DaemonProcess
    catalog: FakeCatalog
    channel: grpc.Channel
    stub: Any


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    catalog = FakeCatalog()
    node_id = unique("ckfuzz")
    process = DaemonProcess(
        node_id,
        tmp_path_factory.mktemp("ckfuzz"),
        "--memory-budget-bytes",
        str(64 << 20),
        "--log-level",
        "WARNING",
        scheduler=catalog.address,
    )
    channel = grpc.insecure_channel(
        process.address, options=[("grpc.max_send_message_length", 64 << 20)]
    )
    try:
        yield Daemon(process, catalog, channel, checkpoint_pb2_grpc.CheckpointServiceStub(channel))
    finally:
        channel.close()
        process.stop()
        catalog.server.stop(None)


def assert_daemon_serving(daemon: Daemon) -> None:
    """The daemon is up, answers ListShards, and reports only as its own node."""
    assert daemon.process.process.poll() is None, "checkpointd died"
    daemon.stub.ListShards(checkpoint_pb2.ListShardsRequest(), timeout=TIMEOUT)
    reporters = {report.node_id for report in list(daemon.catalog.reports)}
    assert reporters <= {daemon.process.node_id}, reporters


keys = st.one_of(
    some(checkpoint_pb2.ShardKey),
    st.builds(
        checkpoint_pb2.ShardKey,
        job_id=st.sampled_from(["job-a", "job-b"]),
        rank=st.integers(0, 3),
        step=st.integers(0, 5),
        generation=st.integers(0, 2),
    ),
)
UNARY: dict[str, tuple[type[Message], st.SearchStrategy[Any]]] = {
    "AcquireSlot": (
        checkpoint_pb2.AcquireSlotResponse,
        st.one_of(
            some(checkpoint_pb2.AcquireSlotRequest),
            st.builds(
                checkpoint_pb2.AcquireSlotRequest, key=keys, size_bytes=st.integers(0, 1 << 20)
            ),
        ),
    ),
    "SealSlot": (
        checkpoint_pb2.SealSlotResponse,
        st.one_of(
            some(checkpoint_pb2.SealSlotRequest),
            st.builds(
                checkpoint_pb2.SealSlotRequest,
                key=keys,
                shm_name=text,
                size_bytes=st.integers(0, 1 << 20),
                next_size_bytes=integers(0, 2**64 - 1),
            ),
        ),
    ),
    "Restore": (
        checkpoint_pb2.RestoreResponse,
        st.one_of(
            some(checkpoint_pb2.RestoreRequest), st.builds(checkpoint_pb2.RestoreRequest, key=keys)
        ),
    ),
    "ListShards": (checkpoint_pb2.ListShardsResponse, some(checkpoint_pb2.ListShardsRequest)),
}


@st.composite
def pushes(draw: st.DrawFn) -> list[checkpoint_pb2.ShardChunk]:
    """A PushShard stream: mostly chunks that add up, with the right checksum or not."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(some(checkpoint_pb2.ShardChunk), max_size=4))
    data = draw(st.binary(max_size=4096))
    cut = draw(st.integers(0, len(data)))
    header = draw(some(checkpoint_pb2.ShardHeader))
    header.key.CopyFrom(draw(keys))
    header.size_bytes = draw(st.sampled_from([len(data), len(data), len(data) + 1, 0, 2**64 - 1]))
    header.checksum = draw(st.sampled_from([shard_checksum(data), header.checksum]))
    chunks = [checkpoint_pb2.ShardChunk(header=header, offset=0, data=data[:cut])]
    if cut < len(data):
        chunks.append(
            checkpoint_pb2.ShardChunk(offset=draw(st.sampled_from([cut, 0])), data=data[cut:])
        )
    return chunks


@pytest.mark.parametrize("method", [*UNARY, "PullShard", "PushShard"])
@fuzz_settings(25)
@given(data=st.data())
def test_any_checkpoint_call_is_answered_or_refused_clearly(
    daemon: Daemon, method: str, data: Any
) -> None:
    try:
        if method in UNARY:
            reply_type, requests = UNARY[method]
            request = data.draw(requests)
            call = daemon.channel.unary_unary(
                SERVICE + method,
                request_serializer=type(request).SerializeToString,
                response_deserializer=reply_type.FromString,
            )
            call(request, timeout=TIMEOUT)
        elif method == "PullShard":
            request = data.draw(
                st.one_of(
                    some(checkpoint_pb2.PullShardRequest),
                    st.builds(checkpoint_pb2.PullShardRequest, key=keys),
                )
            )
            list(daemon.stub.PullShard(request, timeout=TIMEOUT))
        else:
            request = data.draw(pushes())
            daemon.stub.PushShard(iter(request), timeout=TIMEOUT)
        event("served")
    except grpc.RpcError as err:
        assert_clear(err, (method, request))
        event(err.code().name)
    assert_daemon_serving(daemon)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
tensor_infos = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "BF16", "U8", "I64", "nope"]) | json_values,
        "shape": st.lists(st.integers(-2, 8), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-4, 64), min_size=2, max_size=2) | json_values,
    },
)
headers = st.dictionaries(
    st.sampled_from(["w", "b", "__metadata__", ""]) | st.text(max_size=6),
    tensor_infos | json_values,
    max_size=3,
).map(lambda doc: json.dumps(doc).encode())


@FUZZ
@given(
    header=headers | st.binary(max_size=64),
    length=st.one_of(st.none(), integers(0, 2**64 - 1)),
    body=st.binary(max_size=128),
    sealed=st.one_of(st.none(), st.integers(0, 1 << 13)),
)
# A dtype that is not a str made the daemon answer INTERNAL (a list cannot be hashed).
@example(
    header=b'{"w": {"shape": [], "dtype": [], "data_offsets": [0, 0]}}',
    length=None,
    body=b"",
    sealed=None,
)
def test_a_slot_holding_any_bytes_is_sealed_or_refused_clearly(
    daemon: Daemon, header: bytes, length: int | None, body: bytes, sealed: int | None
) -> None:
    """A rank writes anything into its slot (a bad header length, a header that is not
    JSON or not a shard's, tensors out of bounds) and seals any size."""
    key = checkpoint_pb2.ShardKey(job_id="job-seal", rank=0, step=1)
    content = struct.pack("<Q", len(header) if length is None else length) + header + body
    slot = daemon.stub.AcquireSlot(
        checkpoint_pb2.AcquireSlotRequest(key=key, size_bytes=len(content)), timeout=TIMEOUT
    )
    segment = SHM_DIR / slot.shm_name
    with segment.open("r+b") as out:
        out.write(content)
    request = checkpoint_pb2.SealSlotRequest(
        key=key, shm_name=slot.shm_name, size_bytes=len(content) if sealed is None else sealed
    )
    try:
        daemon.stub.SealSlot(request, timeout=TIMEOUT)
        event("sealed")
    except grpc.RpcError as err:
        assert_clear(err, content)
        event(f"{err.code().name}: {(err.details() or '')[:40]}")
    assert_daemon_serving(daemon)


METHODS: dict[str, Callable[[grpc.Channel, str], Callable[..., Any]]] = {
    "unary": lambda ch, m: ch.unary_unary(
        m, request_serializer=lambda b: b, response_deserializer=lambda b: b
    ),
    "stream": lambda ch, m: ch.unary_stream(
        m, request_serializer=lambda b: b, response_deserializer=lambda b: b
    ),
    "push": lambda ch, m: ch.stream_unary(
        m, request_serializer=lambda b: b, response_deserializer=lambda b: b
    ),
}
KINDS = {
    "AcquireSlot": "unary",
    "SealSlot": "unary",
    "Restore": "unary",
    "ListShards": "unary",
    "PullShard": "stream",
    "PushShard": "push",
}
chunk_frames = st.one_of(
    frames,
    some(checkpoint_pb2.ShardChunk).flatmap(truncations),
    some(checkpoint_pb2.SealSlotRequest).flatmap(truncations),
)


def call_raw(daemon: Daemon, method: str, payload: list[bytes]) -> None:
    call = METHODS[KINDS[method]](daemon.channel, SERVICE + method)
    if KINDS[method] == "push":
        call(iter(payload), timeout=TIMEOUT)
    elif KINDS[method] == "stream":
        list(call(payload[0], timeout=TIMEOUT))
    else:
        call(payload[0], timeout=TIMEOUT)


@FUZZ
@given(
    method=st.sampled_from(sorted(KINDS)), payload=st.lists(chunk_frames, min_size=1, max_size=3)
)
def test_raw_checkpoint_frames_are_refused_clearly(
    daemon: Daemon, method: str, payload: list[bytes]
) -> None:
    try:
        call_raw(daemon, method, payload)
    except grpc.RpcError as err:
        assert_clear(err, (method, payload))
    assert_daemon_serving(daemon)


@pytest.mark.parametrize("method", ["AcquireSlot", "PushShard"])
def test_an_oversized_checkpoint_frame_is_refused_as_too_large(daemon: Daemon, method: str) -> None:
    chunk = checkpoint_pb2.ShardChunk(data=b"\x01" * (17 << 20))
    with pytest.raises(grpc.RpcError) as refused:
        call_raw(daemon, method, [chunk.SerializeToString()])
    assert_clear(refused.value, "a 17 MiB frame")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_daemon_serving(daemon)
