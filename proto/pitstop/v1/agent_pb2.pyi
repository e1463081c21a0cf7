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

class FindingKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINDING_KIND_UNSPECIFIED: _ClassVar[FindingKind]
    FINDING_KIND_SDC: _ClassVar[FindingKind]
    FINDING_KIND_SDC_UNLOCATED: _ClassVar[FindingKind]
    FINDING_KIND_NONFINITE: _ClassVar[FindingKind]
    FINDING_KIND_SPIKE: _ClassVar[FindingKind]
FINDING_KIND_UNSPECIFIED: FindingKind
FINDING_KIND_SDC: FindingKind
FINDING_KIND_SDC_UNLOCATED: FindingKind
FINDING_KIND_NONFINITE: FindingKind
FINDING_KIND_SPIKE: FindingKind

class Register(_message.Message):
    __slots__ = ("node_id", "inventory", "labels", "requested_role", "running_ranks", "agent_started_at", "recent_exits")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_ROLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_RANKS_FIELD_NUMBER: _ClassVar[int]
    AGENT_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    RECENT_EXITS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    inventory: _common_pb2.Inventory
    labels: _common_pb2.TopologyLabels
    requested_role: _common_pb2.NodeRole
    running_ranks: _containers.RepeatedCompositeFieldContainer[RunningRank]
    agent_started_at: _timestamp_pb2.Timestamp
    recent_exits: _containers.RepeatedCompositeFieldContainer[RankExited]
    def __init__(self, node_id: _Optional[str] = ..., inventory: _Optional[_Union[_common_pb2.Inventory, _Mapping]] = ..., labels: _Optional[_Union[_common_pb2.TopologyLabels, _Mapping]] = ..., requested_role: _Optional[_Union[_common_pb2.NodeRole, str]] = ..., running_ranks: _Optional[_Iterable[_Union[RunningRank, _Mapping]]] = ..., agent_started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., recent_exits: _Optional[_Iterable[_Union[RankExited, _Mapping]]] = ...) -> None: ...

class RunningRank(_message.Message):
    __slots__ = ("job_id", "generation", "rank", "pid", "step", "standby", "ready")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    rank: int
    pid: int
    step: int
    standby: bool
    ready: bool
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., standby: _Optional[bool] = ..., ready: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("time", "health", "running_ranks")
    TIME_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_RANKS_FIELD_NUMBER: _ClassVar[int]
    time: _timestamp_pb2.Timestamp
    health: _common_pb2.NodeHealth
    running_ranks: _containers.RepeatedCompositeFieldContainer[RunningRank]
    def __init__(self, time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., health: _Optional[_Union[_common_pb2.NodeHealth, _Mapping]] = ..., running_ranks: _Optional[_Iterable[_Union[RunningRank, _Mapping]]] = ...) -> None: ...

class StepSample(_message.Message):
    __slots__ = ("rank", "step", "step_seconds", "loss", "tokens", "checkpoint_step", "time", "model_flops", "peak_flops", "restored_at", "restored_from", "grad_norm")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    step_seconds: float
    loss: float
    tokens: int
    checkpoint_step: bool
    time: _timestamp_pb2.Timestamp
    model_flops: float
    peak_flops: float
    restored_at: _timestamp_pb2.Timestamp
    restored_from: str
    grad_norm: float
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., step_seconds: _Optional[float] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., checkpoint_step: _Optional[bool] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., model_flops: _Optional[float] = ..., peak_flops: _Optional[float] = ..., restored_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., restored_from: _Optional[str] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class StepSummary(_message.Message):
    __slots__ = ("job_id", "generation", "node_id", "ranks", "slowest_step", "newest_step", "samples", "tokens", "model_flops", "peak_flops", "loss_step", "loss", "time", "windows", "restored", "grad_norm")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_STEP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    node_id: str
    ranks: int
    slowest_step: int
    newest_step: int
    samples: int
    tokens: int
    model_flops: float
    peak_flops: float
    loss_step: int
    loss: float
    time: _timestamp_pb2.Timestamp
    windows: _containers.RepeatedCompositeFieldContainer[RankWindow]
    restored: _containers.RepeatedCompositeFieldContainer[RankRestored]
    grad_norm: float
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., node_id: _Optional[str] = ..., ranks: _Optional[int] = ..., slowest_step: _Optional[int] = ..., newest_step: _Optional[int] = ..., samples: _Optional[int] = ..., tokens: _Optional[int] = ..., model_flops: _Optional[float] = ..., peak_flops: _Optional[float] = ..., loss_step: _Optional[int] = ..., loss: _Optional[float] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., windows: _Optional[_Iterable[_Union[RankWindow, _Mapping]]] = ..., restored: _Optional[_Iterable[_Union[RankRestored, _Mapping]]] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class StepSummaries(_message.Message):
    __slots__ = ("summaries",)
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    summaries: _containers.RepeatedCompositeFieldContainer[StepSummary]
    def __init__(self, summaries: _Optional[_Iterable[_Union[StepSummary, _Mapping]]] = ...) -> None: ...

