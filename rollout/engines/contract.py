"""The in-process engine contract: what an engine the LLMProxy's engine server drives in-process
(the embedded torch engine, the latency simulator) returns and raises. Torch-free, so the
simulator and the servers read it without loading a model library."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# abort: running requests end now with their partial output; retract: they go back to the queue
# (their KV dropped) and run again after resume; in_place: they stay, KV and all, until resume.
PauseMode = Literal["abort", "retract", "in_place"]
# Samples of one prompt one request may ask (SGLang's parallel sampling, sampling_params.n; the
# LLMProxy's GenerateGroup): a group's, with room for the largest groups peers run.
MAX_SAMPLES = 1024
# Most likely tokens reported per position (top_logprobs_num): each is a [logprob, id, text] triple in
# every position's answer, so the vocabulary's size made an answer of max_new_tokens × vocab triples.
MAX_TOP_LOGPROBS = 64


class EngineError(ValueError):
    """A request the engine refuses; ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass
class GenerateOutput:
    """One finished request. ``finish_reason`` is SGLang's dict: ``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": token}`` or ``{"type": "abort", "message": why}``."""

    rid: str
    output_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    finish_reason: dict
    prompt_tokens: int
    weight_version: int
    e2e_latency_s: float
    queue_time_s: float = 0.0  # submitted → first admitted to the running batch
    ttft_s: float = 0.0  # submitted → first token (0 when none was generated)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked
    # MoE, when asked: [positions, layers × top_k] expert ids of every forwarded position (prompt and
    # output but the last token), a numpy array (``sample_buffer/routing.py``)
    routed_experts: object = None
