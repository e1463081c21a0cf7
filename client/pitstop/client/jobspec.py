"""Load a job spec from YAML into a ``pitstop.v1.JobSpec``.

The YAML's top-level keys are JobSpec's fields. Only the shape is checked here (known
fields, the right kinds of values); whether the values make sense (ranges, ``min_dp <=
dp``, ...) is the scheduler's call and comes back as INVALID_ARGUMENT.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import shlex
from typing import Any, cast

import yaml
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from pitstop.client.enums import enum_words, lookup_enum_word
from pitstop.v1 import jobs_pb2

_INT_RANGES = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
}
# The stubs type DESCRIPTOR as a union with the C implementation's class; both behave alike.
_JOB_SPEC = cast(Descriptor, jobs_pb2.JobSpec.DESCRIPTOR)
_FLOAT_TYPES = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


class JobSpecError(ValueError):
    """A job-spec file cannot be turned into a JobSpec.

    The message names the file, the field path (``spec.straggler.action``), the value
    and what to write instead.
    """


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice instead of keeping the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {json.dumps(key)} appears twice; give each field once",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_job_spec(path: str | os.PathLike[str]) -> jobs_pb2.JobSpec:
    """Read the YAML job spec at ``path``. Raises :class:`JobSpecError` on any problem."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as spec_file:
            text = spec_file.read()
    except OSError as error:
        raise JobSpecError(f"{source}: cannot read the job spec: {error.strerror}") from None
    except UnicodeDecodeError:
        raise JobSpecError(f"{source}: not a text file; a job spec is UTF-8 YAML") from None
    return parse_job_spec(text, source=source)