class RankWindow(_message.Message):
    __slots__ = ("rank", "window", "steps", "timed", "median_seconds", "max_seconds", "first_step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TIMED_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    window: int
    steps: int
    timed: int
    median_seconds: float
    max_seconds: float
    first_step: int
    def __init__(self, rank: _Optional[int] = ..., window: _Optional[int] = ..., steps: _Optional[int] = ..., timed: _Optional[int] = ..., median_seconds: _Optional[float] = ..., max_seconds: _Optional[float] = ..., first_step: _Optional[int] = ...) -> None: ...

class RankRestored(_message.Message):
    __slots__ = ("rank", "restored_at", "restored_from")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTORED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    restored_at: _timestamp_pb2.Timestamp
    restored_from: str
    def __init__(self, rank: _Optional[int] = ..., restored_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., restored_from: _Optional[str] = ...) -> None: ...

class StepWindows(_message.Message):
    __slots__ = ("window_steps", "warmup_steps")
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    window_steps: int
    warmup_steps: int
    def __init__(self, window_steps: _Optional[int] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class RankExited(_message.Message):
    __slots__ = ("job_id", "generation", "rank", "exit_code", "signal", "time", "stderr_tail", "result", "cause")
    class ResultEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    rank: int
    exit_code: int
    signal: int
    time: _timestamp_pb2.Timestamp
    stderr_tail: str
    result: _containers.ScalarMap[str, str]
    cause: str
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stderr_tail: _Optional[str] = ..., result: _Optional[_Mapping[str, str]] = ..., cause: _Optional[str] = ...) -> None: ...

class IntegrityFinding(_message.Message):
    __slots__ = ("job_id", "generation", "rank", "kind", "step", "rolled_back_to", "skipped_step", "digest", "expected_digest", "ranks", "detail", "pause", "gpu_index")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_TO_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    rank: int
    kind: FindingKind
    step: int
    rolled_back_to: int
    skipped_step: int
    digest: str
    expected_digest: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    detail: str
    pause: bool
    gpu_index: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[FindingKind, str]] = ..., step: _Optional[int] = ..., rolled_back_to: _Optional[int] = ..., skipped_step: _Optional[int] = ..., digest: _Optional[str] = ..., expected_digest: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., detail: _Optional[str] = ..., pause: _Optional[bool] = ..., gpu_index: _Optional[int] = ...) -> None: ...

