from pitstop.v1 import agent_pb2 as _agent_pb2
from pitstop.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankFault(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_FAULT_NONE: _ClassVar[RankFault]
    RANK_FAULT_SDC: _ClassVar[RankFault]
    RANK_FAULT_NAN: _ClassVar[RankFault]
    RANK_FAULT_HANG: _ClassVar[RankFault]
RANK_FAULT_NONE: RankFault
RANK_FAULT_SDC: RankFault
RANK_FAULT_NAN: RankFault
RANK_FAULT_HANG: RankFault

class AttachRequest(_message.Message):
    __slots__ = ("job_id", "rank", "generation", "pid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    generation: int
    pid: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("generation", "restore_step", "checkpointd_address", "slow_multiplier")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOW_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    generation: int
    restore_step: int
    checkpointd_address: str
    slow_multiplier: float
    def __init__(self, generation: _Optional[int] = ..., restore_step: _Optional[int] = ..., checkpointd_address: _Optional[str] = ..., slow_multiplier: _Optional[float] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("job_id", "rank", "generation", "sample")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    generation: int
    sample: _agent_pb2.StepSample
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., sample: _Optional[_Union[_agent_pb2.StepSample, _Mapping]] = ...) -> None: ...

class StepReportResponse(_message.Message):
    __slots__ = ("command_pending", "slow_multiplier", "rank_fault")
    COMMAND_PENDING_FIELD_NUMBER: _ClassVar[int]
    SLOW_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    RANK_FAULT_FIELD_NUMBER: _ClassVar[int]
    command_pending: bool
    slow_multiplier: float
    rank_fault: RankFault
    def __init__(self, command_pending: _Optional[bool] = ..., slow_multiplier: _Optional[float] = ..., rank_fault: _Optional[_Union[RankFault, str]] = ...) -> None: ...

class FindingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunRecordResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommandStreamRequest(_message.Message):
    __slots__ = ("job_id", "rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class RankCommand(_message.Message):
    __slots__ = ("command_id", "pause", "resume", "reconfigure", "stop")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    pause: _agent_pb2.PauseJob
    resume: _agent_pb2.ResumeJob
    reconfigure: _agent_pb2.Reconfigure
    stop: _agent_pb2.StopRanks
    def __init__(self, command_id: _Optional[int] = ..., pause: _Optional[_Union[_agent_pb2.PauseJob, _Mapping]] = ..., resume: _Optional[_Union[_agent_pb2.ResumeJob, _Mapping]] = ..., reconfigure: _Optional[_Union[_agent_pb2.Reconfigure, _Mapping]] = ..., stop: _Optional[_Union[_agent_pb2.StopRanks, _Mapping]] = ...) -> None: ...

class RankAck(_message.Message):
    __slots__ = ("job_id", "rank", "command_id", "ok", "error", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    command_id: int
    ok: bool
    error: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., command_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RankAckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StandbyRequest(_message.Message):
    __slots__ = ("job_id", "pid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    pid: int
    def __init__(self, job_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class StandbyAssignment(_message.Message):
    __slots__ = ("reconfigure", "rank", "local_rank", "gpu_index")
    RECONFIGURE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    reconfigure: _agent_pb2.Reconfigure
    rank: int
    local_rank: int
    gpu_index: int
    def __init__(self, reconfigure: _Optional[_Union[_agent_pb2.Reconfigure, _Mapping]] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., gpu_index: _Optional[int] = ...) -> None: ...

class RankResult(_message.Message):
    __slots__ = ("job_id", "rank", "result")
    class ResultEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    result: _containers.ScalarMap[str, str]
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., result: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RankResultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalFaultRequest(_message.Message):
    __slots__ = ("fault",)
    FAULT_FIELD_NUMBER: _ClassVar[int]
    fault: _common_pb2.Fault
    def __init__(self, fault: _Optional[_Union[_common_pb2.Fault, _Mapping]] = ...) -> None: ...

class LocalFaultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
