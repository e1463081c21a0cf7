import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from pitstop.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ApiTokenSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    API_TOKEN_SOURCE_UNSPECIFIED: _ClassVar[ApiTokenSource]
    API_TOKEN_SOURCE_CONFIG: _ClassVar[ApiTokenSource]
    API_TOKEN_SOURCE_API: _ClassVar[ApiTokenSource]
API_TOKEN_SOURCE_UNSPECIFIED: ApiTokenSource
API_TOKEN_SOURCE_CONFIG: ApiTokenSource
API_TOKEN_SOURCE_API: ApiTokenSource

class Node(_message.Message):
    __slots__ = ("id", "role", "state", "reason", "labels", "inventory", "health", "connected", "last_heartbeat", "registered_at", "xid_history", "job_ids", "standby_job_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    XID_HISTORY_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: _common_pb2.NodeRole
    state: _common_pb2.NodeState
    reason: str
    labels: _common_pb2.TopologyLabels
    inventory: _common_pb2.Inventory
    health: _common_pb2.NodeHealth
    connected: bool
    last_heartbeat: _timestamp_pb2.Timestamp
    registered_at: _timestamp_pb2.Timestamp
    xid_history: _containers.RepeatedCompositeFieldContainer[_common_pb2.XidEvent]
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    standby_job_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.NodeRole, str]] = ..., state: _Optional[_Union[_common_pb2.NodeState, str]] = ..., reason: _Optional[str] = ..., labels: _Optional[_Union[_common_pb2.TopologyLabels, _Mapping]] = ..., inventory: _Optional[_Union[_common_pb2.Inventory, _Mapping]] = ..., health: _Optional[_Union[_common_pb2.NodeHealth, _Mapping]] = ..., connected: _Optional[bool] = ..., last_heartbeat: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., xid_history: _Optional[_Iterable[_Union[_common_pb2.XidEvent, _Mapping]]] = ..., job_ids: _Optional[_Iterable[str]] = ..., standby_job_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("states", "roles")
    STATES_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.NodeState]
    roles: _containers.RepeatedScalarFieldContainer[_common_pb2.NodeRole]
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.NodeState, str]]] = ..., roles: _Optional[_Iterable[_Union[_common_pb2.NodeRole, str]]] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class NodeControlRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SetNodeRoleRequest(_message.Message):
    __slots__ = ("node_id", "role", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: _common_pb2.NodeRole
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.NodeRole, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class InjectFaultRequest(_message.Message):
    __slots__ = ("node_id", "fault")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    fault: _common_pb2.Fault
    def __init__(self, node_id: _Optional[str] = ..., fault: _Optional[_Union[_common_pb2.Fault, _Mapping]] = ...) -> None: ...

class InjectFaultResponse(_message.Message):
    __slots__ = ("command_id",)
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    def __init__(self, command_id: _Optional[int] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "after_event_id", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    after_event_id: int
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., after_event_id: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.Event]
    def __init__(self, events: _Optional[_Iterable[_Union[_common_pb2.Event, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "after_event_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    after_event_id: int
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., after_event_id: _Optional[int] = ...) -> None: ...

class CreateJoinTokenRequest(_message.Message):
    __slots__ = ("ttl_seconds", "node_id")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    node_id: str
    def __init__(self, ttl_seconds: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class CreateJoinTokenResponse(_message.Message):
    __slots__ = ("token", "expires_at", "node_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at: _timestamp_pb2.Timestamp
    node_id: str
    def __init__(self, token: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., node_id: _Optional[str] = ...) -> None: ...

class ApiToken(_message.Message):
    __slots__ = ("name", "role", "source", "created_at", "created_by", "expires_at", "revoked_at", "revoked_by", "projects")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_BY_FIELD_NUMBER: _ClassVar[int]
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: _common_pb2.Role
    source: ApiTokenSource
    created_at: _timestamp_pb2.Timestamp
    created_by: str
    expires_at: _timestamp_pb2.Timestamp
    revoked_at: _timestamp_pb2.Timestamp
    revoked_by: str
    projects: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., source: _Optional[_Union[ApiTokenSource, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., created_by: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revoked_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revoked_by: _Optional[str] = ..., projects: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateApiTokenRequest(_message.Message):
    __slots__ = ("name", "role", "ttl_seconds", "projects")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: _common_pb2.Role
    ttl_seconds: int
    projects: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., ttl_seconds: _Optional[int] = ..., projects: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateApiTokenResponse(_message.Message):
    __slots__ = ("token", "record")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    token: str
    record: ApiToken
    def __init__(self, token: _Optional[str] = ..., record: _Optional[_Union[ApiToken, _Mapping]] = ...) -> None: ...

class ListApiTokensRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListApiTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[ApiToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[ApiToken, _Mapping]]] = ...) -> None: ...

class RevokeApiTokenRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...
