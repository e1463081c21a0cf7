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

class ShardTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_TIER_UNSPECIFIED: _ClassVar[ShardTier]
    SHARD_TIER_LOCAL: _ClassVar[ShardTier]
    SHARD_TIER_REPLICA: _ClassVar[ShardTier]
    SHARD_TIER_DURABLE: _ClassVar[ShardTier]
SHARD_TIER_UNSPECIFIED: ShardTier
SHARD_TIER_LOCAL: ShardTier
SHARD_TIER_REPLICA: ShardTier
SHARD_TIER_DURABLE: ShardTier

class ShardKey(_message.Message):
    __slots__ = ("job_id", "rank", "step", "generation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    step: int
    generation: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ShardHeader(_message.Message):
    __slots__ = ("key", "size_bytes", "checksum", "checksum_algorithm", "origin_node_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    size_bytes: int
    checksum: str
    checksum_algorithm: str
    origin_node_id: str
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[str] = ..., checksum_algorithm: _Optional[str] = ..., origin_node_id: _Optional[str] = ...) -> None: ...

class ShardChunk(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushShardResponse(_message.Message):
    __slots__ = ("stored", "error")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    error: str
    def __init__(self, stored: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class PullShardRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("header", "tier", "time")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    tier: ShardTier
    time: _timestamp_pb2.Timestamp
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., tier: _Optional[_Union[ShardTier, str]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class AcquireSlotRequest(_message.Message):
    __slots__ = ("key", "size_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    size_bytes: int
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class AcquireSlotResponse(_message.Message):
    __slots__ = ("shm_name", "size_bytes", "refused")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size_bytes: int
    refused: str
    def __init__(self, shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class SealSlotRequest(_message.Message):
    __slots__ = ("key", "shm_name", "size_bytes", "next_size_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    shm_name: str
    size_bytes: int
    next_size_bytes: int
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., next_size_bytes: _Optional[int] = ...) -> None: ...

class SealSlotResponse(_message.Message):
    __slots__ = ("catalog_address", "buddy_address", "next_slot")
    CATALOG_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUDDY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SLOT_FIELD_NUMBER: _ClassVar[int]
    catalog_address: str
    buddy_address: str
    next_slot: AcquireSlotResponse
    def __init__(self, catalog_address: _Optional[str] = ..., buddy_address: _Optional[str] = ..., next_slot: _Optional[_Union[AcquireSlotResponse, _Mapping]] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("header", "shm_name", "source")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    shm_name: str
    source: ShardTier
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., shm_name: _Optional[str] = ..., source: _Optional[_Union[ShardTier, str]] = ...) -> None: ...

class ReportShardsRequest(_message.Message):
    __slots__ = ("node_id", "added", "removed", "flush_errors", "fresh_start", "removed_durable", "buddy_node_id", "held_jobs")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FLUSH_ERRORS_FIELD_NUMBER: _ClassVar[int]
    FRESH_START_FIELD_NUMBER: _ClassVar[int]
    REMOVED_DURABLE_FIELD_NUMBER: _ClassVar[int]
    BUDDY_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_JOBS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    added: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    removed: _containers.RepeatedCompositeFieldContainer[ShardKey]
    flush_errors: _containers.RepeatedScalarFieldContainer[str]
    fresh_start: bool
    removed_durable: _containers.RepeatedCompositeFieldContainer[ShardKey]
    buddy_node_id: str
    held_jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., added: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., removed: _Optional[_Iterable[_Union[ShardKey, _Mapping]]] = ..., flush_errors: _Optional[_Iterable[str]] = ..., fresh_start: _Optional[bool] = ..., removed_durable: _Optional[_Iterable[_Union[ShardKey, _Mapping]]] = ..., buddy_node_id: _Optional[str] = ..., held_jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportShardsResponse(_message.Message):
    __slots__ = ("committed_steps", "buddy_unfit", "ended_jobs")
    class CommittedStepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COMMITTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    BUDDY_UNFIT_FIELD_NUMBER: _ClassVar[int]
    ENDED_JOBS_FIELD_NUMBER: _ClassVar[int]
    committed_steps: _containers.ScalarMap[str, int]
    buddy_unfit: bool
    ended_jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, committed_steps: _Optional[_Mapping[str, int]] = ..., buddy_unfit: _Optional[bool] = ..., ended_jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBuddyRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class GetBuddyResponse(_message.Message):
    __slots__ = ("buddy_node_id", "buddy_address")
    BUDDY_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BUDDY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    buddy_node_id: str
    buddy_address: str
    def __init__(self, buddy_node_id: _Optional[str] = ..., buddy_address: _Optional[str] = ...) -> None: ...

class GetRestorePointRequest(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class GetRestorePointResponse(_message.Message):
    __slots__ = ("committed_step", "durable_step", "locations", "member_node_ids")
    class LocationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ShardLocations
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[ShardLocations, _Mapping]] = ...) -> None: ...
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    DURABLE_STEP_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    committed_step: int
    durable_step: int
    locations: _containers.MessageMap[int, ShardLocations]
    member_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, committed_step: _Optional[int] = ..., durable_step: _Optional[int] = ..., locations: _Optional[_Mapping[int, ShardLocations]] = ..., member_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ShardLocations(_message.Message):
    __slots__ = ("node_ids", "addresses")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...
