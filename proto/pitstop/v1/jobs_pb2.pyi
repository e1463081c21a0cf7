import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from pitstop.v1 import agent_pb2 as _agent_pb2
from pitstop.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StragglerAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRAGGLER_ACTION_UNSPECIFIED: _ClassVar[StragglerAction]
    STRAGGLER_ACTION_REPORT: _ClassVar[StragglerAction]
    STRAGGLER_ACTION_SWAP: _ClassVar[StragglerAction]

class IncidentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INCIDENT_KIND_UNSPECIFIED: _ClassVar[IncidentKind]
    INCIDENT_KIND_NODE: _ClassVar[IncidentKind]
    INCIDENT_KIND_RANK_EXIT: _ClassVar[IncidentKind]
    INCIDENT_KIND_FALLBACK: _ClassVar[IncidentKind]

class IncidentOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INCIDENT_OUTCOME_UNSPECIFIED: _ClassVar[IncidentOutcome]
    INCIDENT_OUTCOME_IN_PROGRESS: _ClassVar[IncidentOutcome]
    INCIDENT_OUTCOME_RESUMED: _ClassVar[IncidentOutcome]
    INCIDENT_OUTCOME_SUPERSEDED: _ClassVar[IncidentOutcome]
    INCIDENT_OUTCOME_JOB_FAILED: _ClassVar[IncidentOutcome]
    INCIDENT_OUTCOME_JOB_CANCELLED: _ClassVar[IncidentOutcome]
    INCIDENT_OUTCOME_JOB_SUCCEEDED: _ClassVar[IncidentOutcome]
STRAGGLER_ACTION_UNSPECIFIED: StragglerAction
STRAGGLER_ACTION_REPORT: StragglerAction
STRAGGLER_ACTION_SWAP: StragglerAction
INCIDENT_KIND_UNSPECIFIED: IncidentKind
INCIDENT_KIND_NODE: IncidentKind
INCIDENT_KIND_RANK_EXIT: IncidentKind
INCIDENT_KIND_FALLBACK: IncidentKind
INCIDENT_OUTCOME_UNSPECIFIED: IncidentOutcome
INCIDENT_OUTCOME_IN_PROGRESS: IncidentOutcome
INCIDENT_OUTCOME_RESUMED: IncidentOutcome
INCIDENT_OUTCOME_SUPERSEDED: IncidentOutcome
INCIDENT_OUTCOME_JOB_FAILED: IncidentOutcome
INCIDENT_OUTCOME_JOB_CANCELLED: IncidentOutcome
INCIDENT_OUTCOME_JOB_SUCCEEDED: IncidentOutcome

class CheckpointPolicy(_message.Message):
    __slots__ = ("snapshot_every_steps", "durable_every_steps", "durable_url", "keep_in_memory", "keep_durable", "auto_interval")
    SNAPSHOT_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_URL_FIELD_NUMBER: _ClassVar[int]
    KEEP_IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    KEEP_DURABLE_FIELD_NUMBER: _ClassVar[int]
    AUTO_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    snapshot_every_steps: int
    durable_every_steps: int
    durable_url: str
    keep_in_memory: int
    keep_durable: int
    auto_interval: bool
    def __init__(self, snapshot_every_steps: _Optional[int] = ..., durable_every_steps: _Optional[int] = ..., durable_url: _Optional[str] = ..., keep_in_memory: _Optional[int] = ..., keep_durable: _Optional[int] = ..., auto_interval: _Optional[bool] = ...) -> None: ...

