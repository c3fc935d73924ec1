"""Proto ↔ project types, in one place: finish reasons and sampling parameters."""

from __future__ import annotations

from pydantic import ValidationError

from rollout.proxy.proxy import RequestInvalid
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FinishReason
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
    fields = {"max_new_tokens": sp.max_new_tokens, "ignore_eos": sp.ignore_eos,
              "stop_token_ids": list(sp.stop_token_ids)}  # fmt: skip
    fields |= {n: getattr(sp, n) for n in ("temperature", "top_p", "top_k", "sampling_seed") if sp.HasField(n)}
    try:
        return SamplingParams(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise RequestInvalid(f"sampling_params.{err['loc'][0]}", f"{err['msg']}, got {err.get('input')!r}") from None
