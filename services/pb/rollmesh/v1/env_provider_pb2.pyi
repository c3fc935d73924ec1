from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("name", "idempotent_steps", "max_sessions", "budgets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    idempotent_steps: bool
    max_sessions: int
    budgets: Budgets
    def __init__(self, name: _Optional[str] = ..., idempotent_steps: _Optional[bool] = ..., max_sessions: _Optional[int] = ..., budgets: _Optional[_Union[Budgets, _Mapping]] = ...) -> None: ...

class Budgets(_message.Message):
    __slots__ = ("step_s", "generation_s", "generation_tokens", "episode_s")
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_S_FIELD_NUMBER: _ClassVar[int]
    step_s: float
    generation_s: float
    generation_tokens: int
    episode_s: float
    def __init__(self, step_s: _Optional[float] = ..., generation_s: _Optional[float] = ..., generation_tokens: _Optional[int] = ..., episode_s: _Optional[float] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env_name", "seed", "config_json", "episode_id")
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    seed: int
    config_json: str
    episode_id: str
    def __init__(self, env_name: _Optional[str] = ..., seed: _Optional[int] = ..., config_json: _Optional[str] = ..., episode_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("episode_id", "observation", "info_json", "role", "images")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    observation: str
    info_json: str
    role: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, episode_id: _Optional[str] = ..., observation: _Optional[str] = ..., info_json: _Optional[str] = ..., role: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "action", "timeout_s", "request_id")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    action: str
    timeout_s: float
    request_id: str
    def __init__(self, episode_id: _Optional[str] = ..., action: _Optional[str] = ..., timeout_s: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done", "info_json", "role", "images")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    done: bool
    info_json: str
    role: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., info_json: _Optional[str] = ..., role: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
