"""Async client for a vLLM server, with the same contract as ``SGLangClient``.

It speaks vLLM's own token-in/token-out API, not the OpenAI one: ``POST /inference/v1/generate``
(served with ``--enable-scale-out``) takes token ids and returns token ids, per-token log-probs and
``weight_versions``, spans of output tokens per weight version, so a generation that spans a weight
update is labelled token by token as on the embedded engine. The RL control endpoints need
``VLLM_SERVER_DEV_MODE=1``: ``/pause?mode=abort|keep``, ``/resume``, ``/abort_requests``,
``/update_weight_version``, ``/weight_info``, ``/collective_rpc``. Weights load from disk through
``rollmesh_load_weights``, the worker extension in ``services/engine/vllm_plugin`` (vLLM's own
``reload_weights`` leaves stale prepacked weights on CPU). ``rollmesh serve engine`` with
``engine.type: vllm`` starts vLLM with all of that switched on. No ``import vllm`` here.

Log-probs: the server runs with ``--logprobs-mode processed_logprobs`` (``rollmesh serve engine``
sets it), so they are ``log_softmax(logits / temperature)`` as on SGLang and the embedded engine
(vLLM's default ignores the temperature). With top-p or top-k below their defaults vLLM
renormalises over the kept tokens where SGLang does not. A grammar (``json_schema`` / ``regex`` /
``ebnf``) goes as vLLM's ``structured_outputs``; vLLM masks the logits in place before its sampler,
so those log-probs are the masked distribution's, as the trainer replays it.

In place on vLLM: a weight update must drop the running requests' cached KV (vLLM resets its
prefix cache only so), so they are recomputed with the new weights; the tokens after the update
are the new weights' continuation, as in continue mode, without leaving the engine.

MoE routing (``--enable-return-routed-experts``): each finished choice's ``routed_experts`` is
base64 of a ``.npy`` array ``[prompt + output − 1 − start, layers, top_k]``, ``start`` being the
request's ``sampling_params.routed_experts_prompt_start`` (SGLang's ``routed_experts_start_len``).
An answer with another number of rows (a request that spanned an in-place update may carry the
recomputed positions twice) has its routing dropped, never guessed at: the tokens stand, and the
trainer leaves a trajectory without routing out of a replayed batch.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

from rollout.engines.http_engine import (
    EngineRejected,
    EngineResult,
    EngineUnavailable,
    HTTPEngineClient,
    OnTokens,
    int_version,
)
from rollout.sampling import SamplingParams
from sample_buffer import routing
from sample_buffer.trajectory import FinishReason
from sample_buffer.vision import data_url

log = logging.getLogger(__name__)

# The proxy names pause modes as SGLang does; vLLM's "keep" freezes requests where they are.
_PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}
# SGLang's grammar params as vLLM's structured outputs (its StructuredOutputsParams' fields)
_STRUCTURED = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
# vLLM prefixes the request id it was given; /abort_requests wants the prefixed one.
_RID_PREFIX = "generate-tokens-"
# Of an update's deadline, what is kept back for resuming a server the update paused: a timeout
# while loading must not leave the engine frozen.
_RESUME_RESERVE_S = 5.0


def vllm_sampling(params: SamplingParams | dict, return_logprob: bool, top_logprobs: int = 0) -> dict:
    """SGLang's sampling names (rollmesh's) as vLLM's ``SamplingParams``; every value is sent."""
    p = params if isinstance(params, SamplingParams) else SamplingParams.model_validate(params)
    out = {
        "max_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "stop_token_ids": p.stop_token_ids,
        "ignore_eos": p.ignore_eos,
        "detokenize": False,  # ids in, ids out: no text is needed
    }
    if p.sampling_seed is not None:
        out["seed"] = p.sampling_seed
    if (grammar := p.grammar()) is not None:  # vLLM's structured outputs (xgrammar, as the other engines)
        field, text = grammar
        out["structured_outputs"] = {_STRUCTURED[field]: text}
    if return_logprob:
        # vLLM keeps the sampled token and the first k - 1 others: one more, for the whole top k
        # when the sampled token is not among it (rollmesh serve engine raises --max-logprobs).
        out["logprobs"] = top_logprobs + 1 if top_logprobs else 0  # 0: the sampled token's log-prob only
    return out


