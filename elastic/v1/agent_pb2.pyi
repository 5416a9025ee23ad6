from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentCollectStacksRequest(_message.Message):
    __slots__ = ["round"]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class AgentCollectStacksResponse(_message.Message):
    __slots__ = ["ranks"]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankStack]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankStack, _Mapping]]] = ...) -> None: ...

class AgentDrainRequest(_message.Message):
    __slots__ = ["reason"]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentDrainResponse(_message.Message):
    __slots__ = ["accepted", "message"]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: bool = ..., message: _Optional[str] = ...) -> None: ...

class AgentReplicateRequest(_message.Message):
    __slots__ = ["begin", "data", "file", "finish", "job_id", "offset", "round", "slot", "source", "total_bytes"]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    begin: bool
    data: bytes
    file: str
    finish: bool
    job_id: str
    offset: int
    round: int
    slot: str
    source: str
    total_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., source: _Optional[str] = ..., round: _Optional[int] = ..., slot: _Optional[str] = ..., begin: bool = ..., total_bytes: _Optional[int] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., finish: bool = ...) -> None: ...

class AgentReplicateResponse(_message.Message):
    __slots__ = ["free_bytes"]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    free_bytes: int
    def __init__(self, free_bytes: _Optional[int] = ...) -> None: ...

class AgentRequestRestartRequest(_message.Message):
    __slots__ = ["reason"]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AgentRequestRestartResponse(_message.Message):
    __slots__ = ["accepted", "round"]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    round: int
    def __init__(self, accepted: bool = ..., round: _Optional[int] = ...) -> None: ...

class AgentStatusRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class AgentStatusResponse(_message.Message):
    __slots__ = ["job_id", "last_failure", "memory_tier", "node_id", "node_rank", "restarts", "round", "state", "stragglers", "version", "workers", "world_size"]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    last_failure: str
    memory_tier: MemoryTierStatus
    node_id: str
    node_rank: int
    restarts: int
    round: int
    state: str
    stragglers: _containers.RepeatedCompositeFieldContainer[StragglerStatus]
    version: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    world_size: int
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[str] = ..., round: _Optional[int] = ..., node_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., restarts: _Optional[int] = ..., last_failure: _Optional[str] = ..., version: _Optional[str] = ..., memory_tier: _Optional[_Union[MemoryTierStatus, _Mapping]] = ..., stragglers: _Optional[_Iterable[_Union[StragglerStatus, _Mapping]]] = ...) -> None: ...

class AgentStoreHealthRequest(_message.Message):
    __slots__ = ["asker", "asker_has_store"]
    ASKER_FIELD_NUMBER: _ClassVar[int]
    ASKER_HAS_STORE_FIELD_NUMBER: _ClassVar[int]
    asker: str
    asker_has_store: bool
    def __init__(self, asker_has_store: bool = ..., asker: _Optional[str] = ...) -> None: ...

class AgentStoreHealthResponse(_message.Message):
    __slots__ = ["confirmed_age_s", "reachable", "workers_running"]
    CONFIRMED_AGE_S_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    confirmed_age_s: float
    reachable: bool
    workers_running: bool
    def __init__(self, reachable: bool = ..., confirmed_age_s: _Optional[float] = ..., workers_running: bool = ...) -> None: ...

class CheckpointEntry(_message.Message):
    __slots__ = ["path", "round", "save_s", "size_bytes", "step", "time", "world_size"]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SAVE_S_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    round: int
    save_s: float
    size_bytes: int
    step: int
    time: float
    world_size: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., world_size: _Optional[int] = ..., path: _Optional[str] = ..., time: _Optional[float] = ..., save_s: _Optional[float] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class MemoryTierStatus(_message.Message):
    __slots__ = ["acked_step", "buddy", "free_bytes", "lag_steps", "need_bytes", "newest_own_step", "own_bytes", "own_slots", "replica_bytes", "replica_slots", "replica_source", "replication_bytes_per_s"]
    ACKED_STEP_FIELD_NUMBER: _ClassVar[int]
    BUDDY_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAG_STEPS_FIELD_NUMBER: _ClassVar[int]
    NEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEWEST_OWN_STEP_FIELD_NUMBER: _ClassVar[int]
    OWN_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    acked_step: int
    buddy: str
    free_bytes: int
    lag_steps: int
    need_bytes: int
    newest_own_step: int
    own_bytes: int
    own_slots: int
    replica_bytes: int
    replica_slots: int
    replica_source: str
    replication_bytes_per_s: float
    def __init__(self, own_bytes: _Optional[int] = ..., own_slots: _Optional[int] = ..., replica_bytes: _Optional[int] = ..., replica_slots: _Optional[int] = ..., replica_source: _Optional[str] = ..., buddy: _Optional[str] = ..., newest_own_step: _Optional[int] = ..., acked_step: _Optional[int] = ..., lag_steps: _Optional[int] = ..., need_bytes: _Optional[int] = ..., replication_bytes_per_s: _Optional[float] = ..., free_bytes: _Optional[int] = ...) -> None: ...

