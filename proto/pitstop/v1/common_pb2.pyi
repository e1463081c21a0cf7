import datetime

from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_VIEWER: _ClassVar[Role]
    ROLE_OPERATOR: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]
    ROLE_AGENT: _ClassVar[Role]
    ROLE_PUBLIC: _ClassVar[Role]

class NodeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_ROLE_UNSPECIFIED: _ClassVar[NodeRole]
    NODE_ROLE_WORKER: _ClassVar[NodeRole]
    NODE_ROLE_SPARE: _ClassVar[NodeRole]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_READY: _ClassVar[NodeState]
    NODE_STATE_CORDONED: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_UNHEALTHY: _ClassVar[NodeState]
    NODE_STATE_LOST: _ClassVar[NodeState]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_PLACED: _ClassVar[JobState]
    JOB_STATE_STARTING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RECOVERING: _ClassVar[JobState]
    JOB_STATE_PAUSED: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class HealthVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_VERDICT_UNSPECIFIED: _ClassVar[HealthVerdict]
    HEALTH_VERDICT_HEALTHY: _ClassVar[HealthVerdict]
    HEALTH_VERDICT_APPLICATION: _ClassVar[HealthVerdict]
    HEALTH_VERDICT_WARNING: _ClassVar[HealthVerdict]
    HEALTH_VERDICT_FATAL: _ClassVar[HealthVerdict]
    HEALTH_VERDICT_DEGRADED: _ClassVar[HealthVerdict]

class RecoveryAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_ACTION_UNSPECIFIED: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_NOT_SUPPORTED: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_NONE: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_GPU_RESET: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_NODE_REBOOT: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_DRAIN_P2P: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_DRAIN_AND_RESET: _ClassVar[RecoveryAction]

class XidSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    XID_SOURCE_UNSPECIFIED: _ClassVar[XidSource]
    XID_SOURCE_NVML_EVENT: _ClassVar[XidSource]
    XID_SOURCE_KERNEL_LOG: _ClassVar[XidSource]
    XID_SOURCE_SIMULATED: _ClassVar[XidSource]
ROLE_UNSPECIFIED: Role
ROLE_VIEWER: Role
ROLE_OPERATOR: Role
ROLE_ADMIN: Role
ROLE_AGENT: Role
ROLE_PUBLIC: Role
NODE_ROLE_UNSPECIFIED: NodeRole
NODE_ROLE_WORKER: NodeRole
NODE_ROLE_SPARE: NodeRole
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_READY: NodeState
NODE_STATE_CORDONED: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_UNHEALTHY: NodeState
NODE_STATE_LOST: NodeState
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_PLACED: JobState
JOB_STATE_STARTING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RECOVERING: JobState
JOB_STATE_PAUSED: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
HEALTH_VERDICT_UNSPECIFIED: HealthVerdict
HEALTH_VERDICT_HEALTHY: HealthVerdict
HEALTH_VERDICT_APPLICATION: HealthVerdict
HEALTH_VERDICT_WARNING: HealthVerdict
HEALTH_VERDICT_FATAL: HealthVerdict
HEALTH_VERDICT_DEGRADED: HealthVerdict
RECOVERY_ACTION_UNSPECIFIED: RecoveryAction
RECOVERY_ACTION_NOT_SUPPORTED: RecoveryAction
RECOVERY_ACTION_NONE: RecoveryAction
RECOVERY_ACTION_GPU_RESET: RecoveryAction
RECOVERY_ACTION_NODE_REBOOT: RecoveryAction
RECOVERY_ACTION_DRAIN_P2P: RecoveryAction
RECOVERY_ACTION_DRAIN_AND_RESET: RecoveryAction
XID_SOURCE_UNSPECIFIED: XidSource
XID_SOURCE_NVML_EVENT: XidSource
XID_SOURCE_KERNEL_LOG: XidSource
XID_SOURCE_SIMULATED: XidSource
REQUIRED_ROLE_FIELD_NUMBER: _ClassVar[int]
required_role: _descriptor.FieldDescriptor

