"""The engine's ``/generate``: SGLang's request, one prompt or a batch, whole or streamed (SSE).

A request is checked whole before anything is queued: its prompts, per-prompt ids, sampling
params, images and adapters, what the engine can report, and its grammars compiled. A batch's
error names the prompt (``input_ids[k]``). Answers are SGLang's body with rollmesh's extensions
(``meta_info.output_token_weight_versions``, queue time, TTFT).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import json
from typing import TYPE_CHECKING

from fastapi import APIRouter, Body, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.engines.contract import MAX_TOP_LOGPROBS, EngineError, GenerateOutput
from rollout.sampling import SamplingParams
from sample_buffer import routing
from services.engine.metrics import EngineMetrics
from services.engine.score_route import is_scoring, score
from services.engine.sglang_fields import expand_samples, strip_request

if TYPE_CHECKING:
    from rollout.engines.embedded.engine import EmbeddedEngine


class GenerateReq(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] | list[list[int]] | None = Field(
        None, description="One prompt or a batch of prompts, as token ids (or give text)."
    )
    text: str | list[str] | None = Field(None, description="One prompt or a batch, as text (the model's tokenizer).")
    rid: str | list[str] | None = Field(None, description="Request id(s); generated when absent.")
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(
        0, ge=0, le=MAX_TOP_LOGPROBS, description="With return_logprob: the most likely tokens at each position."
    )
    stream: bool = Field(False, description="Server-sent events, one per token, then the whole answer (one prompt).")
    return_routed_experts: bool = Field(
        False,
        description="An MoE model: meta_info.routed_experts, SGLang's base64 of int32 expert ids "
        "[prompt + output tokens - 1, decoder layers, top_k] (the whole answer only, not stream chunks).",
    )
    routed_experts_start_len: int = Field(
        0, ge=0, description="SGLang's: routed_experts from this position on (<= the prompt's length)."
    )
    image_data: str | list[str] | list[list[str]] | None = Field(
        None,
        description="A vision-language model's images (SGLang's field): base64 or data URLs, one image placeholder "
        "token in input_ids for each; a list per prompt of a batch. URLs and paths are refused.",
    )
    lora_path: str | list[str | None] | None = Field(
        None,
        description="SGLang's: the name of a loaded LoRA adapter (/load_lora_adapter) to generate with; a list "
        "gives each prompt of a batch its own (None: the base model).",
    )


GENERATE_FIELDS = frozenset(GenerateReq.model_fields)
COUNTED_IGNORED = frozenset({"model"})  # what sglang-router adds


def _response(out: GenerateOutput, return_logprob: bool, tokenizer=None, routing_start: int = 0) -> dict:
    meta = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "weight_version": str(out.weight_version),
        "e2e_latency": out.e2e_latency_s,
        "output_token_weight_versions": out.token_versions,  # rollmesh extensions from here
        "queue_time": out.queue_time_s,
        "ttft": out.ttft_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.behavior_logprobs, out.output_ids)]
        if out.top_logprobs:  # SGLang's shape: per position, [logprob, token id, text] most likely first
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in out.top_logprobs]
    if out.routed_experts is not None:
        meta["routed_experts"] = routing.encode_sglang(out.routed_experts[routing_start:])
    body = {"output_ids": out.output_ids, "meta_info": meta}
    if tokenizer is not None:
        body["text"] = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    return body


def tokenizer_of(path: str):
    """The model's tokenizer, for ``text`` prompts and answers; None when the directory has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


