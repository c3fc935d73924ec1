"""Sampling parameters: one model from the episode config through the LLMProxy to the engine.

SGLang's names and meanings (``sampling_params`` of ``/generate``), the subset an RL system
needs. The episode config holds one, the proxy validates and forwards one, the embedded engine
samples with one; the proto message mirrors it field for field (``services/convert.py``).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sample_buffer.grammars import GRAMMAR_FIELDS, MAX_GRAMMAR_CHARS


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
    json_schema: str | None = Field(
        None,
        max_length=MAX_GRAMMAR_CHARS,
        description="Constrained decoding: the answer is JSON valid against this JSON schema (text). Each "
        "token is sampled from the policy's distribution masked to what the grammar allows, and its "
        "log-prob is that masked distribution's.",
    )
    regex: str | None = Field(
        None, max_length=MAX_GRAMMAR_CHARS, description="Constrained decoding: the answer matches this regex."
    )
    ebnf: str | None = Field(
        None,
        max_length=MAX_GRAMMAR_CHARS,
        description="Constrained decoding: the answer follows this EBNF grammar (GBNF, its rule 'root').",
    )

    @field_validator("json_schema")
    @classmethod
    def _json(cls, schema: str | None) -> str | None:
        if schema is not None:
            try:
                json.loads(schema)
            except (ValueError, RecursionError) as e:  # (nested thousands deep: RecursionError)
                raise ValueError(f"not JSON: {type(e).__name__}: {str(e)[:200]}") from None
        return schema

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingParams:
        given = [f for f in GRAMMAR_FIELDS if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: one grammar a request")
        return self

    def grammar(self) -> tuple[str, str] | None:
        """``(field, text)`` of the grammar the answer must follow, or None."""
        return next(((f, getattr(self, f)) for f in GRAMMAR_FIELDS if getattr(self, f) is not None), None)
