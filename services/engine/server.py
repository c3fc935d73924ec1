"""HTTP server of the embedded engine: SGLang's native API, as far as an RL system and SGLang's
own tools use it.

Field names and semantics follow SGLang so the same client (``rollout.engines.sglang.client``)
drives a real SGLang server on GPU and this engine on CPU: ``/generate`` with ``input_ids`` or
``text``, batched or streamed (SSE), SGLang's other request fields accepted as far as the engine
can honour them (``sglang_fields.py``), ``/flush_cache``, ``/health_generate``,
``/get_server_info`` and ``/get_model_info``, and SGLang's memory release for colocation
(``/release_memory_occupation``, ``/resume_memory_occupation``). ``meta_info.output_token_weight_versions``
is a rollmesh extension. Each weight transport adds its own receiving routes
(``services/weight_transports/<name>.py``, ``add_engine_routes``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import json
import sys
from typing import TYPE_CHECKING

from fastapi import Body, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.engines.contract import MAX_TOP_LOGPROBS, EngineError, GenerateOutput
from rollout.sampling import SamplingParams
from sample_buffer import routing
from services.auth import AuthConfig, BearerMiddleware, RefusedCollector, Role, server_bearer
from services.body_limit import BodyLimit
from services.engine.lora_routes import add_lora_routes
from services.engine.sglang_fields import expand_samples, strip_request
from services.http_errors import bad_request, install_error_handlers
from services.http_limits import uvicorn_config
from services.metrics import histogram, init_labels
from services.weight_transports import ENGINE_ROUTES
from services.weight_transports.common import INT64_MAX, INT64_MIN, EngineSide
from services.wire_limits import ENGINE_MAX_BODY_BYTES, MAX_WEIGHT_BUCKET_MB

if TYPE_CHECKING:  # its module (the model code, transformers' modeling) only where an embedded engine runs
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


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False


class PauseReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = "abort"


class MemoryReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = Field(None, description="weights and/or kv_cache; default both.")


def _version(value: str | int | None) -> int | None:
    if value is None:
        return None
    try:
        version = int(value)
    except ValueError:
        raise EngineError("weight_version", f"must be an integer (rollmesh versions), got {value!r}") from None
    if not INT64_MIN <= version <= INT64_MAX:
        raise EngineError("weight_version", f"must fit in 64 bits, got {version}")
    return version


class _Metrics:
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "rollmesh_engine_requests", "Finished generate requests, by finish reason", ["finish"], registry=r
        )
        init_labels(self.requests, "stop", "length", "abort")
        self.tokens = Counter("rollmesh_engine_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("rollmesh_engine_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.ignored = Counter(
            "rollmesh_engine_ignored_fields",
            "Top-level /generate fields SGLang does not define, ignored as SGLang ignores them",
            ["field"],
            registry=r,
        )
        self.latency = histogram(r, "rollmesh_engine_generation_latency_seconds", "One generate request, end to end")
        self.ttft = histogram(r, "rollmesh_engine_time_to_first_token_seconds", "Submit to first generated token")
        self.queue = histogram(r, "rollmesh_engine_queue_time_seconds", "Submit to admission into the running batch")
        for name, doc, key in [
            ("rollmesh_engine_running_requests", "Requests in the running batch", "num_running"),
            ("rollmesh_engine_waiting_requests", "Requests waiting for admission", "num_waiting"),
            ("rollmesh_engine_paused", "1 while generation is paused", "paused"),
            ("rollmesh_engine_weight_version", "Weight version being served", "weight_version"),
        ]:
            Gauge(name, doc, registry=r).set_function(lambda key=key: float(engine.load()[key]))

    def observe(self, out: GenerateOutput) -> None:
        self.requests.labels(out.finish_reason["type"]).inc()
        self.tokens.inc(len(out.output_ids))
        self.prompt_tokens.inc(out.prompt_tokens)
        self.latency.observe(out.e2e_latency_s)
        self.queue.observe(out.queue_time_s)
        if out.output_ids:
            self.ttft.observe(out.ttft_s)


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


def _tokenizer(path: str):
    """The model's tokenizer, for ``text`` prompts and answers; None when the directory has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def create_app(engine: EmbeddedEngine, auth: AuthConfig | None = None, load_roots: list[str] | None = None) -> FastAPI:
    """The engine's API; every route but /health and /metrics needs ``auth``'s token (default:
    from the environment), as SGLang's ``--api-key`` does. ``load_roots``: where
    ``/update_weights_from_disk`` may load from (default: nowhere)."""
    app = FastAPI(title="rollmesh embedded engine")
    install_error_handlers(app)
    # A weight bucket may be 1 GiB; nothing else an engine takes comes near 16 MiB (a /generate of
    # 128k token ids is about 1 MiB of JSON). Counted as it arrives, chunked bodies too.
    bucket_route = {"/update_weights_from_safetensors": (MAX_WEIGHT_BUCKET_MB + 1) << 20}
    app.add_middleware(BodyLimit, max_bytes=ENGINE_MAX_BODY_BYTES, routes=bucket_route)
    bearer = server_bearer(auth or AuthConfig(), "engine", Role.CONTROL)
    if bearer:  # added last: runs first, so a caller without the token is refused before any body
        app.add_middleware(BearerMiddleware, bearer=bearer)
    metrics = _Metrics(engine)
    metrics.registry.register(RefusedCollector())
    counter = iter(range(1 << 62))

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return bad_request(exc.field, exc.message)

    tokenizer = _tokenizer(engine.model_path) if hasattr(engine, "model_path") else None

    def prompts_of(req: GenerateReq) -> tuple[list[list[int]], bool]:
        if (req.text is None) == (req.input_ids is None):
            raise EngineError("input_ids", "give exactly one of input_ids and text")
        if req.text is not None:
            if tokenizer is None:
                raise EngineError("text", "this model directory has no tokenizer; send input_ids")
            texts = [req.text] if isinstance(req.text, str) else req.text
            return [tokenizer.encode(t) for t in texts], not isinstance(req.text, str)
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        return (req.input_ids if batched else [req.input_ids]), batched

    def images_of(data, n: int, batched: bool) -> list[list[str]]:
        """Each prompt's images (SGLang's shapes: one item, a list, a list per prompt of a batch)."""
        if data is None:
            return [[]] * n
        if data and "image_data" not in inspect.signature(engine.submit).parameters:
            raise EngineError("image_data", f"{type(engine).__name__} does not take images")
        if not batched:
            if isinstance(data, list) and data and isinstance(data[0], list):
                raise EngineError("image_data", "a list of lists is a batch's; this is one prompt")
            return [[data] if isinstance(data, str) else list(data)]
        if not isinstance(data, list) or len(data) != n or any(not isinstance(x, list) for x in data):
            raise EngineError("image_data", f"a batch of {n} prompts takes a list of {n} lists of images")
        return data

    def loras_of(value, n: int) -> list[str | None]:
        if value is None:
            return [None] * n
        if "lora" not in inspect.signature(engine.submit).parameters:
            raise EngineError("lora_path", f"{type(engine).__name__} serves no LoRA adapters")
        if isinstance(value, str):
            return [value] * n
        if len(value) != n:
            raise EngineError("lora_path", f"got {len(value)} adapters for {n} prompts")
        return list(value)

    async def submit_all(rids, prompts, params, images, extra, batched: bool, loras: list) -> list:
        """Every prompt of a request submitted, or none: one refused (a bad image in prompt k) aborts
        those before it, which nobody would wait for. Images are decoded off the event loop, so health
        checks and weight updates do not wait behind them."""
        futures = []
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

    @app.post("/generate")
    async def generate(body: dict = Body(...)):
        try:
            ignored: list[str] = []
            req = GenerateReq.model_validate(strip_request(expand_samples(body), GENERATE_FIELDS, ignored))
            for name in ignored:  # a label per name SGLang's own tools send; the rest together
                metrics.ignored.labels(name if name in COUNTED_IGNORED else "other").inc()
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        prompts, batched = prompts_of(req)
        n = len(prompts)
        rids = req.rid if isinstance(req.rid, list) else [req.rid] * n
        params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * n
        if len(rids) != n:
            raise EngineError("rid", f"got {len(rids)} ids for {n} prompts")
        if len(params) != n:
            raise EngineError("sampling_params", f"got {len(params)} entries for {n} prompts")
        rids = [r if r is not None else f"req-{next(counter)}" for r in rids]
        params = [p or SamplingParams() for p in params]
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                engine.validate(prompt, p)
            except EngineError as e:
                field = e.field if not batched else e.field.replace("input_ids", f"input_ids[{i}]")
                raise EngineError(field, e.message) from None
        await compile_grammars(params, batched)
        images = images_of(req.image_data, n, batched)
        loras = loras_of(req.lora_path, n)
        extra = {}
        if req.top_logprobs_num:
            if "top_logprobs_num" not in inspect.signature(engine.submit).parameters:
                raise EngineError("top_logprobs_num", f"{type(engine).__name__} does not report top log-probs")
            extra["top_logprobs_num"] = req.top_logprobs_num
        if req.return_routed_experts:
            if "return_routed_experts" not in inspect.signature(engine.submit).parameters:
                raise EngineError("return_routed_experts", f"{type(engine).__name__} does not report routed experts")
            extra["return_routed_experts"] = True
            too_long = [i for i, p in enumerate(prompts) if req.routed_experts_start_len > len(p)]
            if too_long:
                raise EngineError(
                    "routed_experts_start_len",
                    f"{req.routed_experts_start_len} is past prompt {too_long[0]}'s {len(prompts[too_long[0]])} tokens",
                )
        if req.stream:
            if batched:
                raise EngineError("stream", "a stream carries one prompt; send a batch without stream")
            if "on_token" not in inspect.signature(engine.submit).parameters:
                raise EngineError("stream", f"{type(engine).__name__} does not stream; send stream=false")
            if images[0]:  # decoded and processed off the event loop (``_stream``)
                extra["image_data"] = images[0]
            if loras[0] is not None:
                extra["lora"] = loras[0]
            start = req.routed_experts_start_len
            return await _stream(rids[0], prompts[0], params[0], req.return_logprob, extra, start)
        futures = await submit_all(rids, prompts, params, images, extra, batched, loras)
        outs = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        for out in outs:
            metrics.observe(out)
        body = [_response(o, req.return_logprob, tokenizer, req.routed_experts_start_len) for o in outs]
        # json.dumps directly: FastAPI's jsonable_encoder walks every element of the token lists
        # (~1 us each), which made weight updates wait seconds behind aborted long generations.
        return Response(json.dumps(body if batched else body[0]), media_type="application/json")

    async def compile_grammars(params: list[SamplingParams], batched: bool) -> None:
        """Each distinct grammar compiled before anything is queued, off the event loop and within its
        deadline (``rollout/engines/embedded/grammar.py``); one that does not compile: 400, by field."""
        seen: set = set()
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

    async def _stream(
        rid: str, prompt: list[int], params: SamplingParams, return_logprob: bool, extra: dict, routing_start: int
    ) -> StreamingResponse:
        """SGLang's stream: an event per token with everything generated so far, the whole answer
        last, then ``[DONE]``. A client that goes away aborts the request."""
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
                metrics.observe(out)
                yield event(_response(out, return_logprob, tokenizer, routing_start))
                yield "data: [DONE]\n\n"
            finally:
                if not future.done():  # the client went away mid-stream
                    engine.abort(rid, False)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(req: AbortReq):
        if not req.rid and not req.abort_all:
            raise EngineError("rid", "give a rid or abort_all=true")
        n = await asyncio.wrap_future(engine.abort(req.rid or None, req.abort_all))
        return {"success": True, "num_aborted": n}

    @app.post("/pause_generation")
    async def pause_generation(req: PauseReq):
        n = await asyncio.wrap_future(engine.pause(req.mode))  # type: ignore[arg-type]
        return {"success": True, "message": f"paused ({req.mode})", "num_affected": n}

    @app.post("/continue_generation")
    async def continue_generation():
        await asyncio.wrap_future(engine.resume())
        return {"success": True, "message": "continued"}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(req: MemoryReq | None = None):
        res = await asyncio.wrap_future(engine.release_memory(req.tags if req else None))
        return {"success": True, "message": "released", **res}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(req: MemoryReq | None = None):
        res = await asyncio.wrap_future(engine.resume_memory(req.tags if req else None))
        return {"success": True, "message": "resumed", **res}

    side = EngineSide(engine, _version, load_roots or [])
    for add_routes in ENGINE_ROUTES.values():  # each weight transport's receiving side
        add_routes(app, side)
    add_lora_routes(app, side)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return engine.info()

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(engine.weight_version), "checksum": engine.checksum}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        # tp_size: the ranks this engine takes in a weight-update group (SGLang reports its own).
        return {**engine.info(), **engine.load(), "tp_size": 1, "counters": dict(engine.counters)}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        """As SGLang's: healthy when one token can be generated, within 20 s."""
        rid = f"HEALTH_CHECK_{next(counter)}"
        try:
            fut = engine.submit(rid, [0], SamplingParams(max_new_tokens=1, temperature=0.0))
            await asyncio.wait_for(asyncio.wrap_future(fut), 20.0)
        except (TimeoutError, EngineError):
            engine.abort(rid, False)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # No prefix cache to flush: the engine keeps no KV past a request. SGLang answers in text.
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/metrics")
    async def prom_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(engine_config, auth: AuthConfig) -> None:
    """Run the engine server until SIGTERM/SIGINT, then drain and exit 0; https with ``auth.tls``.
    A backend with a server of its own (vLLM, SGLang) runs that one instead (``backends.py``)."""
    from services.engine.backends import backend

    kind = backend(engine_config)
    if kind.engine is None:
        return kind.serve_fn()(engine_config, auth)
    import contextlib
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        # uvicorn re-raises the captured signal after shutting down (exit code -15); a service
        # that shut down cleanly exits 0 and runs its own clean-up.
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    # The scheduler thread and the HTTP event loop share the GIL; a short switch interval keeps
    # the loop answering while the scheduler runs Python between kernels (p99 latency).
    sys.setswitchinterval(0.0005)
    engine = kind.build(engine_config).start()  # the embedded engine or the simulator
    # Everything loaded so far (torch, transformers, the model) lives for the whole process;
    # freezing it keeps full GC passes from walking millions of objects (200+ ms pauses).
    gc.freeze()
    try:
        config = uvicorn_config(
            create_app(engine, auth, [engine_config.model_path, *engine_config.load_roots]),
            engine_config.host,
            engine_config.port,
            auth,
        )
        _Server(config).run()
    finally:
        engine.shutdown()