class RankStack(_message.Message):
    __slots__ = ["collective", "dumped", "entered_ns", "node_id", "place", "progress_age_s", "rank", "step"]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    DUMPED_FIELD_NUMBER: _ClassVar[int]
    ENTERED_NS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    collective: str
    dumped: bool
    entered_ns: int
    node_id: str
    place: str
    progress_age_s: float
    rank: int
    step: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., dumped: bool = ..., place: _Optional[str] = ..., collective: _Optional[str] = ..., step: _Optional[int] = ..., progress_age_s: _Optional[float] = ..., entered_ns: _Optional[int] = ...) -> None: ...

class StragglerStatus(_message.Message):
    __slots__ = ["action", "measure", "node_id", "peers_s", "rank", "slow_for_s", "step_s"]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_S_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SLOW_FOR_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    action: str
    measure: str
    node_id: str
    peers_s: float
    rank: int
    slow_for_s: float
    step_s: float
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., step_s: _Optional[float] = ..., peers_s: _Optional[float] = ..., slow_for_s: _Optional[float] = ..., action: _Optional[str] = ..., measure: _Optional[str] = ...) -> None: ...

class WorkerChannelCommitCheckpointRequest(_message.Message):
    __slots__ = ["entry"]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    entry: CheckpointEntry
    def __init__(self, entry: _Optional[_Union[CheckpointEntry, _Mapping]] = ...) -> None: ...

class WorkerChannelCommitCheckpointResponse(_message.Message):
    __slots__ = ["committed", "message"]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    message: str
    def __init__(self, committed: bool = ..., message: _Optional[str] = ...) -> None: ...

class WorkerChannelHeartbeatRequest(_message.Message):
    __slots__ = ["exiting", "local_rank", "pid", "rank", "round", "saving_for_s", "snapshots", "step", "step_busy_s", "step_time_s"]
    EXITING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SAVING_FOR_S_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    STEP_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    exiting: bool
    local_rank: int
    pid: int
    rank: int
    round: int
    saving_for_s: float
    snapshots: int
    step: int
    step_busy_s: float
    step_time_s: float
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., saving_for_s: _Optional[float] = ..., exiting: bool = ..., step_time_s: _Optional[float] = ..., step_busy_s: _Optional[float] = ..., snapshots: _Optional[int] = ...) -> None: ...

class WorkerChannelHeartbeatResponse(_message.Message):
    __slots__ = ["hold", "stop_requested"]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    STOP_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    hold: bool
    stop_requested: bool
    def __init__(self, stop_requested: bool = ..., hold: bool = ...) -> None: ...

class WorkerChannelLatestCheckpointRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class WorkerChannelLatestCheckpointResponse(_message.Message):
    __slots__ = ["entry", "found"]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    entry: CheckpointEntry
    found: bool
    def __init__(self, found: bool = ..., entry: _Optional[_Union[CheckpointEntry, _Mapping]] = ...) -> None: ...

class WorkerChannelReportCheckpointFailureRequest(_message.Message):
    __slots__ = ["message", "rank", "round", "step"]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    message: str
    rank: int
    round: int
    step: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerChannelReportCheckpointFailureResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class WorkerChannelReportRestoreRequest(_message.Message):
    __slots__ = ["rank", "restore_s", "round", "size_bytes", "step"]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    restore_s: float
    round: int
    size_bytes: int
    step: int
    def __init__(self, step: _Optional[int] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., restore_s: _Optional[float] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class WorkerChannelReportRestoreResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ["exit_code", "heartbeat_age_s", "judged", "last_step", "local_rank", "pid", "rank", "state", "step_rate"]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    JUDGED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_RATE_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    heartbeat_age_s: float
    judged: bool
    last_step: int
    local_rank: int
    pid: int
    rank: int
    state: str
    step_rate: float
    def __init__(self, local_rank: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., last_step: _Optional[int] = ..., step_rate: _Optional[float] = ..., heartbeat_age_s: _Optional[float] = ..., exit_code: _Optional[int] = ..., judged: bool = ...) -> None: ...
