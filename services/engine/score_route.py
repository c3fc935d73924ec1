"""SGLang's scoring request on ``/generate``: ``logprob_start_len`` k >= 0 with ``max_new_tokens: 0``
returns, for each prompt, the log-prob the model gives each of its own tokens from position k on
(``meta_info.input_token_logprobs``, SGLang's ``[logprob, token id, text]`` triples; None at position
0) and generates nothing; with ``top_logprobs_num`` k also each position's k most likely tokens
(``meta_info.input_top_logprobs``, a list of triples per position, None at position 0). A teacher's
call in on-policy distillation (``trainer/distillation.py``)."""

from __future__ import annotations

import asyncio
import json

from fastapi import Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.engines.contract import EngineError


class _ScoreSampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(..., description="0: nothing is generated (scoring).")


class ScoreReq(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] | list[list[int]] = Field(..., description="One sequence or a batch, as token ids.")
    logprob_start_len: int | list[int] = Field(
        ..., description="Score each sequence's tokens from this position on (one for all, or one each)."
    )
    sampling_params: _ScoreSampling | None = None
    return_logprob: bool = True
    top_logprobs_num: int = Field(0, ge=0, description="Also each position's this many most likely tokens.")
    rid: str | list[str] | None = None


def is_scoring(body) -> bool:
    """SGLang's default ``logprob_start_len`` is -1 (no prompt log-probs): anything else asks for them."""
    return isinstance(body, dict) and body.get("logprob_start_len", -1) not in (-1, None)


async def score(engine, body: dict) -> Response:
    """Every sequence checked, then scored (one forward each, in the engine's scheduler thread)."""
    try:
        req = ScoreReq.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    if req.sampling_params is None or req.sampling_params.max_new_tokens != 0:
        raise EngineError(
            "sampling_params.max_new_tokens",
            "with logprob_start_len the engine scores the prompt and generates nothing: set it to 0",
        )
    if not req.return_logprob:
        raise EngineError("return_logprob", "a scoring request returns log-probs: set it to true")
    if not hasattr(engine, "score"):
        raise EngineError("logprob_start_len", f"{type(engine).__name__} does not score prompts")
    batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    seqs = req.input_ids if batched else [req.input_ids]
    starts = req.logprob_start_len if isinstance(req.logprob_start_len, list) else [req.logprob_start_len] * len(seqs)
    if len(starts) != len(seqs):
        raise EngineError("logprob_start_len", f"got {len(starts)} for {len(seqs)} sequences")
    futures = []
    for i, (ids, start) in enumerate(zip(seqs, starts, strict=True)):
        try:
            futures.append(engine.score(ids, start, req.top_logprobs_num))
        except EngineError as e:
            raise EngineError(
                e.field.replace("input_ids", f"input_ids[{i}]") if batched else e.field, e.message
            ) from None
    scored = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    version = str(engine.weight_version)
    body = [
        {
            "output_ids": [],
            "text": "",
            "meta_info": {
                "prompt_tokens": len(ids),
                "completion_tokens": 0,
                "finish_reason": {"type": "length", "length": 0},
                "weight_version": version,
                "input_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids[start:], strict=True)],
            }
            | ({"input_top_logprobs": [_triples(top) for top in tops]} if req.top_logprobs_num else {}),
        }
        for ids, start, (lps, tops) in zip(seqs, starts, scored, strict=True)
    ]
    return Response(json.dumps(body if batched else body[0]), media_type="application/json")


def _triples(top: list[tuple[int, float]] | None) -> list | None:
    return None if top is None else [[lp, t, None] for t, lp in top]