class StragglerPolicy(_message.Message):
    __slots__ = ("action", "threshold", "windows", "window_steps", "warmup_steps")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    action: StragglerAction
    threshold: float
    windows: int
    window_steps: int
    warmup_steps: int
    def __init__(self, action: _Optional[_Union[StragglerAction, str]] = ..., threshold: _Optional[float] = ..., windows: _Optional[int] = ..., window_steps: _Optional[int] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class IntegrityPolicy(_message.Message):
    __slots__ = ("sdc_check_disabled", "spike_watch_disabled", "loss_window", "spike_sigma", "max_rollbacks", "hang_floor_seconds", "hang_step_multiple")
    SDC_CHECK_DISABLED_FIELD_NUMBER: _ClassVar[int]
    SPIKE_WATCH_DISABLED_FIELD_NUMBER: _ClassVar[int]
    LOSS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SPIKE_SIGMA_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    HANG_FLOOR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANG_STEP_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    sdc_check_disabled: bool
    spike_watch_disabled: bool
    loss_window: int
    spike_sigma: float
    max_rollbacks: int
    hang_floor_seconds: float
    hang_step_multiple: float
    def __init__(self, sdc_check_disabled: _Optional[bool] = ..., spike_watch_disabled: _Optional[bool] = ..., loss_window: _Optional[int] = ..., spike_sigma: _Optional[float] = ..., max_rollbacks: _Optional[int] = ..., hang_floor_seconds: _Optional[float] = ..., hang_step_multiple: _Optional[float] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "command", "tp", "pp", "dp", "gpus_per_node", "min_dp", "spares", "priority", "max_restarts", "checkpoint", "env", "straggler", "working_dir", "standby_processes", "integrity", "project", "preemptible", "min_run_seconds", "preload_modules")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    GPUS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MIN_DP_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    STANDBY_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    MIN_RUN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRELOAD_MODULES_FIELD_NUMBER: _ClassVar[int]
    name: str
    command: _containers.RepeatedScalarFieldContainer[str]
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    min_dp: int
    spares: int
    priority: int
    max_restarts: int
    checkpoint: CheckpointPolicy
    env: _containers.ScalarMap[str, str]
    straggler: StragglerPolicy
    working_dir: str
    standby_processes: bool
    integrity: IntegrityPolicy
    project: str
    preemptible: bool
    min_run_seconds: int
    preload_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., dp: _Optional[int] = ..., gpus_per_node: _Optional[int] = ..., min_dp: _Optional[int] = ..., spares: _Optional[int] = ..., priority: _Optional[int] = ..., max_restarts: _Optional[int] = ..., checkpoint: _Optional[_Union[CheckpointPolicy, _Mapping]] = ..., env: _Optional[_Mapping[str, str]] = ..., straggler: _Optional[_Union[StragglerPolicy, _Mapping]] = ..., working_dir: _Optional[str] = ..., standby_processes: _Optional[bool] = ..., integrity: _Optional[_Union[IntegrityPolicy, _Mapping]] = ..., project: _Optional[str] = ..., preemptible: _Optional[bool] = ..., min_run_seconds: _Optional[int] = ..., preload_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class Goodput(_message.Message):
    __slots__ = ("productive_seconds", "detect_seconds", "recovery_seconds", "recompute_seconds", "ratio", "recoveries", "incidents", "incident_count")
    PRODUCTIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DETECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    productive_seconds: float
    detect_seconds: float
    recovery_seconds: float
    recompute_seconds: float
    ratio: float
    recoveries: int
    incidents: _containers.RepeatedCompositeFieldContainer[GoodputIncident]
    incident_count: int
    def __init__(self, productive_seconds: _Optional[float] = ..., detect_seconds: _Optional[float] = ..., recovery_seconds: _Optional[float] = ..., recompute_seconds: _Optional[float] = ..., ratio: _Optional[float] = ..., recoveries: _Optional[int] = ..., incidents: _Optional[_Iterable[_Union[GoodputIncident, _Mapping]]] = ..., incident_count: _Optional[int] = ...) -> None: ...

class GoodputIncident(_message.Message):
    __slots__ = ("cause", "failed_at", "detect_seconds", "decide_seconds", "resume_seconds", "lost_steps", "resumed", "kind", "outcome", "detected_at", "decided_at", "resumed_at", "ended_at", "restored_at", "restore_seconds", "reform_seconds")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_FIELD_NUMBER: _ClassVar[int]
    DETECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECIDE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOST_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REFORM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    cause: str
    failed_at: float
    detect_seconds: float
    decide_seconds: float
    resume_seconds: float
    lost_steps: int
    resumed: bool
    kind: IncidentKind
    outcome: IncidentOutcome
    detected_at: float
    decided_at: float
    resumed_at: float
    ended_at: float
    restored_at: float
    restore_seconds: float
    reform_seconds: float
    def __init__(self, cause: _Optional[str] = ..., failed_at: _Optional[float] = ..., detect_seconds: _Optional[float] = ..., decide_seconds: _Optional[float] = ..., resume_seconds: _Optional[float] = ..., lost_steps: _Optional[int] = ..., resumed: _Optional[bool] = ..., kind: _Optional[_Union[IncidentKind, str]] = ..., outcome: _Optional[_Union[IncidentOutcome, str]] = ..., detected_at: _Optional[float] = ..., decided_at: _Optional[float] = ..., resumed_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., restored_at: _Optional[float] = ..., restore_seconds: _Optional[float] = ..., reform_seconds: _Optional[float] = ...) -> None: ...

class RankStepStats(_message.Message):
    __slots__ = ("rank", "node_id", "p50_seconds", "p99_seconds", "straggler")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    p50_seconds: float
    p99_seconds: float
    straggler: bool
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., p50_seconds: _Optional[float] = ..., p99_seconds: _Optional[float] = ..., straggler: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "spec", "state", "reason", "generation", "rank_map", "created_at", "updated_at", "restarts", "current_step", "committed_step", "durable_step", "goodput", "rank_stats", "result", "skipped_steps", "queue_position", "preemptions")
    class ResultEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_MAP_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    DURABLE_STEP_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    RANK_STATS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: JobSpec
    state: _common_pb2.JobState
    reason: str
    generation: int
    rank_map: _common_pb2.RankMap
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    restarts: int
    current_step: int
    committed_step: int
    durable_step: int
    goodput: Goodput
    rank_stats: _containers.RepeatedCompositeFieldContainer[RankStepStats]
    result: _containers.ScalarMap[str, str]
    skipped_steps: _containers.RepeatedScalarFieldContainer[int]
    queue_position: int
    preemptions: int
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., rank_map: _Optional[_Union[_common_pb2.RankMap, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., restarts: _Optional[int] = ..., current_step: _Optional[int] = ..., committed_step: _Optional[int] = ..., durable_step: _Optional[int] = ..., goodput: _Optional[_Union[Goodput, _Mapping]] = ..., rank_stats: _Optional[_Iterable[_Union[RankStepStats, _Mapping]]] = ..., result: _Optional[_Mapping[str, str]] = ..., skipped_steps: _Optional[_Iterable[int]] = ..., queue_position: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class GenerationRecord(_message.Message):
    __slots__ = ("generation", "recorded_at", "code", "environment", "data_digest", "data_source", "start_step", "node_id")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECORDED_AT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    DATA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    generation: int
    recorded_at: _timestamp_pb2.Timestamp
    code: _agent_pb2.CodeVersion
    environment: _agent_pb2.EnvironmentVersion
    data_digest: str
    data_source: str
    start_step: int
    node_id: str
    def __init__(self, generation: _Optional[int] = ..., recorded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., code: _Optional[_Union[_agent_pb2.CodeVersion, _Mapping]] = ..., environment: _Optional[_Union[_agent_pb2.EnvironmentVersion, _Mapping]] = ..., data_digest: _Optional[str] = ..., data_source: _Optional[str] = ..., start_step: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class DurableCheckpoint(_message.Message):
    __slots__ = ("step", "digest", "shards", "bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    digest: str
    shards: int
    bytes: int
    def __init__(self, step: _Optional[int] = ..., digest: _Optional[str] = ..., shards: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class PreemptionRecord(_message.Message):
    __slots__ = ("at", "by_job_id", "step")
    AT_FIELD_NUMBER: _ClassVar[int]
    BY_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    by_job_id: str
    step: int
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., by_job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class JobRecord(_message.Message):
    __slots__ = ("job_id", "spec", "state", "created_at", "submitted_by", "submitted_code", "generations", "durable_checkpoints", "goodput", "skipped_steps", "result", "final_weights_hash", "preemptions", "current_step")
    class ResultEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_CODE_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FINAL_WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: _common_pb2.JobState
    created_at: _timestamp_pb2.Timestamp
    submitted_by: str
    submitted_code: _agent_pb2.CodeVersion
    generations: _containers.RepeatedCompositeFieldContainer[GenerationRecord]
    durable_checkpoints: _containers.RepeatedCompositeFieldContainer[DurableCheckpoint]
    goodput: Goodput
    skipped_steps: _containers.RepeatedScalarFieldContainer[int]
    result: _containers.ScalarMap[str, str]
    final_weights_hash: str
    preemptions: _containers.RepeatedCompositeFieldContainer[PreemptionRecord]
    current_step: int
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., submitted_by: _Optional[str] = ..., submitted_code: _Optional[_Union[_agent_pb2.CodeVersion, _Mapping]] = ..., generations: _Optional[_Iterable[_Union[GenerationRecord, _Mapping]]] = ..., durable_checkpoints: _Optional[_Iterable[_Union[DurableCheckpoint, _Mapping]]] = ..., goodput: _Optional[_Union[Goodput, _Mapping]] = ..., skipped_steps: _Optional[_Iterable[int]] = ..., result: _Optional[_Mapping[str, str]] = ..., final_weights_hash: _Optional[str] = ..., preemptions: _Optional[_Iterable[_Union[PreemptionRecord, _Mapping]]] = ..., current_step: _Optional[int] = ...) -> None: ...

class JobRecordRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "request_id", "code")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    request_id: str
    code: _agent_pb2.CodeVersion
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., request_id: _Optional[str] = ..., code: _Optional[_Union[_agent_pb2.CodeVersion, _Mapping]] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobStacksRequest(_message.Message):
    __slots__ = ("job_id", "incident")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    incident: int
    def __init__(self, job_id: _Optional[str] = ..., incident: _Optional[int] = ...) -> None: ...

class JobStacksResponse(_message.Message):
    __slots__ = ("incident", "incidents", "stacks", "hung_ranks", "verdict")
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    HUNG_RANKS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    incident: int
    incidents: _containers.RepeatedScalarFieldContainer[int]
    stacks: _containers.RepeatedCompositeFieldContainer[_agent_pb2.RankStacks]
    hung_ranks: _containers.RepeatedScalarFieldContainer[int]
    verdict: str
    def __init__(self, incident: _Optional[int] = ..., incidents: _Optional[_Iterable[int]] = ..., stacks: _Optional[_Iterable[_Union[_agent_pb2.RankStacks, _Mapping]]] = ..., hung_ranks: _Optional[_Iterable[int]] = ..., verdict: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "page_size", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.JobState]
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.JobState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class JobControlRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_event_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_event_id: int
    def __init__(self, job_id: _Optional[str] = ..., after_event_id: _Optional[int] = ...) -> None: ...

class Project(_message.Message):
    __slots__ = ("name", "gpu_quota", "unlimited", "gpus_in_use", "pending_jobs", "updated_at", "updated_by")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    UNLIMITED_FIELD_NUMBER: _ClassVar[int]
    GPUS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    PENDING_JOBS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_BY_FIELD_NUMBER: _ClassVar[int]
    name: str
    gpu_quota: int
    unlimited: bool
    gpus_in_use: int
    pending_jobs: int
    updated_at: _timestamp_pb2.Timestamp
    updated_by: str
    def __init__(self, name: _Optional[str] = ..., gpu_quota: _Optional[int] = ..., unlimited: _Optional[bool] = ..., gpus_in_use: _Optional[int] = ..., pending_jobs: _Optional[int] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_by: _Optional[str] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("project", "gpus", "unlimited")
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    UNLIMITED_FIELD_NUMBER: _ClassVar[int]
    project: str
    gpus: int
    unlimited: bool
    def __init__(self, project: _Optional[str] = ..., gpus: _Optional[int] = ..., unlimited: _Optional[bool] = ...) -> None: ...

class ListProjectsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProjectsResponse(_message.Message):
    __slots__ = ("projects",)
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    projects: _containers.RepeatedCompositeFieldContainer[Project]
    def __init__(self, projects: _Optional[_Iterable[_Union[Project, _Mapping]]] = ...) -> None: ...