def parse_job_spec(text: str, source: str = "<job spec>") -> jobs_pb2.JobSpec:
    """Parse YAML text into a JobSpec; ``source`` names it in error messages."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as error:
        raise JobSpecError(f"{source}: {_describe_yaml_error(error)}") from None
    except yaml.YAMLError as error:
        raise JobSpecError(f"{source}: invalid YAML: {error}") from None
    if data is None:
        raise JobSpecError(
            f"{source}: the file is empty; write a mapping of JobSpec fields: "
            f"{_field_list(_JOB_SPEC)}"
        )
    if not isinstance(data, dict):
        raise JobSpecError(
            f"{source}: the top level is {_kind(data)}, not a mapping; write JobSpec fields "
            f"as keys: {_field_list(_JOB_SPEC)}"
        )
    converted = _Converter(source).message(data, _JOB_SPEC, "spec")
    spec = jobs_pb2.JobSpec()
    try:
        json_format.ParseDict(converted, spec)
    except json_format.ParseError as error:  # e.g. a lone surrogate protobuf cannot store
        raise JobSpecError(f"{source}: {error}") from None
    return spec


class _Converter:
    """Turns YAML values into the JSON shapes ParseDict takes, or a human error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, problem: str) -> JobSpecError:
        return JobSpecError(f"{self.source}: {path}: {problem}")

    def message(self, data: object, descriptor: Descriptor, path: str) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise self.fail(
                path,
                f"{_show(data)} is not a mapping; write its fields as keys: "
                f"{_field_list(descriptor)}",
            )
        fields = descriptor.fields_by_name
        out: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str) or key not in fields:
                raise self.fail(f"{path}.{key}", _unknown_field(str(key), descriptor))
            if value is None:  # `checkpoint:` with nothing under it means "use the defaults"
                continue
            out[key] = self.field(value, fields[key], f"{path}.{key}")
        return out

    def field(self, value: object, field: FieldDescriptor, path: str) -> Any:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            return self.map(value, field, path)
        if field.is_repeated:
            return self.repeated(value, field, path)
        return self.single(value, field, path)

    def map(self, value: object, field: FieldDescriptor, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"{_show(value)} is not a mapping; write it as KEY: value lines")
        value_field = _message_type(field).fields_by_name["value"]
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise self.fail(f"{path}.{key}", "keys must be strings; quote the key")
            out[key] = self.single(item, value_field, f"{path}.{key}", coerce_numbers=True)
        return out

    def repeated(self, value: object, field: FieldDescriptor, path: str) -> list[Any]:
        if isinstance(value, str) and field.type == FieldDescriptor.TYPE_STRING:
            # `command: python train.py --steps 10` reads like a shell line; split it so.
            try:
                return shlex.split(value)
            except ValueError as error:
                raise self.fail(
                    path, f"cannot split {_show(value)} into arguments ({error}); use a list"
                ) from None
        if not isinstance(value, list):
            raise self.fail(path, f"{_show(value)} is not a list; write it as [a, b, ...]")
        return [
            self.single(item, field, f"{path}[{index}]", coerce_numbers=True)
            for index, item in enumerate(value)
        ]

    def single(
        self, value: object, field: FieldDescriptor, path: str, coerce_numbers: bool = False
    ) -> Any:
        kind = field.type
        if kind == FieldDescriptor.TYPE_MESSAGE:
            return self.message(value, _message_type(field), path)
        if kind == FieldDescriptor.TYPE_ENUM and field.enum_type is not None:
            return self.enum(value, field.enum_type, path)
        if kind == FieldDescriptor.TYPE_STRING:
            return self.string(value, path, coerce_numbers)
        if kind == FieldDescriptor.TYPE_BOOL:
            if not isinstance(value, bool):
                raise self.fail(path, f"{_show(value)} is not true or false")
            return value
        if kind in _FLOAT_TYPES:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.fail(path, f"{_show(value)} is not a number; write e.g. 5 or 2.5")
            return float(value)
        if kind in _INT_RANGES:
            return self.integer(value, _INT_RANGES[kind], path)
        raise self.fail(path, f"fields of protobuf type {kind} are not supported in YAML")

    def string(self, value: object, path: str, coerce_numbers: bool) -> str:
        if isinstance(value, str):
            return value
        # A bare 100 in `command: [train.py, --steps, 100]` means the text "100"; a bare
        # true or a null is more likely a mistake, so those must be quoted.
        if coerce_numbers and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        example = f'"{_show(value)}"'
        if not path.endswith("]"):
            example = f"{path.rsplit('.', 1)[-1]}: {example}"
        raise self.fail(path, f"{_show(value)} is not a string; quote it: {example}")

    def integer(self, value: object, bounds: tuple[int, int], path: str) -> int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"{_show(value)} is not a whole number; write e.g. 2")
        low, high = bounds
        if value < low:
            hint = "write 0 or more" if low == 0 else f"the least is {low}"
            raise self.fail(path, f"{value} is out of range; {hint}")
        if value > high:
            raise self.fail(path, f"{value} is out of range; the most is {high}")
        return value

    def enum(self, value: object, enum: EnumDescriptor, path: str) -> str:
        number = lookup_enum_word(enum, value) if isinstance(value, str) else None
        if number is None:
            choices = ", ".join(enum_words(enum))
            raise self.fail(path, f"{_show(value)} is not a valid value; use one of: {choices}")
        return enum.values_by_number[number].name


def _message_type(field: FieldDescriptor) -> Descriptor:
    if field.message_type is None:
        raise TypeError(f"{field.full_name} is not a message field")
    return field.message_type


def _unknown_field(key: str, descriptor: Descriptor) -> str:
    names = [f.name for f in descriptor.fields]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown field{hint}; valid fields: {', '.join(names)}"


def _field_list(descriptor: Descriptor) -> str:
    return ", ".join(f.name for f in descriptor.fields)


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _show(value: object) -> str:
    """A value as the user would recognise it from their YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return str(value)
    shown = json.dumps(value, default=str, ensure_ascii=False)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _describe_yaml_error(error: yaml.MarkedYAMLError) -> str:
    mark = error.problem_mark or error.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = error.problem or error.context or "cannot parse"
    context = f" ({error.context})" if error.context and error.problem else ""
    return f"{where}invalid YAML: {problem}{context}"
