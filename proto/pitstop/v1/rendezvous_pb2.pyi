from pitstop.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetRendezvousStateRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRendezvousStateResponse(_message.Message):
    __slots__ = ("found", "state", "token")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    found: bool
    state: bytes
    token: str
    def __init__(self, found: _Optional[bool] = ..., state: _Optional[bytes] = ..., token: _Optional[str] = ...) -> None: ...

class SetRendezvousStateRequest(_message.Message):
    __slots__ = ("run_id", "state", "token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: bytes
    token: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[bytes] = ..., token: _Optional[str] = ...) -> None: ...

class SetRendezvousStateResponse(_message.Message):
    __slots__ = ("state", "token", "stored")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    token: str
    stored: bool
    def __init__(self, state: _Optional[bytes] = ..., token: _Optional[str] = ..., stored: _Optional[bool] = ...) -> None: ...
