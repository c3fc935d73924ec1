from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RewardDescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardDescribeResponse(_message.Message):
    __slots__ = ("reward", "max_concurrent", "timeout_s")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    reward: str
    max_concurrent: int
    timeout_s: float
    def __init__(self, reward: _Optional[str] = ..., max_concurrent: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("response", "answer", "timeout_s", "request_id")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    response: str
    answer: str
    timeout_s: float
    request_id: str
    def __init__(self, response: _Optional[str] = ..., answer: _Optional[str] = ..., timeout_s: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("reward", "failure", "seconds")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    failure: str
    seconds: float
    def __init__(self, reward: _Optional[float] = ..., failure: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