class RankStacks(_message.Message):
    __slots__ = ("job_id", "generation", "rank", "incident", "method", "text", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    rank: int
    incident: int
    method: str
    text: str
    error: str
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., incident: _Optional[int] = ..., method: _Optional[str] = ..., text: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class CommandAck(_message.Message):
    __slots__ = ("command_id", "ok", "error", "heartbeat")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    ok: bool
    error: str
    heartbeat: Heartbeat
    def __init__(self, command_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("seq", "register", "heartbeat", "xid", "step_summary", "rank_exited", "ack", "finding", "stacks", "run_record")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    STEP_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    RANK_EXITED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    RUN_RECORD_FIELD_NUMBER: _ClassVar[int]
    seq: int
    register: Register
    heartbeat: Heartbeat
    xid: _common_pb2.XidEvent
    step_summary: StepSummary
    rank_exited: RankExited
    ack: CommandAck
    finding: IntegrityFinding
    stacks: RankStacks
    run_record: RunRecord
    def __init__(self, seq: _Optional[int] = ..., register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., xid: _Optional[_Union[_common_pb2.XidEvent, _Mapping]] = ..., step_summary: _Optional[_Union[StepSummary, _Mapping]] = ..., rank_exited: _Optional[_Union[RankExited, _Mapping]] = ..., ack: _Optional[_Union[CommandAck, _Mapping]] = ..., finding: _Optional[_Union[IntegrityFinding, _Mapping]] = ..., stacks: _Optional[_Union[RankStacks, _Mapping]] = ..., run_record: _Optional[_Union[RunRecord, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("node_id", "heartbeat_interval_seconds", "role", "state", "refresh_interval_seconds", "step_report_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REFRESH_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_REPORT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_interval_seconds: float
    role: _common_pb2.NodeRole
    state: _common_pb2.NodeState
    refresh_interval_seconds: float
    step_report_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., role: _Optional[_Union[_common_pb2.NodeRole, str]] = ..., state: _Optional[_Union[_common_pb2.NodeState, str]] = ..., refresh_interval_seconds: _Optional[float] = ..., step_report_seconds: _Optional[float] = ...) -> None: ...

class StartRanks(_message.Message):
    __slots__ = ("job_id", "generation", "command", "env", "working_dir", "rank_map", "rendezvous_address", "restore_step", "standby_gpus", "beside_ranks", "step_windows", "preload_modules")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    RANK_MAP_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    STANDBY_GPUS_FIELD_NUMBER: _ClassVar[int]
    BESIDE_RANKS_FIELD_NUMBER: _ClassVar[int]
    STEP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    PRELOAD_MODULES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    working_dir: str
    rank_map: _common_pb2.RankMap
    rendezvous_address: str
    restore_step: int
    standby_gpus: _containers.RepeatedScalarFieldContainer[int]
    beside_ranks: bool
    step_windows: StepWindows
    preload_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., rank_map: _Optional[_Union[_common_pb2.RankMap, _Mapping]] = ..., rendezvous_address: _Optional[str] = ..., restore_step: _Optional[int] = ..., standby_gpus: _Optional[_Iterable[int]] = ..., beside_ranks: _Optional[bool] = ..., step_windows: _Optional[_Union[StepWindows, _Mapping]] = ..., preload_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class StopRanks(_message.Message):
    __slots__ = ("job_id", "ranks", "grace_seconds", "reason", "kill", "at_boundary")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KILL_FIELD_NUMBER: _ClassVar[int]
    AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    grace_seconds: float
    reason: str
    kill: bool
    at_boundary: bool
    def __init__(self, job_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., grace_seconds: _Optional[float] = ..., reason: _Optional[str] = ..., kill: _Optional[bool] = ..., at_boundary: _Optional[bool] = ...) -> None: ...

class Reconfigure(_message.Message):
    __slots__ = ("job_id", "generation", "rank_map", "rendezvous_address", "restore_step", "adopted_ranks", "step_windows", "skipped_steps")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_MAP_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    STEP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    rank_map: _common_pb2.RankMap
    rendezvous_address: str
    restore_step: int
    adopted_ranks: _containers.RepeatedScalarFieldContainer[int]
    step_windows: StepWindows
    skipped_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank_map: _Optional[_Union[_common_pb2.RankMap, _Mapping]] = ..., rendezvous_address: _Optional[str] = ..., restore_step: _Optional[int] = ..., adopted_ranks: _Optional[_Iterable[int]] = ..., step_windows: _Optional[_Union[StepWindows, _Mapping]] = ..., skipped_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class PauseJob(_message.Message):
    __slots__ = ("job_id", "generation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ResumeJob(_message.Message):
    __slots__ = ("job_id", "generation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class DrainNode(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DumpStacks(_message.Message):
    __slots__ = ("job_id", "generation", "incident")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    incident: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., incident: _Optional[int] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("command_id", "registered", "start_ranks", "stop_ranks", "reconfigure", "pause", "resume", "drain", "inject_fault", "dump_stacks", "reconfigure_kept")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    START_RANKS_FIELD_NUMBER: _ClassVar[int]
    STOP_RANKS_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    INJECT_FAULT_FIELD_NUMBER: _ClassVar[int]
    DUMP_STACKS_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_KEPT_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    registered: Registered
    start_ranks: StartRanks
    stop_ranks: StopRanks
    reconfigure: Reconfigure
    pause: PauseJob
    resume: ResumeJob
    drain: DrainNode
    inject_fault: _common_pb2.Fault
    dump_stacks: DumpStacks
    reconfigure_kept: Reconfigure
    def __init__(self, command_id: _Optional[int] = ..., registered: _Optional[_Union[Registered, _Mapping]] = ..., start_ranks: _Optional[_Union[StartRanks, _Mapping]] = ..., stop_ranks: _Optional[_Union[StopRanks, _Mapping]] = ..., reconfigure: _Optional[_Union[Reconfigure, _Mapping]] = ..., pause: _Optional[_Union[PauseJob, _Mapping]] = ..., resume: _Optional[_Union[ResumeJob, _Mapping]] = ..., drain: _Optional[_Union[DrainNode, _Mapping]] = ..., inject_fault: _Optional[_Union[_common_pb2.Fault, _Mapping]] = ..., dump_stacks: _Optional[_Union[DumpStacks, _Mapping]] = ..., reconfigure_kept: _Optional[_Union[Reconfigure, _Mapping]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("join_token", "node_id", "csr_pem")
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    join_token: str
    node_id: str
    csr_pem: str
    def __init__(self, join_token: _Optional[str] = ..., node_id: _Optional[str] = ..., csr_pem: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("certificate_pem", "ca_certificate_pem", "node_port")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    NODE_PORT_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: str
    ca_certificate_pem: str
    node_port: int
    def __init__(self, certificate_pem: _Optional[str] = ..., ca_certificate_pem: _Optional[str] = ..., node_port: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: str
    def __init__(self, csr_pem: _Optional[str] = ...) -> None: ...

class CodeVersion(_message.Message):
    __slots__ = ("git_commit", "dirty", "dirty_digest", "working_dir")
    GIT_COMMIT_FIELD_NUMBER: _ClassVar[int]
    DIRTY_FIELD_NUMBER: _ClassVar[int]
    DIRTY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    git_commit: str
    dirty: bool
    dirty_digest: str
    working_dir: str
    def __init__(self, git_commit: _Optional[str] = ..., dirty: _Optional[bool] = ..., dirty_digest: _Optional[str] = ..., working_dir: _Optional[str] = ...) -> None: ...

class EnvironmentVersion(_message.Message):
    __slots__ = ("python", "torch", "pitstop", "cuda", "nccl", "image", "env")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    PITSTOP_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    python: str
    torch: str
    pitstop: str
    cuda: str
    nccl: str
    image: str
    env: _containers.ScalarMap[str, str]
    def __init__(self, python: _Optional[str] = ..., torch: _Optional[str] = ..., pitstop: _Optional[str] = ..., cuda: _Optional[str] = ..., nccl: _Optional[str] = ..., image: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunRecord(_message.Message):
    __slots__ = ("job_id", "generation", "rank", "code", "environment", "data_digest", "data_source", "start_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    DATA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    rank: int
    code: CodeVersion
    environment: EnvironmentVersion
    data_digest: str
    data_source: str
    start_step: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., code: _Optional[_Union[CodeVersion, _Mapping]] = ..., environment: _Optional[_Union[EnvironmentVersion, _Mapping]] = ..., data_digest: _Optional[str] = ..., data_source: _Optional[str] = ..., start_step: _Optional[int] = ...) -> None: ...
