"""Sampling parameters: one model from the episode config through the LLMProxy to the engine.

SGLang's names and meanings (``sampling_params`` of ``/generate``), the subset an RL system
needs. The episode config holds one, the proxy validates and forwards one, the embedded engine
samples with one; the proto message mirrors it field for field (``services/convert.py``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How one generation samples."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept.")
    top_k: int = Field(-1, description="Most likely tokens kept; -1 or 0 = all.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra tokens that end generation.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")
    sampling_seed: int | None = Field(None, description="Seed of this request's sampler: same seed, same tokens.")
