"""What an agent may send, checked before anything of it is stored: a value PostgreSQL
cannot hold (a NUL character, a string wider than its column, an integer beyond its
column, a time outside years 1-9999) is refused as INVALID_ARGUMENT naming the field, the
value and the fix, instead of failing the write as an internal error."""

from __future__ import annotations

from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from pitstop.scheduler.errors import InvalidArgument

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_SECONDS = (-62_135_596_800, 253_402_300_799)
"""0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z, the range protobuf's Timestamp allows."""

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


def check_agent_message(message: Message) -> None:
    """Raise InvalidArgument for the first field of `message` that cannot be stored."""
    _check(message, "", "")


def _check(message: Message, path: str, key: str) -> None:
    for field, value in message.ListFields():
        name = f"{path}.{field.name}" if path else field.name
        field_key = f"{key}.{field.name}" if key else field.name
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for k, v in value.items():
                _value(key_field, k, f"{name}[{k!r}] (key)", field_key)
                _value(value_field, v, f"{name}[{k!r}]", field_key)
        elif field.is_repeated:
            for index, item in enumerate(value):
                _value(field, item, f"{name}[{index}]", field_key)
        else:
            _value(field, value, name, field_key)


def _value(field: FieldDescriptor, value: object, name: str, key: str) -> None:
    if isinstance(value, timestamp_pb2.Timestamp):
        seconds, nanos = value.seconds, value.nanos
        if not _SECONDS[0] <= seconds <= _SECONDS[1] or not 0 <= nanos < 10**9:
            raise InvalidArgument(
                name, f"{seconds}s {nanos}ns", "send a time between years 1 and 9999 (UTC)"
            )
    elif isinstance(value, Message):
        _check(value, name, key)
    elif isinstance(value, str):
        if "\x00" in value:
            raise InvalidArgument(name, value, "remove the NUL character")
        limit = MAX_LENGTH.get(key)
        if limit is not None and len(value) > limit:
            raise InvalidArgument(name, value, f"must be at most {limit} characters")
    elif isinstance(value, int) and not isinstance(value, bool):
        high = MAX_INTEGER.get(key)
        if high is not None and value > high:
            raise InvalidArgument(name, value, f"must be at most {high}")