def generate_payload(
    input_ids: list[int],
    sampling_params: SamplingParams | dict,
    rid: str | None = None,
    return_logprob: bool = True,
    top_logprobs: int = 0,
    routing_start: int | None = None,
    image_data: list[str] | None = None,
    lora_path: str | None = None,
) -> dict:
    """The body of ``POST /inference/v1/generate`` (vLLM's ``GenerateRequest``). Images go as its
    ``content_parts`` (data URLs; vLLM expands each one-token placeholder in ``token_ids``). A
    loaded adapter is named as the request's ``model`` (vLLM serves each adapter as a model)."""
    sampling = vllm_sampling(sampling_params, return_logprob, top_logprobs)
    if routing_start:  # skip the prompt positions an earlier turn's routing covered
        sampling["routed_experts_prompt_start"] = routing_start
    payload = {"token_ids": input_ids, "sampling_params": sampling}
    if rid is not None:
        payload["request_id"] = rid
    if lora_path is not None:
        payload["model"] = lora_path
    if image_data:
        payload["content_parts"] = [{"type": "image_url", "url": _data_url(x)} for x in image_data]
    return payload


def _grammar_at_fault(params: SamplingParams | dict, message: str) -> str | None:
    """The grammar param a 400 is about (vLLM's messages name xgrammar's error, not our field)."""
    p = params if isinstance(params, SamplingParams) else SamplingParams.model_validate(params)
    grammar = p.grammar()
    if grammar is None or not any(w in message.lower() for w in ("grammar", "regex", "schema", "json")):
        return None
    return f"sampling_params.{grammar[0]}"


def _data_url(image: str) -> str:
    """vLLM takes data, HTTP or file URLs, not bare base64 (SGLang's other spelling)."""
    return image if image.startswith("data:") else data_url(base64.b64decode(image))


def _top(entry: dict, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one position, by vLLM's rank (the list starts with the
    sampled token, at its own rank, which may be past k)."""
    ranked = {
        int(c["token_id"]): (int(c["rank"]), float(c["logprob"]))
        for c in entry.get("top_logprobs") or []
        if c.get("rank") is not None and int(c["rank"]) <= k
    }
    return [(t, lp) for t, (_, lp) in sorted(ranked.items(), key=lambda x: x[1][0])]


def parse_vllm_response(
    body: dict,
    e2e_latency_s: float,
    return_logprob: bool = True,
    top_logprobs: int = 0,
    prompt_tokens: int = 0,
    routing_start: int | None = None,
) -> EngineResult:
    """One choice of ``/inference/v1/generate`` as an ``EngineResult``. An answer in another
    shape (a token without a log-prob or a weight version among them) is ``EngineUnavailable``
    naming what is missing: not an engine the proxy can use, so it leaves rotation and the request
    is tried elsewhere. ``routing_start``: routing was asked for, from that prompt position
    (``prompt_tokens``: the prompt's length, which vLLM's token API does not repeat)."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice["token_ids"] or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        tops = [_top(c, top_logprobs) for c in content] if top_logprobs else []
        versions = [-1] * len(ids)
        for span in choice.get("weight_versions") or []:
            start, end = int(span["start"]), int(span["end"])
            versions[start:end] = [int_version(span["version"])] * (end - start)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise EngineUnavailable(
            f"vLLM answered in an unexpected shape ({type(e).__name__}: {e}): {str(body)[:200]}"
        ) from e
    if len(versions) != len(ids) or -1 in versions or (return_logprob and len(logprobs) != len(ids)):
        raise EngineUnavailable(
            f"vLLM answered {len(ids)} tokens with {len(logprobs)} log-probs and weight "
            f"versions {sorted(set(versions))} ([0, n) must be covered)"
        )
    finish = choice.get("finish_reason") or "abort"
    usage = body.get("usage") or {}
    experts = None
    if routing_start is not None and choice.get("routed_experts") is not None:
        # the prompt as vLLM forwarded it (an image's placeholder expanded), where it says
        positions = int(usage.get("prompt_tokens") or prompt_tokens) + len(ids) - 1 - routing_start
        try:
            experts = routing.decode_vllm(choice["routed_experts"], positions)
        except routing.RoutingError as e:  # the tokens stand; without its routing the trainer drops it
            log.warning("generate %s: %s; routing dropped", body.get("request_id", ""), e)
    return EngineResult(
        output_ids=ids,
        behavior_logprobs=logprobs,
        token_versions=versions,
        finish_reason=FinishReason.of_engine(finish),
        weight_version=versions[-1] if versions else -1,  # no token: the client asks the server
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        e2e_latency_s=e2e_latency_s,
        top_logprobs=tops,
        routed_experts=experts,
        routed_experts_start=routing_start or 0,
    )


