from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AdmitRequest(_message.Message):
    __slots__ = ("num_groups", "holder", "held")
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    num_groups: int
    holder: str
    held: int
    def __init__(self, num_groups: _Optional[int] = ..., holder: _Optional[str] = ..., held: _Optional[int] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("num_admitted", "version", "capacity", "async_ratio", "groups_per_step")
    NUM_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ASYNC_RATIO_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    num_admitted: int
    version: int
    capacity: int
    async_ratio: int
    groups_per_step: int
    def __init__(self, num_admitted: _Optional[int] = ..., version: _Optional[int] = ..., capacity: _Optional[int] = ..., async_ratio: _Optional[int] = ..., groups_per_step: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("num_groups", "num_finished", "num_dropped", "holder", "held")
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    num_groups: int
    num_finished: int
    num_dropped: int
    holder: str
    held: int
    def __init__(self, num_groups: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_dropped: _Optional[int] = ..., holder: _Optional[str] = ..., held: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BeginUpdateRequest(_message.Message):
    __slots__ = ("new_version", "timeout_s", "supersede")
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDE_FIELD_NUMBER: _ClassVar[int]
    new_version: int
    timeout_s: float
    supersede: bool
    def __init__(self, new_version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., supersede: _Optional[bool] = ...) -> None: ...

class BeginUpdateResponse(_message.Message):
    __slots__ = ("update_id",)
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    def __init__(self, update_id: _Optional[str] = ...) -> None: ...

class CommitUpdateRequest(_message.Message):
    __slots__ = ("update_id", "version", "model_path")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    version: int
    model_path: str
    def __init__(self, update_id: _Optional[str] = ..., version: _Optional[int] = ..., model_path: _Optional[str] = ...) -> None: ...

class CommitUpdateResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class AbortUpdateRequest(_message.Message):
    __slots__ = ("update_id", "reason")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    reason: str
    def __init__(self, update_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortUpdateResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class WatchVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("version", "suspended")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    version: int
    suspended: bool
    def __init__(self, version: _Optional[int] = ..., suspended: _Optional[bool] = ...) -> None: ...