class TopologyLabels(_message.Message):
    __slots__ = ("zone", "block", "rack", "nvlink_domain")
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    zone: str
    block: str
    rack: str
    nvlink_domain: str
    def __init__(self, zone: _Optional[str] = ..., block: _Optional[str] = ..., rack: _Optional[str] = ..., nvlink_domain: _Optional[str] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_bytes", "pci_bus_id", "fabric_cluster_uuid", "fabric_clique_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    FABRIC_CLUSTER_UUID_FIELD_NUMBER: _ClassVar[int]
    FABRIC_CLIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_bytes: int
    pci_bus_id: str
    fabric_cluster_uuid: str
    fabric_clique_id: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., fabric_cluster_uuid: _Optional[str] = ..., fabric_clique_id: _Optional[int] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("hostname", "driver_version", "gpus", "agent_version", "gpu_backend", "checkpointd_address")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPU_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    driver_version: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    agent_version: str
    gpu_backend: str
    checkpointd_address: str
    def __init__(self, hostname: _Optional[str] = ..., driver_version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., agent_version: _Optional[str] = ..., gpu_backend: _Optional[str] = ..., checkpointd_address: _Optional[str] = ...) -> None: ...

class NvLinkStatus(_message.Message):
    __slots__ = ("link", "active", "crc_errors", "replay_errors", "recovery_errors")
    LINK_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    CRC_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ERRORS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_ERRORS_FIELD_NUMBER: _ClassVar[int]
    link: int
    active: bool
    crc_errors: int
    replay_errors: int
    recovery_errors: int
    def __init__(self, link: _Optional[int] = ..., active: _Optional[bool] = ..., crc_errors: _Optional[int] = ..., replay_errors: _Optional[int] = ..., recovery_errors: _Optional[int] = ...) -> None: ...

class GpuHealth(_message.Message):
    __slots__ = ("index", "uuid", "temperature_c", "power_w", "ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate", "ecc_uncorrected_aggregate", "remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending", "remapped_rows_failure", "retired_pages_single_bit", "retired_pages_double_bit", "retired_pages_pending", "clock_event_reasons", "nvlinks", "pcie_replay_counter", "pcie_link_gen", "pcie_link_gen_max", "pcie_link_width", "pcie_link_width_max", "recovery_action", "lost", "verdict", "reasons", "unsupported", "utilization_percent", "memory_used_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_VOLATILE_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_VOLATILE_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_CORRECTABLE_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_UNCORRECTABLE_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_PENDING_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_SINGLE_BIT_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_DOUBLE_BIT_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_PENDING_FIELD_NUMBER: _ClassVar[int]
    CLOCK_EVENT_REASONS_FIELD_NUMBER: _ClassVar[int]
    NVLINKS_FIELD_NUMBER: _ClassVar[int]
    PCIE_REPLAY_COUNTER_FIELD_NUMBER: _ClassVar[int]
    PCIE_LINK_GEN_FIELD_NUMBER: _ClassVar[int]
    PCIE_LINK_GEN_MAX_FIELD_NUMBER: _ClassVar[int]
    PCIE_LINK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PCIE_LINK_WIDTH_MAX_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_ACTION_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    temperature_c: float
    power_w: float
    ecc_corrected_volatile: int
    ecc_uncorrected_volatile: int
    ecc_corrected_aggregate: int
    ecc_uncorrected_aggregate: int
    remapped_rows_correctable: int
    remapped_rows_uncorrectable: int
    remapped_rows_pending: bool
    remapped_rows_failure: bool
    retired_pages_single_bit: int
    retired_pages_double_bit: int
    retired_pages_pending: bool
    clock_event_reasons: int
    nvlinks: _containers.RepeatedCompositeFieldContainer[NvLinkStatus]
    pcie_replay_counter: int
    pcie_link_gen: int
    pcie_link_gen_max: int
    pcie_link_width: int
    pcie_link_width_max: int
    recovery_action: RecoveryAction
    lost: bool
    verdict: HealthVerdict
    reasons: _containers.RepeatedScalarFieldContainer[str]
    unsupported: _containers.RepeatedScalarFieldContainer[str]
    utilization_percent: float
    memory_used_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., ecc_corrected_volatile: _Optional[int] = ..., ecc_uncorrected_volatile: _Optional[int] = ..., ecc_corrected_aggregate: _Optional[int] = ..., ecc_uncorrected_aggregate: _Optional[int] = ..., remapped_rows_correctable: _Optional[int] = ..., remapped_rows_uncorrectable: _Optional[int] = ..., remapped_rows_pending: _Optional[bool] = ..., remapped_rows_failure: _Optional[bool] = ..., retired_pages_single_bit: _Optional[int] = ..., retired_pages_double_bit: _Optional[int] = ..., retired_pages_pending: _Optional[bool] = ..., clock_event_reasons: _Optional[int] = ..., nvlinks: _Optional[_Iterable[_Union[NvLinkStatus, _Mapping]]] = ..., pcie_replay_counter: _Optional[int] = ..., pcie_link_gen: _Optional[int] = ..., pcie_link_gen_max: _Optional[int] = ..., pcie_link_width: _Optional[int] = ..., pcie_link_width_max: _Optional[int] = ..., recovery_action: _Optional[_Union[RecoveryAction, str]] = ..., lost: _Optional[bool] = ..., verdict: _Optional[_Union[HealthVerdict, str]] = ..., reasons: _Optional[_Iterable[str]] = ..., unsupported: _Optional[_Iterable[str]] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ...) -> None: ...

class NodeHealth(_message.Message):
    __slots__ = ("verdict", "reasons", "gpus", "host")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    verdict: HealthVerdict
    reasons: _containers.RepeatedScalarFieldContainer[str]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuHealth]
    host: HostHealth
    def __init__(self, verdict: _Optional[_Union[HealthVerdict, str]] = ..., reasons: _Optional[_Iterable[str]] = ..., gpus: _Optional[_Iterable[_Union[GpuHealth, _Mapping]]] = ..., host: _Optional[_Union[HostHealth, _Mapping]] = ...) -> None: ...

