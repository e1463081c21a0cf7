"""What the trust-boundary fuzzers share: messages of any type built from their
descriptors, the refusals a user can act on, and how many examples to run.

PITSTOP_FUZZ_SCALE=N multiplies every fuzzer's number of examples by N (default 1): a
deeper hunt than the suite's usual run, e.g. ``PITSTOP_FUZZ_SCALE=20 pytest -k fuzz``.
Inputs a hunt finds to break something are kept as explicit ``@example`` cases.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kit.schedulers import SchedulerProcess, tls_scheduler
from kit.stores import StoreUrls, unique
from kit.streams import LIVE_HOST
from pitstop.agent.identity import enroll, identity_for
from pitstop.client.client import PitstopClient
from pitstop.common.tls import channel_options, node_credentials
from pitstop.v1 import agent_pb2, common_pb2

SCALE = int(os.environ.get("PITSTOP_FUZZ_SCALE", "1") or "1")

CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.CANCELLED,
}


# pytest's time limit for one fuzzer (all its examples), grown with the scale.
FUZZ_TIMEOUT = pytest.mark.timeout(120 * SCALE)


def fuzz_settings(examples: int) -> settings:
    """Settings for a fuzzer of `examples` examples (times PITSTOP_FUZZ_SCALE): no
    deadline (a call to a server has no fixed cost) and module-scoped servers allowed."""
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def call_method(
    channel: grpc.Channel,
    method: MethodDescriptor,
    request: Message,
    metadata: tuple[tuple[str, str], ...] | None,
    timeout: float,
    *,
    until_deadline: bool = False,
) -> None:
    """Call `method` (unary or server-streaming) with `request` and read every answer.
    `until_deadline`: a call that only ends at its deadline (a Watch, a wait for a
    command) is not refused when it reaches it."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    serialize = type(request).SerializeToString
    reply = GetMessageClass(method.output_type).FromString
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path, serialize, reply)(
                request, timeout=timeout, metadata=metadata
            ):
                pass
        else:
            channel.unary_unary(path, serialize, reply)(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as err:
        waited = err.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        if not (waited and until_deadline):
            raise


def assert_clear(err: grpc.RpcError, what: object, also: frozenset[Any] = frozenset()) -> None:
    """A refusal a user can act on: a code from CLEAR (or `also`), with details, and no
    traceback."""
    code, details = err.code(), err.details() or ""  # type: ignore[attr-defined]
    assert code in CLEAR | also, f"{what!r} answered {code} {details!r}"
    assert details.strip(), f"{what!r} answered {code} without details"
    assert "Traceback" not in details, f"{what!r} answered a traceback: {details}"


# Messages of any type, from their descriptors: every field absent or any value of its
# type, the awkward ones often (NUL, long strings, integer bounds, NaN, unknown enums).

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# Valid UTF-8 only: protobuf itself refuses to encode lone surrogates.
# Mostly plain, so that a stream gets past its first message; awkward one time in three.
text = st.integers(0, 8).flatmap(
    lambda pick: (
        st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12)
        if pick < 6
        else st.sampled_from(["", "\x00", "a\x00b", "../../etc", "x" * 300, "é" * 70, "job-a"])
        if pick < 8
        else st.integers(0, 5000).map(lambda n: "y" * n)
    )
)


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in [lo, hi], small ones and the edges of the wire types often."""
    edges = [
        v for v in (lo, hi, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63) if lo <= v <= hi
    ]
    return st.one_of(
        st.integers(max(lo, 0), min(hi, 9)), st.sampled_from(edges), st.integers(lo, hi)
    )


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_STRING:
        return text
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    raise AssertionError(f"no strategy for {field.full_name}")


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        return st.dictionaries(_scalar(key), _single(value, depth), max_size=3)
    single = _single(field, depth)
    return st.lists(single, max_size=3) if field.is_repeated else single


def _single(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None:
        return messages(field.message_type, depth - 1)
    return _scalar(field)


def messages(descriptor: Descriptor, depth: int = 5) -> st.SearchStrategy[Any]:
    """Any message of `descriptor`'s type, nested messages down to `depth`."""
    cls = GetMessageClass(descriptor)
    if depth <= 0:
        return st.just(cls())
    plain = {
        f.name: _value(f, depth)
        for f in descriptor.fields
        if f.containing_oneof is None or f.containing_oneof.name.startswith("_")
    }
    oneofs = [
        st.one_of(
            st.just({}), *(st.fixed_dictionaries({f.name: _value(f, depth)}) for f in o.fields)
        )
        for o in descriptor.oneofs
        if not o.name.startswith("_")
    ]
    parts = st.tuples(st.fixed_dictionaries({}, optional=plain), *oneofs)
    return parts.map(lambda ps: cls(**{k: v for p in ps for k, v in p.items()}))


def some(cls: type[Message]) -> st.SearchStrategy[Any]:
    """Any message of type `cls`."""
    return messages(cls.DESCRIPTOR)


def truncations(message: Message) -> st.SearchStrategy[bytes]:
    """`message`'s encoding cut short anywhere."""
    data = message.SerializeToString()
    return st.integers(0, max(len(data) - 1, 0)).map(lambda n: data[:n])


@dataclass
class Enrolled:
    """A scheduler process with TLS on, an admin token, and one node enrolled in it."""

    scheduler: SchedulerProcess
    node_id: str
    channel: grpc.Channel
    """The node's mutual-TLS channel to the scheduler's node port."""
    database_url: str
    admin_token: str


@contextlib.contextmanager
def enrolled_node(stores: StoreUrls, root: Path, admin_token: str) -> Iterator[Enrolled]:
    """Start a TLS scheduler on a database of its own and enroll a node with a join
    token, as `pitstop-agent` does; the scheduler stops at the end."""
    tokens = [{"token": admin_token, "role": "admin", "name": "ops"}]
    scheduler = tls_scheduler(stores, root, tokens)
    database_url = scheduler.env["PITSTOP_DATABASE_URL"]
    try:
        ca = scheduler.ca
        assert ca is not None
        tls = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
        node_id = unique("fuzz")
        with PitstopClient(scheduler.address, admin_token, credentials=tls) as client:
            token = client.create_join_token(600, node_id).token
        identity = identity_for(root / node_id, node_id)
        enroll(identity, scheduler.address, token, ca)
        channel = grpc.secure_channel(
            scheduler.node_address, node_credentials(identity), options=channel_options()
        )
        with channel:
            yield Enrolled(scheduler, node_id, channel, database_url, admin_token)
    finally:
        scheduler.stop()


def register(node_id: str) -> agent_pb2.AgentMessage:
    """A valid Register of `node_id` with one GPU, its host up (LIVE_HOST)."""
    started = timestamp_pb2.Timestamp(seconds=1_700_000_000)
    inventory = common_pb2.Inventory(
        hostname=node_id,
        checkpointd_address=LIVE_HOST,
        gpus=[common_pb2.GpuInfo(index=0, uuid=f"G-{node_id}")],
    )
    return agent_pb2.AgentMessage(
        seq=1,
        register=agent_pb2.Register(node_id=node_id, inventory=inventory, agent_started_at=started),
    )
