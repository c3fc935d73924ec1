from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("groups", "timeout_s")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[bytes]
    timeout_s: float
    def __init__(self, groups: _Optional[_Iterable[bytes]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PutResult(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("num_groups", "version", "max_staleness", "timeout_s")
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    num_groups: int
    version: int
    max_staleness: int
    timeout_s: float
    def __init__(self, num_groups: _Optional[int] = ..., version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("batch_id", "groups", "num_dropped_stale")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    groups: _containers.RepeatedScalarFieldContainer[bytes]
    num_dropped_stale: int
    def __init__(self, batch_id: _Optional[str] = ..., groups: _Optional[_Iterable[bytes]] = ..., num_dropped_stale: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("num_acked",)
    NUM_ACKED_FIELD_NUMBER: _ClassVar[int]
    num_acked: int
    def __init__(self, num_acked: _Optional[int] = ...) -> None: ...

class RequeueRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequeueResponse(_message.Message):
    __slots__ = ("num_requeued",)
    NUM_REQUEUED_FIELD_NUMBER: _ClassVar[int]
    num_requeued: int
    def __init__(self, num_requeued: _Optional[int] = ...) -> None: ...

class BufferStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferStats(_message.Message):
    __slots__ = ("depth", "in_flight", "put_total", "consumed_total", "dropped_by_reason", "redelivered_total")
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PUT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    depth: int
    in_flight: int
    put_total: int
    consumed_total: int
    dropped_by_reason: _containers.ScalarMap[str, int]
    redelivered_total: int
    def __init__(self, depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., put_total: _Optional[int] = ..., consumed_total: _Optional[int] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ..., redelivered_total: _Optional[int] = ...) -> None: ...