class LinkReading(_message.Message):
    __slots__ = ("name", "kind", "up", "rate_gbps", "down_count", "error_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    RATE_GBPS_FIELD_NUMBER: _ClassVar[int]
    DOWN_COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    up: bool
    rate_gbps: float
    down_count: int
    error_count: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., up: _Optional[bool] = ..., rate_gbps: _Optional[float] = ..., down_count: _Optional[int] = ..., error_count: _Optional[int] = ...) -> None: ...

class MemoryReading(_message.Message):
    __slots__ = ("pressure_full_avg10", "edac_corrected", "edac_uncorrected", "oom_kills", "last_oom_killed")
    PRESSURE_FULL_AVG10_FIELD_NUMBER: _ClassVar[int]
    EDAC_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    EDAC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLS_FIELD_NUMBER: _ClassVar[int]
    LAST_OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    pressure_full_avg10: float
    edac_corrected: int
    edac_uncorrected: int
    oom_kills: int
    last_oom_killed: str
    def __init__(self, pressure_full_avg10: _Optional[float] = ..., edac_corrected: _Optional[int] = ..., edac_uncorrected: _Optional[int] = ..., oom_kills: _Optional[int] = ..., last_oom_killed: _Optional[str] = ...) -> None: ...

class DiskReading(_message.Message):
    __slots__ = ("path", "free_bytes", "total_bytes", "free_inodes", "total_inodes", "read_only")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_INODES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_INODES_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    path: str
    free_bytes: int
    total_bytes: int
    free_inodes: int
    total_inodes: int
    read_only: bool
    def __init__(self, path: _Optional[str] = ..., free_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., free_inodes: _Optional[int] = ..., total_inodes: _Optional[int] = ..., read_only: _Optional[bool] = ...) -> None: ...

class PcieDeviceReading(_message.Message):
    __slots__ = ("address", "role", "aer_correctable", "aer_nonfatal", "aer_fatal", "link_width", "link_width_max", "link_speed_gts", "link_speed_gts_max")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    AER_CORRECTABLE_FIELD_NUMBER: _ClassVar[int]
    AER_NONFATAL_FIELD_NUMBER: _ClassVar[int]
    AER_FATAL_FIELD_NUMBER: _ClassVar[int]
    LINK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LINK_WIDTH_MAX_FIELD_NUMBER: _ClassVar[int]
    LINK_SPEED_GTS_FIELD_NUMBER: _ClassVar[int]
    LINK_SPEED_GTS_MAX_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    aer_correctable: int
    aer_nonfatal: int
    aer_fatal: int
    link_width: int
    link_width_max: int
    link_speed_gts: float
    link_speed_gts_max: float
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., aer_correctable: _Optional[int] = ..., aer_nonfatal: _Optional[int] = ..., aer_fatal: _Optional[int] = ..., link_width: _Optional[int] = ..., link_width_max: _Optional[int] = ..., link_speed_gts: _Optional[float] = ..., link_speed_gts_max: _Optional[float] = ...) -> None: ...