class GenerateRoutes:
    """``/generate`` over ``engine``: parsing, per-prompt checks, submission and the answer."""

    def __init__(self, engine: EmbeddedEngine, metrics: EngineMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.tokenizer = tokenizer_of(engine.model_path) if hasattr(engine, "model_path") else None
        self._ids = itertools.count()
        self._takes = set(inspect.signature(engine.submit).parameters)  # what this engine's submit accepts

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/generate", self.generate, methods=["POST"])
        return router

    async def generate(self, body: dict = Body(...)):
        if is_scoring(body):  # SGLang's prefill-only request: the log-probs of the prompt's own tokens
            return await score(self.engine, body)
        req = self._parse(body)
        prompts, batched = self._prompts(req)
        rids, params = self._per_prompt(req, prompts, batched)
        await self._compile_grammars(params, batched)
        images = self._images(req.image_data, len(prompts), batched)
        loras = self._loras(req.lora_path, len(prompts))
        extra = self._reports(req, prompts)
        if req.stream:
            if batched:
                raise EngineError("stream", "a stream carries one prompt; send a batch without stream")
            if "on_token" not in self._takes:
                raise EngineError("stream", f"{type(self.engine).__name__} does not stream; send stream=false")
            if images[0]:  # decoded and processed off the event loop (``_stream``)
                extra["image_data"] = images[0]
            if loras[0] is not None:
                extra["lora"] = loras[0]
            return await self._stream(
                rids[0], prompts[0], params[0], req.return_logprob, extra, req.routed_experts_start_len
            )
        futures = await self._submit_all(rids, prompts, params, images, extra, batched, loras)
        outs = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        for out in outs:
            self.metrics.observe(out)
        body = [_response(o, req.return_logprob, self.tokenizer, req.routed_experts_start_len) for o in outs]
        # json.dumps directly: FastAPI's jsonable_encoder walks every element of the token lists
        # (~1 us each), which made weight updates wait seconds behind aborted long generations.
        return Response(json.dumps(body if batched else body[0]), media_type="application/json")

    def _parse(self, body: dict) -> GenerateReq:
        try:
            ignored: list[str] = []
            req = GenerateReq.model_validate(strip_request(expand_samples(body), GENERATE_FIELDS, ignored))
            for name in ignored:  # a label per name SGLang's own tools send; the rest together
                self.metrics.ignored.labels(name if name in COUNTED_IGNORED else "other").inc()
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return req

    def _prompts(self, req: GenerateReq) -> tuple[list[list[int]], bool]:
        if (req.text is None) == (req.input_ids is None):
            raise EngineError("input_ids", "give exactly one of input_ids and text")
        if req.text is not None:
            if self.tokenizer is None:
                raise EngineError("text", "this model directory has no tokenizer; send input_ids")
            texts = [req.text] if isinstance(req.text, str) else req.text
            return [self.tokenizer.encode(t) for t in texts], not isinstance(req.text, str)
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        return (req.input_ids if batched else [req.input_ids]), batched

    def _per_prompt(
        self, req: GenerateReq, prompts: list[list[int]], batched: bool
    ) -> tuple[list[str], list[SamplingParams]]:
        """Each prompt's request id and sampling params, each prompt checked against its params."""
        n = len(prompts)
        rids = req.rid if isinstance(req.rid, list) else [req.rid] * n
        params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * n
        if len(rids) != n:
            raise EngineError("rid", f"got {len(rids)} ids for {n} prompts")
        if len(params) != n:
            raise EngineError("sampling_params", f"got {len(params)} entries for {n} prompts")
        rids = [r if r is not None else f"req-{next(self._ids)}" for r in rids]
        params = [p or SamplingParams() for p in params]
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                self.engine.validate(prompt, p)
            except EngineError as e:
                field = e.field if not batched else e.field.replace("input_ids", f"input_ids[{i}]")
                raise EngineError(field, e.message) from None
        return rids, params

    def _reports(self, req: GenerateReq, prompts: list[list[int]]) -> dict:
        """What the engine is asked to report beyond tokens and log-probs, if it can."""
        extra = {}
        if req.top_logprobs_num:
            if "top_logprobs_num" not in self._takes:
                raise EngineError("top_logprobs_num", f"{type(self.engine).__name__} does not report top log-probs")
            extra["top_logprobs_num"] = req.top_logprobs_num
        if req.return_routed_experts:
            if "return_routed_experts" not in self._takes:
                name = type(self.engine).__name__
                raise EngineError("return_routed_experts", f"{name} does not report routed experts")
            extra["return_routed_experts"] = True
            too_long = [i for i, p in enumerate(prompts) if req.routed_experts_start_len > len(p)]
            if too_long:
                raise EngineError(
                    "routed_experts_start_len",
                    f"{req.routed_experts_start_len} is past prompt {too_long[0]}'s {len(prompts[too_long[0]])} tokens",
                )
        return extra

    def _images(self, data, n: int, batched: bool) -> list[list[str]]:
        """Each prompt's images (SGLang's shapes: one item, a list, a list per prompt of a batch)."""
        if data is None:
            return [[]] * n
        if data and "image_data" not in self._takes:
            raise EngineError("image_data", f"{type(self.engine).__name__} does not take images")
        if not batched:
            if isinstance(data, list) and data and isinstance(data[0], list):
                raise EngineError("image_data", "a list of lists is a batch's; this is one prompt")
            return [[data] if isinstance(data, str) else list(data)]
        if not isinstance(data, list) or len(data) != n or any(not isinstance(x, list) for x in data):
            raise EngineError("image_data", f"a batch of {n} prompts takes a list of {n} lists of images")
        return data

    def _loras(self, value, n: int) -> list[str | None]:
        if value is None:
            return [None] * n
        if "lora" not in self._takes:
            raise EngineError("lora_path", f"{type(self.engine).__name__} serves no LoRA adapters")
        if isinstance(value, str):
            return [value] * n
        if len(value) != n:
            raise EngineError("lora_path", f"got {len(value)} adapters for {n} prompts")
        return list(value)

    async def _compile_grammars(self, params: list[SamplingParams], batched: bool) -> None:
        """Each distinct grammar compiled before anything is queued, off the event loop and within its
        deadline (``rollout/engines/embedded/grammar.py``); one that does not compile: 400, by field."""
        engine, seen = self.engine, set()
        for i, p in enumerate(params):
            key = p.grammar()
            if key is None or key in seen:
                continue
            seen.add(key)
            if not hasattr(type(engine), "grammars"):  # (the property itself loads the tokenizer)
                name = type(engine).__name__
                raise EngineError(f"sampling_params.{key[0]}", f"{name} does not decode under grammars")
            try:
                await asyncio.to_thread(lambda p=p: engine.grammars.compile_within(p))  # (its first use loads)
            except EngineError as e:
                field = e.field.replace("sampling_params", f"sampling_params[{i}]") if batched else e.field
                raise EngineError(field, e.message) from None

    async def _submit_all(self, rids, prompts, params, images, extra, batched: bool, loras: list) -> list:
        """Every prompt of a request submitted, or none: one refused (a bad image in prompt k) aborts
        those before it, which nobody would wait for. Images are decoded off the event loop, so health
        checks and weight updates do not wait behind them."""
        engine, futures = self.engine, []
        try:
            for rid, prompt, p, im, lora in zip(rids, prompts, params, images, loras):
                one = extra | ({"lora": lora} if lora is not None else {})
                if im:
                    fut = await asyncio.to_thread(engine.submit, rid, prompt, p, **one, image_data=im)
                else:
                    fut = engine.submit(rid, prompt, p, **one)
                futures.append(fut)
        except EngineError as e:
            for rid in rids[: len(futures)]:
                engine.abort(rid, False)
            if batched:  # which prompt's: image_data[i] of prompt k is image_data[k][i]
                k = len(futures)
                field = e.field.replace("image_data", f"image_data[{k}]", 1).replace("input_ids", f"input_ids[{k}]", 1)
                field = field.replace("lora_path", f"lora_path[{k}]", 1)
                raise EngineError(field, e.message) from None
            raise
        return futures

    async def _stream(
        self, rid: str, prompt: list[int], params: SamplingParams, return_logprob: bool, extra: dict, routing_start: int
    ) -> StreamingResponse:
        """SGLang's stream: an event per token with everything generated so far, the whole answer
        last, then ``[DONE]``. A client that goes away aborts the request."""
        engine, tokenizer = self.engine, self.tokenizer
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()
        on_token = lambda *t: loop.call_soon_threadsafe(tokens.put_nowait, t)  # noqa: E731
        submit = functools.partial(engine.submit, rid, prompt, params, on_token=on_token, **extra)
        future = asyncio.wrap_future(await asyncio.to_thread(submit) if "image_data" in extra else submit())

        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            ids: list[int] = []
            try:
                while not (future.done() and tokens.empty()):
                    get = asyncio.ensure_future(tokens.get())
                    await asyncio.wait({get, future}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        continue
                    ids.append(get.result()[0])
                    chunk = {
                        "output_ids": list(ids),
                        "meta_info": {
                            "id": rid,
                            "finish_reason": None,
                            "prompt_tokens": len(prompt),
                            "completion_tokens": len(ids),
                        },
                    }
                    if tokenizer is not None:
                        chunk["text"] = tokenizer.decode(ids, skip_special_tokens=True)
                    yield event(chunk)
                out = await future
                self.metrics.observe(out)
                yield event(_response(out, return_logprob, tokenizer, routing_start))
                yield "data: [DONE]\n\n"
            finally:
                if not future.done():  # the client went away mid-stream
                    engine.abort(rid, False)

        return StreamingResponse(events(), media_type="text/event-stream")
