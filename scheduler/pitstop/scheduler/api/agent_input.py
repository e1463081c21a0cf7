"""What an agent may send, checked before anything of it is stored: a value PostgreSQL
cannot hold (a NUL character, a string wider than its column, an integer beyond its
column, a time outside years 1-9999) is refused as INVALID_ARGUMENT naming the field, the
value and the fix, instead of failing the write as an internal error."""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, cast

from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from pitstop.common import timestamps
from pitstop.scheduler.errors import InvalidArgument

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_TIMESTAMP = timestamp_pb2.Timestamp.DESCRIPTOR.full_name

MAX_LENGTH = {
    "register.inventory.hostname": 253,
    "register.inventory.driver_version": 64,
    "register.inventory.gpu_backend": 16,
    "register.inventory.agent_version": 64,
    "register.inventory.checkpointd_address": 261,
    "register.inventory.gpus.uuid": 64,
    "register.inventory.gpus.name": 128,
    "register.inventory.gpus.pci_bus_id": 32,
    "register.inventory.gpus.fabric_cluster_uuid": 64,
    "register.labels.zone": 128,
    "register.labels.block": 128,
    "register.labels.rack": 128,
    "register.labels.nvlink_domain": 128,
    "xid.gpu_uuid": 64,
    "rank_exited.job_id": 32,
    "register.recent_exits.job_id": 32,
}
"""Widths of the columns an agent's strings are stored in (db/models.py), by field path
without indexes."""

MAX_INTEGER = {
    "register.inventory.gpus.index": INT32_MAX,
    "register.inventory.gpus.memory_bytes": INT64_MAX,
    "xid.gpu_index": INT32_MAX,
    "xid.xid": INT32_MAX,
}
"""Largest value of the integer columns an agent's unsigned fields are stored in."""


def check_agent_message(message: Message, *, path: str = "", skip: str = "") -> None:
    """Raise InvalidArgument for the first field of `message` that cannot be stored.

    `path` is where `message` sits in an AgentMessage ("" for a whole one, e.g.
    "heartbeat.health" for a heartbeat's health checked on its own); the field at path
    `skip` is left out (a part checked before, its bytes unchanged since).

    Every field is walked by a plan made once per message type (`_plan`): the fields
    that can hold something PostgreSQL refuses (strings, times, the bounded integers),
    read by name. An 8-GPU node's heartbeat took about 130 µs through `ListFields` and
    takes about 50 µs so (20 µs without its unchanged health, see `skip`): ingest
    checks every message a recovery's burst brings."""
    plan = _plan(cast(Descriptor, message.DESCRIPTOR), path)
    if skip:
        plan = tuple(f for f in plan if f.key != skip)
    _walk(message, plan, path)


@dataclass(frozen=True)
class _Field:
    name: str
    key: str
    """The field's path without indexes, as MAX_LENGTH and MAX_INTEGER name it."""
    kind: str
    """"str", "int", "time", "msg", "map", or "none" (a map's key or value that needs no
    check)."""
    repeated: bool
    limit: int | None = None
    entry: tuple[_Field, _Field] | None = None
    """A map's key and value fields."""
    descriptor: Descriptor | None = None
    """A message field's type."""


_PLANS: dict[tuple[str, str], tuple[_Field, ...]] = {}


def _plan(descriptor: Descriptor, key: str) -> tuple[_Field, ...]:
    """The fields of `descriptor` (reached by path `key`) worth checking, made once."""
    found = _PLANS.get((descriptor.full_name, key))
    if found is None:
        found = _PLANS[descriptor.full_name, key] = tuple(
            f
            for field in descriptor.fields
            if (f := _field(field, f"{key}.{field.name}" if key else field.name)) is not None
        )
    return found


def _field(field: FieldDescriptor, key: str) -> _Field | None:
    repeated = field.is_repeated
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        parts = (
            _field(entry.fields_by_name["key"], key),
            _field(entry.fields_by_name["value"], key),
        )
        if parts[0] is None and parts[1] is None:
            return None
        return _Field(field.name, key, "map", False, entry=_entry(parts, key))
    if entry is not None:
        kind = "time" if entry.full_name == _TIMESTAMP else "msg"
        return _Field(field.name, key, kind, repeated, descriptor=entry)
    if field.type == FieldDescriptor.TYPE_STRING:
        return _Field(field.name, key, "str", repeated, limit=MAX_LENGTH.get(key))
    if key in MAX_INTEGER:
        return _Field(field.name, key, "int", repeated, limit=MAX_INTEGER[key])
    return None


def _entry(parts: tuple[_Field | None, _Field | None], key: str) -> tuple[_Field, _Field]:
    """A map entry's key and value checks; a part with nothing to check checks nothing."""
    nothing = _Field("", key, "none", False)
    return (parts[0] or nothing, parts[1] or nothing)


def _walk(message: Message, plan: tuple[_Field, ...], path: str) -> None:
    for field in plan:
        name = f"{path}.{field.name}" if path else field.name
        if field.kind == "map":
            assert field.entry is not None
            key_check, value_check = field.entry
            for k, v in getattr(message, field.name).items():
                _value(key_check, k, f"{name}[{k!r}] (key)")
                _value(value_check, v, f"{name}[{k!r}]")
        elif field.repeated:
            for index, item in enumerate(getattr(message, field.name)):
                _value(field, item, f"{name}[{index}]")
        elif field.kind not in ("msg", "time") or message.HasField(field.name):
            _value(field, getattr(message, field.name), name)


def _value(field: _Field, value: Any, name: str) -> None:
    kind = field.kind
    if kind == "str":
        if not value:
            return
        if "\x00" in value:
            raise InvalidArgument(name, value, "remove the NUL character")
        if field.limit is not None and len(value) > field.limit:
            raise InvalidArgument(name, value, f"must be at most {field.limit} characters")
    elif kind == "int":
        if field.limit is not None and value > field.limit:
            raise InvalidArgument(name, value, f"must be at most {field.limit}")
    elif kind == "time":
        if (wrong := timestamps.out_of_range(value)) is not None:
            raise InvalidArgument(name, wrong, timestamps.FIX)
    elif kind == "msg":
        assert field.descriptor is not None
        _walk(value, _plan(field.descriptor, field.key), name)


MAX_RECENT_EXITS = 1024
"""The most exits a Register may report again (an agent keeps 256)."""


def check_recent_exits(exits: Sized) -> None:
    """A Register's `recent_exits`: each is looked up as it registers, so not too many."""
    if len(exits) > MAX_RECENT_EXITS:
        raise InvalidArgument(
            "register.recent_exits",
            len(exits),
            f"send the exits of the last minutes, {MAX_RECENT_EXITS} at most",
        )


def check_step_summary(summary: Message) -> None:
    """The few fields of a StepSummary that can reach PostgreSQL or a key: its job id
    (a Redis key, a lookup) and where a rank restored from (an event's words). A summary
    goes to Redis as its bytes and its numbers are only compared and summed, so the walk
    over every window and time (most of what ingest spent per summary) is left out."""
    job_id = getattr(summary, "job_id", "")
    if "\x00" in job_id or len(job_id) > MAX_LENGTH["rank_exited.job_id"]:
        raise InvalidArgument(
            "step_summary.job_id", job_id, "send the job's id (32 characters at most)"
        )
    for index, told in enumerate(getattr(summary, "restored", ())):
        source = told.restored_from
        if "\x00" in source or len(source) > 64:
            raise InvalidArgument(
                f"step_summary.restored[{index}].restored_from",
                source,
                "name where the rank restored from in 64 characters, without NUL",
            )
