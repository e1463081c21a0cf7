"""Enum values as the lowercase words people type and read (``NODE_ROLE_SPARE`` <-> ``spare``)."""

from __future__ import annotations

from google.protobuf.descriptor import EnumDescriptor

from pitstop.v1 import common_pb2, jobs_pb2, nodes_pb2

JOB_STATES = common_pb2.JobState.DESCRIPTOR
NODE_STATES = common_pb2.NodeState.DESCRIPTOR
NODE_ROLES = common_pb2.NodeRole.DESCRIPTOR
VERDICTS = common_pb2.HealthVerdict.DESCRIPTOR
XID_SOURCES = common_pb2.XidSource.DESCRIPTOR
STRAGGLER_ACTIONS = jobs_pb2.StragglerAction.DESCRIPTOR
INCIDENT_KINDS = jobs_pb2.IncidentKind.DESCRIPTOR
INCIDENT_OUTCOMES = jobs_pb2.IncidentOutcome.DESCRIPTOR
ROLES = common_pb2.Role.DESCRIPTOR
API_TOKEN_SOURCES = nodes_pb2.ApiTokenSource.DESCRIPTOR


def enum_prefix(enum: EnumDescriptor) -> str:
    """The shared prefix of an enum's value names, e.g. ``"STRAGGLER_ACTION_"``."""
    zero = enum.values_by_number.get(0)
    if zero is not None and zero.name.endswith("UNSPECIFIED"):
        return zero.name[: -len("UNSPECIFIED")]
    return ""


def enum_word(enum: EnumDescriptor, value: int) -> str:
    """``JOB_STATE_RUNNING`` -> ``"running"``; an unknown number is shown as the number."""
    known = enum.values_by_number.get(value)
    if known is None:
        return str(value)
    return known.name.removeprefix(enum_prefix(enum)).lower()


def enum_words(enum: EnumDescriptor) -> list[str]:
    """Every meaningful value of an enum as a lowercase word (UNSPECIFIED left out)."""
    return [enum_word(enum, v.number) for v in enum.values if v.number != 0]


def lookup_enum_word(enum: EnumDescriptor, word: str) -> int | None:
    """``"spare"`` or ``"NODE_ROLE_SPARE"`` (any case) -> its number; None if unknown."""
    wanted = word.strip().upper()
    for candidate in (wanted, enum_prefix(enum) + wanted):
        known = enum.values_by_name.get(candidate)
        if known is not None and known.number != 0:
            return known.number
    return None


def parse_enum_word(enum: EnumDescriptor, word: str) -> int:
    """Like :func:`lookup_enum_word`, but a ValueError naming the choices when unknown."""
    number = lookup_enum_word(enum, word)
    if number is None:
        raise ValueError(f"{word!r} is not one of: {', '.join(enum_words(enum))}")
    return number
