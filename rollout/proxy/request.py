"""What a caller hands the LLMProxy and what it gets back, checked at the door.

``RequestInvalid`` is bad input, naming its field (HTTP 400 / gRPC INVALID_ARGUMENT);
``NoEngineAvailable`` is a pool with no engine left to serve a request.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from rollout.engines.http_engine import OnTokens
from rollout.proxy.lanes import Lane
from rollout.proxy.router import EngineSlot
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FinishReason
from sample_buffer.vision import MAX_IMAGE_BYTES, MAX_IMAGES, data_url

MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and vLLM's default --max-logprobs


class RequestInvalid(ValueError):
    """Bad input; ``field`` names it. Maps to HTTP 400 / gRPC INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class NoEngineAvailable(RuntimeError):
    """Every engine is out of rotation (or failed this request)."""


@dataclass
class ProxyRequest:
    input_ids: list[int]
    sampling_params: SamplingParams
    request_id: str = ""
    route: str = ""  # affinity key: requests that share it go to one engine (an episode's turns, a group)
    timeout_s: float = 0.0
    top_logprobs: int = 0  # the most likely tokens to report at each position (0: none)
    return_routed_experts: bool = False  # an MoE model's experts per position (routing replay)
    images: tuple[bytes, ...] = ()  # a vision-language prompt's encoded images, one placeholder each in input_ids


@dataclass
class ProxyResult:
    request_id: str
    output_ids: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.ABORT
    weight_version: int = 0
    engine: str = ""
    prompt_tokens: int = 0
    e2e_latency_s: float = 0.0
    num_segments: int = 0
    queue_time_s: float = 0.0  # waiting at the suspend gate, plus the engine's queue for the first segment
    ttft_s: float | None = None  # arrival → first token, when the engine reports its own TTFT
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked
    # when asked: [positions, layers × top_k], each position's from the latest segment that forwarded it
    routed_experts: np.ndarray | None = None


@dataclass
class InFlight:
    """A request between its arrival and its end: what it has so far and where it runs now."""

    request: ProxyRequest
    result: ProxyResult
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    on_tokens: OnTokens | None = None
    streamed: int = 0  # tokens handed to on_tokens
    lane: Lane | None = None  # whose request it is (set by ``generate``)
    slot: EngineSlot | None = None
    engine_rid: str = ""
    t0: float = field(default_factory=time.perf_counter)

    @cached_property
    def image_data(self) -> list[str]:
        """The images as the engines' ``image_data`` (data URLs), encoded once for every segment."""
        return [data_url(x) for x in self.request.images]


def check_timeout(timeout_s: float) -> None:
    # Infinity made aiohttp raise OverflowError (an UNKNOWN status, or an engine taken out of rotation after a
    # pause it could not send); NaN made asyncio's wait_for raise and switched aiohttp's timeout off.
    if not 0 <= timeout_s < math.inf:
        raise RequestInvalid("timeout_s", f"must be a finite number >= 0 (0 = the default), got {timeout_s}")


def validate(req: ProxyRequest) -> None:
    if not req.input_ids:
        raise RequestInvalid("input_ids", "must not be empty")
    if any(t < 0 for t in req.input_ids):
        raise RequestInvalid("input_ids", "token ids must be >= 0")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestInvalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if len(req.images) > MAX_IMAGES:
        raise RequestInvalid("images", f"{len(req.images)} images; at most {MAX_IMAGES} per request")
    for i, image in enumerate(req.images):  # what the image is, the engine checks; its size, here
        if not 0 < len(image) <= MAX_IMAGE_BYTES:
            raise RequestInvalid(f"images[{i}]", f"an encoded image of 1 to {MAX_IMAGE_BYTES} bytes, got {len(image)}")
    check_timeout(req.timeout_s)
