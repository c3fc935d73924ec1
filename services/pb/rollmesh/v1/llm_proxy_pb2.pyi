from services.pb.rollmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SuspendMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUSPEND_MODE_UNSPECIFIED: _ClassVar[SuspendMode]
    SUSPEND_MODE_CONTINUE: _ClassVar[SuspendMode]
    SUSPEND_MODE_ABORT: _ClassVar[SuspendMode]
    SUSPEND_MODE_IN_PLACE: _ClassVar[SuspendMode]
SUSPEND_MODE_UNSPECIFIED: SuspendMode
SUSPEND_MODE_CONTINUE: SuspendMode
SUSPEND_MODE_ABORT: SuspendMode
SUSPEND_MODE_IN_PLACE: SuspendMode

class ScoreTokensRequest(_message.Message):
    __slots__ = ("input_ids", "start", "timeout_s", "route", "top_k")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    start: int
    timeout_s: float
    route: str
    top_k: int
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., timeout_s: _Optional[float] = ..., route: _Optional[str] = ..., top_k: _Optional[int] = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("logprobs", "weight_version", "top_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed", "json_schema", "regex", "ebnf")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    sampling_seed: int
    json_schema: str
    regex: str
    ebnf: str
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., sampling_seed: _Optional[int] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "route", "input_ids", "sampling_params", "timeout_s", "top_logprobs", "return_routed_experts", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    route: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    timeout_s: float
    top_logprobs: int
    return_routed_experts: bool
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., route: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., timeout_s: _Optional[float] = ..., top_logprobs: _Optional[int] = ..., return_routed_experts: _Optional[bool] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GenerateGroupRequest(_message.Message):
    __slots__ = ("request", "request_ids")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateGroupResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    def __init__(self, samples: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("ids", "ids_per_token", "itemsize")
    IDS_FIELD_NUMBER: _ClassVar[int]
    IDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ITEMSIZE_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    ids_per_token: int
    itemsize: int
    def __init__(self, ids: _Optional[bytes] = ..., ids_per_token: _Optional[int] = ..., itemsize: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "output_ids", "behavior_logprobs", "token_versions", "finish_reason", "weight_version", "engine", "prompt_tokens", "e2e_latency_s", "num_segments", "top_logprobs", "routed_experts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    E2E_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    behavior_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    weight_version: int
    engine: str
    prompt_tokens: int
    e2e_latency_s: float
    num_segments: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    routed_experts: RoutedExperts
    def __init__(self, request_id: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., behavior_logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., weight_version: _Optional[int] = ..., engine: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., e2e_latency_s: _Optional[float] = ..., num_segments: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("output_ids", "result")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    result: GenerateResponse
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., result: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "abort_all")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_ALL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    abort_all: bool
    def __init__(self, request_id: _Optional[str] = ..., abort_all: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class SuspendRequest(_message.Message):
    __slots__ = ("mode", "timeout_s")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    mode: SuspendMode
    timeout_s: float
    def __init__(self, mode: _Optional[_Union[SuspendMode, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SuspendResponse(_message.Message):
    __slots__ = ("num_in_flight",)
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_in_flight: int
    def __init__(self, num_in_flight: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("model_path", "weight_version", "timeout_s", "adapter")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    weight_version: int
    timeout_s: float
    adapter: bool
    def __init__(self, model_path: _Optional[str] = ..., weight_version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., adapter: _Optional[bool] = ...) -> None: ...

class EngineUpdateResult(_message.Message):
    __slots__ = ("engine", "success", "weight_version", "message", "cause")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    engine: str
    success: bool
    weight_version: int
    message: str
    cause: str
    def __init__(self, engine: _Optional[str] = ..., success: _Optional[bool] = ..., weight_version: _Optional[int] = ..., message: _Optional[str] = ..., cause: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("success", "engines")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    success: bool
    engines: _containers.RepeatedCompositeFieldContainer[EngineUpdateResult]
    def __init__(self, success: _Optional[bool] = ..., engines: _Optional[_Iterable[_Union[EngineUpdateResult, _Mapping]]] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("weight_version", "index", "safetensors", "final", "restore_path", "timeout_s", "format", "base_version", "checksum")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PATH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    index: int
    safetensors: bytes
    final: bool
    restore_path: str
    timeout_s: float
    format: str
    base_version: int
    checksum: str
    def __init__(self, weight_version: _Optional[int] = ..., index: _Optional[int] = ..., safetensors: _Optional[bytes] = ..., final: _Optional[bool] = ..., restore_path: _Optional[str] = ..., timeout_s: _Optional[float] = ..., format: _Optional[str] = ..., base_version: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class InitWeightsGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "group_name", "backend", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    group_name: str
    backend: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightsGroupResponse(_message.Message):
    __slots__ = ("world_size", "engines")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, world_size: _Optional[int] = ..., engines: _Optional[_Iterable[str]] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DistributedBucket(_message.Message):
    __slots__ = ("weight_version", "index", "tensors", "final", "restore_path", "checksum", "timeout_s", "adapter", "result_checksum")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RESULT_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    index: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    final: bool
    restore_path: str
    checksum: str
    timeout_s: float
    adapter: bool
    result_checksum: str
    def __init__(self, weight_version: _Optional[int] = ..., index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., final: _Optional[bool] = ..., restore_path: _Optional[str] = ..., checksum: _Optional[str] = ..., timeout_s: _Optional[float] = ..., adapter: _Optional[bool] = ..., result_checksum: _Optional[str] = ...) -> None: ...

class MemoryRequest(_message.Message):
    __slots__ = ("tags", "lease_s", "timeout_s")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    lease_s: float
    timeout_s: float
    def __init__(self, tags: _Optional[_Iterable[str]] = ..., lease_s: _Optional[float] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class MemoryResponse(_message.Message):
    __slots__ = ("success", "engines")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    success: bool
    engines: _containers.RepeatedCompositeFieldContainer[EngineUpdateResult]
    def __init__(self, success: _Optional[bool] = ..., engines: _Optional[_Iterable[_Union[EngineUpdateResult, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("name", "url", "healthy", "in_flight", "outstanding_tokens", "weight_version", "requests_total", "failures_total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    healthy: bool
    in_flight: int
    outstanding_tokens: int
    weight_version: int
    requests_total: int
    failures_total: int
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., healthy: _Optional[bool] = ..., in_flight: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., weight_version: _Optional[int] = ..., requests_total: _Optional[int] = ..., failures_total: _Optional[int] = ...) -> None: ...

class ProxyStats(_message.Message):
    __slots__ = ("suspended", "in_flight", "requests_total", "retries_total", "weight_version", "engines")
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RETRIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    suspended: bool
    in_flight: int
    requests_total: int
    retries_total: int
    weight_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    def __init__(self, suspended: _Optional[bool] = ..., in_flight: _Optional[int] = ..., requests_total: _Optional[int] = ..., retries_total: _Optional[int] = ..., weight_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ...) -> None: ...
