"""Proto ↔ project types, in one place: finish reasons, sampling parameters, errors."""

from __future__ import annotations

import grpc
import numpy as np
from pydantic import ValidationError

from rollout.ports import TransientError
from rollout.proxy import RequestInvalid
from rollout.sampling import SamplingParams
from sample_buffer import routing
from sample_buffer.trajectory import FinishReason
from services.controller.errors import UpdateConflict
from services.pb.rollmesh.v1 import common_pb2
from services.pb.rollmesh.v1 import llm_proxy_pb2 as proxy_pb

_TO_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.TIMEOUT: common_pb2.FINISH_REASON_TIMEOUT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
    FinishReason.ENV_ERROR: common_pb2.FINISH_REASON_ERROR,  # the wire has one "failed" reason
}
_FROM_PB = {v: k for k, v in _TO_PB.items() if k is not FinishReason.ENV_ERROR}


def finish_to_pb(reason: FinishReason) -> int:
    return _TO_PB[reason]


def finish_from_pb(value: int) -> FinishReason:
    return _FROM_PB.get(value, FinishReason.ERROR)  # UNSPECIFIED or a newer value: not a clean end


def sampling_to_pb(sp: SamplingParams) -> proxy_pb.SamplingParams:
    return proxy_pb.SamplingParams(**sp.model_dump(exclude_none=True))


def sampling_from_pb(sp: proxy_pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take the model's defaults (SGLang's); a bad value raises
    ``RequestInvalid`` naming ``sampling_params.<field>``."""
    fields = {
        "max_new_tokens": sp.max_new_tokens,
        "ignore_eos": sp.ignore_eos,
        "stop_token_ids": list(sp.stop_token_ids),
    }
    optional = ("temperature", "top_p", "top_k", "sampling_seed", "json_schema", "regex", "ebnf")
    fields |= {n: getattr(sp, n) for n in optional if sp.HasField(n)}
    try:
        return SamplingParams(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = f"sampling_params.{err['loc'][0]}" if err["loc"] else "sampling_params"  # (a rule of two fields)
        raise RequestInvalid(where, f"{err['msg']}, got {str(err.get('input'))[:200]!r}") from None


def routed_experts_to_pb(ids: np.ndarray) -> proxy_pb.RoutedExperts:
    return proxy_pb.RoutedExperts(
        ids=np.ascontiguousarray(ids, dtype=ids.dtype.newbyteorder("<")).tobytes(),
        ids_per_token=ids.shape[1],
        itemsize=ids.dtype.itemsize,
    )


def routed_experts_from_pb(msg: proxy_pb.RoutedExperts) -> np.ndarray:
    """The ``[positions, layers × top_k]`` array (``sample_buffer/routing.py``); a malformed one
    raises ``RoutingError``."""
    return routing.from_bytes(msg.ids, msg.ids_per_token, msg.itemsize)


# The call never reached a handler, or the server is busy or going away: worth another try.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED})


def project_error(e: grpc.aio.AioRpcError) -> Exception:
    """The project's exception for a gRPC error of any rollmesh service: what a port raises."""
    code, details = e.code(), e.details() or ""
    if code in RETRYABLE:
        return TransientError(code.name, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the caller's own deadline: another try cannot help
        return TimeoutError(details or "deadline exceeded")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return UpdateConflict(details)
    return RuntimeError(f"{code.name}: {details}")
