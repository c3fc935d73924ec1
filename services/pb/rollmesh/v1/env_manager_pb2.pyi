from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StartRequest(_message.Message):
    __slots__ = ("num_workers",)
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    def __init__(self, num_workers: _Optional[int] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: bool
    def __init__(self, started: _Optional[bool] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("drain", "timeout_s")
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    timeout_s: float
    def __init__(self, drain: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("episodes_abandoned",)
    EPISODES_ABANDONED_FIELD_NUMBER: _ClassVar[int]
    episodes_abandoned: int
    def __init__(self, episodes_abandoned: _Optional[int] = ...) -> None: ...

class EnvStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvStats(_message.Message):
    __slots__ = ("running", "workers", "episodes_running", "episodes_finished", "trajectories_put", "groups_put", "failures_by_reason")
    class FailuresByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_RUNNING_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_PUT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PUT_FIELD_NUMBER: _ClassVar[int]
    FAILURES_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    running: bool
    workers: int
    episodes_running: int
    episodes_finished: int
    trajectories_put: int
    groups_put: int
    failures_by_reason: _containers.ScalarMap[str, int]
    def __init__(self, running: _Optional[bool] = ..., workers: _Optional[int] = ..., episodes_running: _Optional[int] = ..., episodes_finished: _Optional[int] = ..., trajectories_put: _Optional[int] = ..., groups_put: _Optional[int] = ..., failures_by_reason: _Optional[_Mapping[str, int]] = ...) -> None: ...