def join_chunks(chunks: list[dict]) -> dict:
    """The answer of a streamed ``/inference/v1/generate`` in the unary shape: each chunk carries
    the new tokens and their log-probs; the last with a finish reason carries the weight-version
    spans and the routing of the whole output; usage comes in a chunk of its own."""
    ids, content, final, usage = [], [], {}, {}
    for chunk in chunks:
        if "error" in chunk:
            raise EngineUnavailable(f"vLLM failed mid-stream: {str(chunk['error'])[:200]}")
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            ids += choice.get("token_ids") or []
            content += (choice.get("logprobs") or {}).get("content") or []
            if choice.get("finish_reason") is not None:
                final = choice
    return {
        "choices": [
            {
                "token_ids": ids,
                "logprobs": {"content": content},
                "finish_reason": final.get("finish_reason"),
                "weight_versions": final.get("weight_versions"),
                "routed_experts": final.get("routed_experts"),
            }
        ],
        "usage": usage,
    }


class VLLMClient(HTTPEngineClient):
    """One vLLM server (``rollmesh serve engine`` with ``engine.type: vllm``)."""

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict,
        rid: str | None = None,
        return_logprob: bool = True,
        timeout_s: float | None = None,
        top_logprobs: int = 0,
        on_tokens: OnTokens | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        image_data: list[str] | None = None,
        lora_path: str | None = None,
    ) -> EngineResult:
        """As ``SGLangClient.generate``: ``on_tokens`` streams it (vLLM's ``stream: true``);
        ``return_routed_experts`` reads the routing a server started with
        ``--enable-return-routed-experts`` sends (it sends none otherwise); ``lora_path``: a loaded
        adapter's name. Tokens are labelled with the base weights' versions: vLLM keeps no version
        of an adapter (a caller that reloads one names each version anew)."""
        start = routed_experts_start_len if return_routed_experts else None
        payload = generate_payload(
            input_ids, sampling_params, rid, return_logprob, top_logprobs, start, image_data, lora_path
        )
        try:
            return await self._generate(payload, input_ids, return_logprob, top_logprobs, on_tokens, start, timeout_s)
        except EngineRejected as e:
            if lora_path is not None and e.status == 404:  # vLLM: "The model `name` does not exist."
                raise EngineRejected(
                    f"lora_path: no adapter named {lora_path!r} is loaded (/load_lora_adapter first)", "lora_path"
                ) from e
            if (field := _grammar_at_fault(sampling_params, str(e))) is not None:
                raise EngineRejected(f"{field}: {str(e)[:500]}", field, e.status) from e
            raise

    async def _generate(
        self,
        payload: dict,
        input_ids: list[int],
        return_logprob: bool,
        top_logprobs: int,
        on_tokens: OnTokens | None,
        start: int | None,
        timeout_s: float | None,
    ) -> EngineResult:
        t0 = time.perf_counter()
        if on_tokens is None:
            body = await self._post("/inference/v1/generate", timeout_s, json=payload)
        else:
            chunks = []
            stream = {**payload, "stream": True, "stream_options": {"include_usage": True}}
            async for chunk in self._post_events("/inference/v1/generate", timeout_s, json=stream):
                chunks.append(chunk)
                if new := [t for c in chunk.get("choices") or [] for t in c.get("token_ids") or []]:
                    on_tokens(new)
            body = join_chunks(chunks)
        result = parse_vllm_response(
            body, time.perf_counter() - t0, return_logprob, top_logprobs, len(input_ids), start
        )
        if not result.output_ids and result.weight_version < 0:
            result.weight_version = (await self.model_info()).get("weight_version", -1)
        return result

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float = 60.0) -> dict:
        """Serve the PEFT adapter in directory ``path`` as ``name`` (vLLM's ``/v1/load_lora_adapter``,
        with ``max_loaded_loras`` above 0). vLLM answers an adapter it cannot load (a rank over
        ``max_lora_rank``, a module or a shape the base model lacks) with HTTP 500 and its reason,
        having registered nothing: that is the caller's adapter, not a failed engine."""
        body = {"lora_name": name, "lora_path": path}
        try:
            return await self._request("POST", "/v1/load_lora_adapter", timeout_s, plain=True, json=body)
        except EngineRejected as e:  # vLLM: 404 for a path without an adapter, 400 for a name in use
            raise EngineRejected(str(e), e.field or ("lora_path" if e.status == 404 else "lora_name"), e.status) from e
        except EngineUnavailable as e:
            if "HTTP 500" not in str(e):
                raise
            raise EngineRejected(f"lora_path: vLLM cannot load the adapter in {path!r}: {e}", "lora_path") from e

    async def unload_lora_adapter(self, name: str, timeout_s: float = 30.0) -> dict:
        body = {"lora_name": name}
        try:
            return await self._request("POST", "/v1/unload_lora_adapter", timeout_s, plain=True, json=body)
        except EngineRejected as e:
            raise EngineRejected(str(e), "lora_name", e.status) from e

    async def abort(self, rid: str | None = None, abort_all: bool = False, timeout_s: float = 5.0) -> dict:
        if not rid and not abort_all:
            return {}  # as SGLang: no id, nothing aborted (vLLM would abort everything)
        ids = [] if abort_all else [_RID_PREFIX + rid]  # an empty list aborts everything the server runs
        return await self._post("/abort_requests", timeout_s, json={"request_ids": ids})

    async def pause(self, mode: str = "abort", timeout_s: float = 10.0) -> dict:
        if mode not in _PAUSE_MODES:
            raise EngineRejected(f"mode: must be one of {sorted(_PAUSE_MODES)}, got {mode!r}", "mode")
        return await self._post("/pause", timeout_s, params={"mode": _PAUSE_MODES[mode]})

    async def resume(self, timeout_s: float = 10.0) -> dict:
        return await self._post("/resume", timeout_s)

    async def update_weights_from_disk(self, model_path: str, weight_version: int, timeout_s: float = 120.0) -> dict:
        """Load ``model_path`` in place and label it ``weight_version``; the answer's
        ``weight_version`` is read back from the server. A server that is generating is paused
        (requests kept) for the load, so no token comes from half-loaded weights, and resumed
        even when the load fails or runs out of time."""
        res = await self._worker_load(
            "rollmesh_load_weights",
            [model_path],
            weight_version,
            timeout_s,
            "model_path",
            f"cannot load {model_path!r}",
        )
        info = await self.model_info(min(10.0, timeout_s))
        loaded = (res.get("results") or ["?"])[0]
        return {"success": True, "message": f"loaded {loaded} tensors", "weight_version": info["weight_version"]}

    async def _worker_load(
        self, method: str, args: list, weight_version: int | None, timeout_s: float, field: str, what: str
    ) -> dict:
        """Run a loading worker method through ``/collective_rpc``; with ``weight_version``, label it
        and drop the KV the old weights made. A server that is generating is paused (requests kept)
        for the load, so no token comes from half-loaded weights, and resumed even when the load
        fails or runs out of time. A worker error naming ``field`` is the caller's input's fault."""
        deadline = time.monotonic() + max(0.5, timeout_s - _RESUME_RESERVE_S)

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        paused = bool((await self._get("/is_paused", left())).get("is_paused"))
        if not paused:
            await self.pause("in_place", left())
        try:
            rpc = {"method": method, "args": args, "timeout": left()}
            try:
                res = await self._post_alone("/collective_rpc", left(), json=rpc)
            except EngineUnavailable as e:  # the worker raised: vLLM answers 500 with its message
                if field in str(e):
                    raise EngineRejected(f"{field}: {what}: {e}", field) from e
                raise
            if weight_version is not None:
                await self._post("/update_weight_version", left(), json={"new_version": str(weight_version)})
                # KV cached by the old weights must go, the running requests' included (they are
                # recomputed when generation resumes); without them vLLM refuses while any are held.
                reset = await self._post("/reset_prefix_cache", left(), params={"reset_running_requests": "true"})
                if not reset.get("success"):
                    raise EngineUnavailable(f"{self.base_url}: the prefix cache was not reset after {method}")
        finally:
            if not paused:  # shielded: a caller's timeout must not leave the engine frozen
                await asyncio.shield(self.resume(_RESUME_RESERVE_S))
        return res

    # ---- the collective transport, as rollmesh's worker extension implements it
    async def server_info(self, timeout_s: float = 5.0) -> dict:
        return {"tp_size": 1}  # rollmesh starts vLLM with one worker (tensor parallelism: not yet)

    async def lora_adapters(self, timeout_s: float = 5.0) -> list[str]:
        """The names of the LoRA adapters loaded: vLLM lists each as a model with a parent."""
        models = (await self._get("/v1/models", timeout_s)).get("data", [])
        return [m["id"] for m in models if isinstance(m, dict) and m.get("parent")]

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = 120.0,
    ) -> dict:
        rpc = {
            "method": "rollmesh_join_weight_group",
            "timeout": timeout_s,
            "args": [master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s],
        }
        res = await self._post_alone("/collective_rpc", timeout_s, json=rpc)
        return {"success": True, "message": f"rank {(res.get('results') or ['?'])[0]} of {world_size}"}

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None,
        timeout_s: float = 120.0,
    ) -> dict:
        res = await self._worker_load(
            "rollmesh_receive_weights",
            [names, dtypes, shapes, group_name, weight_version is not None],
            weight_version,
            timeout_s,
            "names",
            "cannot receive the weights",
        )
        out = {"success": True, "received_checksum": (res.get("results") or [""])[0]}
        if weight_version is not None:
            out["weight_version"] = (await self.model_info(min(10.0, timeout_s)))["weight_version"]
        return out

    async def update_weights_from_safetensors(
        self,
        data: bytes,
        weight_version: int,
        final: bool,
        timeout_s: float = 120.0,
        base_version: int | None = None,
        checksum: str = "",
        adapter: bool = False,
    ) -> dict:
        raise EngineRejected(
            "train_loop.publisher.type: vLLM engines load weights from disk or over a group (disk, collective)",
            "train_loop.publisher.type",
        )

    async def update_weights_from_tensor(
        self, payload: str, weight_version: int | None, timeout_s: float = 120.0
    ) -> dict:
        return await self.update_weights_from_safetensors(b"", weight_version or 0, True, timeout_s)

    async def release_memory_occupation(self, tags: list[str] | None = None, timeout_s: float = 60.0) -> dict:
        raise EngineRejected("devices.placement: colocated engines are SGLang or embedded ones, not vLLM", "tags")

    resume_memory_occupation = release_memory_occupation

    async def update_weights_from_tensors(
        self, buckets: list[dict], weight_version: int, timeout_s: float = 120.0
    ) -> dict:
        return await self.update_weights_from_safetensors(b"", weight_version, True, timeout_s)

    async def model_info(self, timeout_s: float = 5.0) -> dict:
        body = await self._get("/weight_info", timeout_s)
        return {"weight_version": int_version(body.get("weight_version"))}