class HostHealth(_message.Message):
    __slots__ = ("verdict", "reasons", "links", "memory", "disks", "pcie", "unsupported")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DISKS_FIELD_NUMBER: _ClassVar[int]
    PCIE_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    verdict: HealthVerdict
    reasons: _containers.RepeatedScalarFieldContainer[str]
    links: _containers.RepeatedCompositeFieldContainer[LinkReading]
    memory: MemoryReading
    disks: _containers.RepeatedCompositeFieldContainer[DiskReading]
    pcie: _containers.RepeatedCompositeFieldContainer[PcieDeviceReading]
    unsupported: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, verdict: _Optional[_Union[HealthVerdict, str]] = ..., reasons: _Optional[_Iterable[str]] = ..., links: _Optional[_Iterable[_Union[LinkReading, _Mapping]]] = ..., memory: _Optional[_Union[MemoryReading, _Mapping]] = ..., disks: _Optional[_Iterable[_Union[DiskReading, _Mapping]]] = ..., pcie: _Optional[_Iterable[_Union[PcieDeviceReading, _Mapping]]] = ..., unsupported: _Optional[_Iterable[str]] = ...) -> None: ...

class XidEvent(_message.Message):
    __slots__ = ("gpu_index", "gpu_uuid", "xid", "message", "time", "source", "verdict")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    gpu_uuid: str
    xid: int
    message: str
    time: _timestamp_pb2.Timestamp
    source: XidSource
    verdict: HealthVerdict
    def __init__(self, gpu_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., xid: _Optional[int] = ..., message: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., source: _Optional[_Union[XidSource, str]] = ..., verdict: _Optional[_Union[HealthVerdict, str]] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("gpu_index", "xid", "ecc_double_bit", "pending_row_remap", "gpu_lost", "thermal_throttle", "nvlink_errors", "slow_multiplier", "clear", "sdc", "nan", "hang", "fail_preflight", "host")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    ECC_DOUBLE_BIT_FIELD_NUMBER: _ClassVar[int]
    PENDING_ROW_REMAP_FIELD_NUMBER: _ClassVar[int]
    GPU_LOST_FIELD_NUMBER: _ClassVar[int]
    THERMAL_THROTTLE_FIELD_NUMBER: _ClassVar[int]
    NVLINK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SLOW_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    SDC_FIELD_NUMBER: _ClassVar[int]
    NAN_FIELD_NUMBER: _ClassVar[int]
    HANG_FIELD_NUMBER: _ClassVar[int]
    FAIL_PREFLIGHT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    xid: int
    ecc_double_bit: int
    pending_row_remap: bool
    gpu_lost: bool
    thermal_throttle: bool
    nvlink_errors: NvLinkFault
    slow_multiplier: float
    clear: bool
    sdc: bool
    nan: bool
    hang: bool
    fail_preflight: bool
    host: HostFault
    def __init__(self, gpu_index: _Optional[int] = ..., xid: _Optional[int] = ..., ecc_double_bit: _Optional[int] = ..., pending_row_remap: _Optional[bool] = ..., gpu_lost: _Optional[bool] = ..., thermal_throttle: _Optional[bool] = ..., nvlink_errors: _Optional[_Union[NvLinkFault, _Mapping]] = ..., slow_multiplier: _Optional[float] = ..., clear: _Optional[bool] = ..., sdc: _Optional[bool] = ..., nan: _Optional[bool] = ..., hang: _Optional[bool] = ..., fail_preflight: _Optional[bool] = ..., host: _Optional[_Union[HostFault, _Mapping]] = ...) -> None: ...

class HostFault(_message.Message):
    __slots__ = ("link_down", "link_up", "link_flap", "link_errors", "link_degraded", "oom", "disk_full", "pcie_aer", "pcie_degraded", "clear", "edac_corrected", "edac_uncorrected", "memory_pressure_percent", "disk_read_only", "pcie")
    LINK_DOWN_FIELD_NUMBER: _ClassVar[int]
    LINK_UP_FIELD_NUMBER: _ClassVar[int]
    LINK_FLAP_FIELD_NUMBER: _ClassVar[int]
    LINK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LINK_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    OOM_FIELD_NUMBER: _ClassVar[int]
    DISK_FULL_FIELD_NUMBER: _ClassVar[int]
    PCIE_AER_FIELD_NUMBER: _ClassVar[int]
    PCIE_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    EDAC_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    EDAC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PRESSURE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    PCIE_FIELD_NUMBER: _ClassVar[int]
    link_down: str
    link_up: str
    link_flap: PortCount
    link_errors: PortCount
    link_degraded: PortRate
    oom: bool
    disk_full: bool
    pcie_aer: int
    pcie_degraded: bool
    clear: bool
    edac_corrected: int
    edac_uncorrected: int
    memory_pressure_percent: float
    disk_read_only: bool
    pcie: PcieFault
    def __init__(self, link_down: _Optional[str] = ..., link_up: _Optional[str] = ..., link_flap: _Optional[_Union[PortCount, _Mapping]] = ..., link_errors: _Optional[_Union[PortCount, _Mapping]] = ..., link_degraded: _Optional[_Union[PortRate, _Mapping]] = ..., oom: _Optional[bool] = ..., disk_full: _Optional[bool] = ..., pcie_aer: _Optional[int] = ..., pcie_degraded: _Optional[bool] = ..., clear: _Optional[bool] = ..., edac_corrected: _Optional[int] = ..., edac_uncorrected: _Optional[int] = ..., memory_pressure_percent: _Optional[float] = ..., disk_read_only: _Optional[bool] = ..., pcie: _Optional[_Union[PcieFault, _Mapping]] = ...) -> None: ...

class PcieFault(_message.Message):
    __slots__ = ("role", "fatal", "nonfatal", "correctable", "degraded")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    NONFATAL_FIELD_NUMBER: _ClassVar[int]
    CORRECTABLE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    role: str
    fatal: int
    nonfatal: int
    correctable: int
    degraded: bool
    def __init__(self, role: _Optional[str] = ..., fatal: _Optional[int] = ..., nonfatal: _Optional[int] = ..., correctable: _Optional[int] = ..., degraded: _Optional[bool] = ...) -> None: ...

class PortCount(_message.Message):
    __slots__ = ("port", "count")
    PORT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    port: str
    count: int
    def __init__(self, port: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class PortRate(_message.Message):
    __slots__ = ("port", "rate_gbps")
    PORT_FIELD_NUMBER: _ClassVar[int]
    RATE_GBPS_FIELD_NUMBER: _ClassVar[int]
    port: str
    rate_gbps: float
    def __init__(self, port: _Optional[str] = ..., rate_gbps: _Optional[float] = ...) -> None: ...

class NvLinkFault(_message.Message):
    __slots__ = ("link", "crc_errors", "down")
    LINK_FIELD_NUMBER: _ClassVar[int]
    CRC_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    link: int
    crc_errors: int
    down: bool
    def __init__(self, link: _Optional[int] = ..., crc_errors: _Optional[int] = ..., down: _Optional[bool] = ...) -> None: ...

class RankAssignment(_message.Message):
    __slots__ = ("rank", "node_id", "gpu_index", "local_rank", "dp", "pp", "tp")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    gpu_index: int
    local_rank: int
    dp: int
    pp: int
    tp: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., gpu_index: _Optional[int] = ..., local_rank: _Optional[int] = ..., dp: _Optional[int] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ...) -> None: ...

class RankMap(_message.Message):
    __slots__ = ("generation", "world_size", "ranks", "dp_size", "pp_size", "tp_size", "node_local", "digest")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_LOCAL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    generation: int
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankAssignment]
    dp_size: int
    pp_size: int
    tp_size: int
    node_local: bool
    digest: str
    def __init__(self, generation: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankAssignment, _Mapping]]] = ..., dp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., node_local: _Optional[bool] = ..., digest: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "time", "kind", "job_id", "node_id", "from_state", "to_state", "reason", "actor", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    time: _timestamp_pb2.Timestamp
    kind: str
    job_id: str
    node_id: str
    from_state: str
    to_state: str
    reason: str
    actor: str
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kind: _Optional[str] = ..., job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., from_state: _Optional[str] = ..., to_state: _Optional[str] = ..., reason: _Optional[str] = ..., actor: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...
