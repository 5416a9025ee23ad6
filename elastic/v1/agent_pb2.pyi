from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("local_rank", "rank", "pid", "state", "last_step", "step_rate", "heartbeat_age_s", "exit_code")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_RATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    rank: int
    pid: int
    state: str
    last_step: int
    step_rate: float
    heartbeat_age_s: float
    exit_code: int
    def __init__(self, local_rank: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., last_step: _Optional[int] = ..., step_rate: _Optional[float] = ..., heartbeat_age_s: _Optional[float] = ..., exit_code: _Optional[int] = ...) -> None: ...

class AgentStatusResponse(_message.Message):
    __slots__ = ("job_id", "node_id", "state", "round", "node_rank", "world_size", "workers", "restarts", "last_failure", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    state: str
    round: int
    node_rank: int
    world_size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    restarts: int
    last_failure: str
    version: str
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[str] = ..., round: _Optional[int] = ..., node_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., restarts: _Optional[int] = ..., last_failure: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class AgentDrainRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentDrainResponse(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class AgentRequestRestartRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentStoreHealthRequest(_message.Message):
    __slots__ = ("asker_has_store", "asker")
    ASKER_HAS_STORE_FIELD_NUMBER: _ClassVar[int]
    ASKER_FIELD_NUMBER: _ClassVar[int]
    asker_has_store: bool
    asker: str
    def __init__(self, asker_has_store: _Optional[bool] = ..., asker: _Optional[str] = ...) -> None: ...

class AgentStoreHealthResponse(_message.Message):
    __slots__ = ("reachable", "confirmed_age_s", "workers_running")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_AGE_S_FIELD_NUMBER: _ClassVar[int]
    WORKERS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    confirmed_age_s: float
    workers_running: bool
    def __init__(self, reachable: _Optional[bool] = ..., confirmed_age_s: _Optional[float] = ..., workers_running: _Optional[bool] = ...) -> None: ...

class AgentRequestRestartResponse(_message.Message):
    __slots__ = ("accepted", "round")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    round: int
    def __init__(self, accepted: _Optional[bool] = ..., round: _Optional[int] = ...) -> None: ...

class WorkerChannelHeartbeatRequest(_message.Message):
    __slots__ = ("rank", "local_rank", "pid", "round", "step", "saving_for_s", "exiting")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAVING_FOR_S_FIELD_NUMBER: _ClassVar[int]
    EXITING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pid: int
    round: int
    step: int
    saving_for_s: float
    exiting: bool
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., saving_for_s: _Optional[float] = ..., exiting: _Optional[bool] = ...) -> None: ...

class WorkerChannelHeartbeatResponse(_message.Message):
    __slots__ = ("stop_requested", "hold")
    STOP_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    stop_requested: bool
    hold: bool
    def __init__(self, stop_requested: _Optional[bool] = ..., hold: _Optional[bool] = ...) -> None: ...

class CheckpointEntry(_message.Message):
    __slots__ = ("step", "round", "world_size", "path", "time", "save_s", "size_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    SAVE_S_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    round: int
    world_size: int
    path: str
    time: float
    save_s: float
    size_bytes: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., world_size: _Optional[int] = ..., path: _Optional[str] = ..., time: _Optional[float] = ..., save_s: _Optional[float] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class WorkerChannelCommitCheckpointRequest(_message.Message):
    __slots__ = ("entry",)
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    entry: CheckpointEntry
    def __init__(self, entry: _Optional[_Union[CheckpointEntry, _Mapping]] = ...) -> None: ...

class WorkerChannelCommitCheckpointResponse(_message.Message):
    __slots__ = ("committed", "message")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    message: str
    def __init__(self, committed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerChannelLatestCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerChannelLatestCheckpointResponse(_message.Message):
    __slots__ = ("found", "entry")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    found: bool
    entry: CheckpointEntry
    def __init__(self, found: _Optional[bool] = ..., entry: _Optional[_Union[CheckpointEntry, _Mapping]] = ...) -> None: ...

class WorkerChannelReportCheckpointFailureRequest(_message.Message):
    __slots__ = ("step", "round", "rank", "message")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    round: int
    rank: int
    message: str
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerChannelReportCheckpointFailureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerChannelReportRestoreRequest(_message.Message):
    __slots__ = ("step", "round", "rank", "restore_s", "size_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    round: int
    rank: int
    restore_s: float
    size_bytes: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., restore_s: _Optional[float] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class WorkerChannelReportRestoreResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
