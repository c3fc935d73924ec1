"""Async client for SGLang's HTTP API (and the embedded engine, which speaks the same subset).

It works unchanged against a real SGLang server: it only sends SGLang's field names and reads
``meta_info`` defensively (``output_token_weight_versions`` is a rollmesh extension that SGLang
does not send; ``weight_version`` is then used for every token). Where SGLang answers differently
from the embedded engine it follows SGLang's ``http_server.py``: ``/health`` and
``/abort_request`` answer 200 with an empty body; ``/update_weights_from_disk`` does not return
the version, so the client confirms it from the model info; older releases serve the model info
at ``/get_model_info`` only. No ``import sglang`` here. Sessions, timeouts and errors:
``rollout.engines.http_engine``.
"""

from __future__ import annotations

import logging

from rollout.engines.http_engine import (  # noqa: F401 (the errors are part of this client's API)
    EngineRejected,
    EngineResult,
    EngineUnavailable,
    HTTPEngineClient,
    OnTokens,
    ScoreResult,
    int_version,
)
from rollout.sampling import SamplingParams
from sample_buffer import routing
from sample_buffer.trajectory import FinishReason

log = logging.getLogger(__name__)


def parse_generate_response(body: dict, routing_start: int = 0) -> EngineResult:
    """``routing_start``: the request's ``routed_experts_start_len`` (where ``routed_experts`` begins)."""
    meta = body.get("meta_info", {})
    ids = list(body.get("output_ids", []))
    triples = meta.get("output_token_logprobs") or []
    version = int_version(meta.get("weight_version"))
    versions = meta.get("output_token_weight_versions") or [version] * len(ids)
    finish = meta.get("finish_reason") or {"type": "abort"}
    experts = None
    if meta.get("routed_experts") is not None:  # SGLang: the prompt's and output's tokens but the last
        positions = int(meta.get("prompt_tokens", 0)) + len(ids) - 1 - routing_start
        try:
            experts = routing.decode_sglang(meta["routed_experts"], positions)
        except routing.RoutingError as e:  # the tokens stand; without its routing the trainer drops it
            log.warning("generate %s: %s; routing dropped", meta.get("id", ""), e)
    return EngineResult(
        output_ids=ids,
        behavior_logprobs=[float(t[0]) for t in triples],
        token_versions=[int(v) for v in versions],
        finish_reason=FinishReason.of_engine(finish.get("type", "abort") if isinstance(finish, dict) else str(finish)),
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        e2e_latency_s=float(meta.get("e2e_latency", 0.0)),
        queue_time_s=float(meta["queue_time"]) if "queue_time" in meta else None,
        ttft_s=float(meta["ttft"]) if "ttft" in meta else None,
        top_logprobs=[[(int(t[1]), float(t[0])) for t in top or []] for top in meta.get("output_top_logprobs") or []],
        routed_experts=experts,
        routed_experts_start=routing_start,
    )


def parse_score_response(body: dict, input_ids: list[int], start: int, top_k: int = 0) -> ScoreResult:
    """SGLang's ``meta_info.input_token_logprobs`` for tokens ``start``.. of ``input_ids``: one
    finite log-prob <= 0 for each (position 0 has none, so ``start`` >= 1), for exactly those tokens;
    with ``top_k``, ``input_top_logprobs``: ``top_k`` of them at each position. An answer that says
    less or other is the engine's failure (``EngineUnavailable``), never padded."""
    meta = body.get("meta_info", {}) if isinstance(body, dict) else {}
    triples = meta.get("input_token_logprobs") or []
    want = input_ids[start:]
    try:
        lps = [float(t[0]) for t in triples]
        ids = [int(t[1]) for t in triples]
    except (TypeError, ValueError, IndexError):
        raise EngineUnavailable("input_token_logprobs: not [logprob, token id, text] triples") from None
    if ids != want:
        raise EngineUnavailable(f"input_token_logprobs: {len(ids)} log-probs for the {len(want)} tokens asked")
    if lps and not all(-float("inf") < x <= 0 for x in lps):
        raise EngineUnavailable("input_token_logprobs: log-probs must be finite and <= 0")
    return ScoreResult(lps, int_version(meta.get("weight_version")), _top_logprobs(meta, len(want), top_k))


def _top_logprobs(meta: dict, n: int, k: int) -> list[list[tuple[int, float]]]:
    """``input_top_logprobs``: k (id, log-prob) pairs for each of the n positions (none asked: [])."""
    if not k:
        return []
    rows = meta.get("input_top_logprobs") or []
    try:
        tops = [[(int(t[1]), float(t[0])) for t in row] for row in rows]
    except (TypeError, ValueError, IndexError):
        raise EngineUnavailable("input_top_logprobs: not lists of [logprob, token id, text] triples") from None
    if len(tops) != n or any(len(row) != k for row in tops):
        raise EngineUnavailable(f"input_top_logprobs: not {k} for each of the {n} tokens asked")
    if not all(-float("inf") < lp <= 0 for row in tops for _, lp in row):
        raise EngineUnavailable("input_top_logprobs: log-probs must be finite and <= 0")
    return tops


# What an incremental SGLang stream (``--incremental-streaming-output``) sends as deltas; joined here.
_PER_TOKEN_META = ("output_token_logprobs", "output_top_logprobs", "output_token_weight_versions")


def join_events(events: list[dict]) -> dict:
    """One ``/generate`` answer from the events of its stream. SGLang sends everything generated
    so far in each event by default, and only what is new with ``--incremental-streaming-output``;
    the embedded engine sends the whole answer last. Either way the answer is the last event, its
    per-token lists joined from every event when they were deltas."""
    last = events[-1]
    meta = last.get("meta_info", {})
    ids = last.get("output_ids", [])
    if len(ids) >= int(meta.get("completion_tokens", len(ids))):
        return last  # cumulative
    joined = {"output_ids": [t for e in events for t in e.get("output_ids", [])], "meta_info": dict(meta)}
    for key in _PER_TOKEN_META:
        if any(key in e.get("meta_info", {}) for e in events):
            joined["meta_info"][key] = [x for e in events for x in e.get("meta_info", {}).get(key) or []]
    return joined


class SGLangClient(HTTPEngineClient):
    """One SGLang (or embedded) engine server."""

    _model_info_path = "/model_info"  # "/get_model_info" once an older SGLang answered 404

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
        """One generation. ``top_logprobs``: also the most likely tokens at each position;
        ``on_tokens``: stream it, handing each event's new tokens over as they arrive;
        ``return_routed_experts``: an MoE model's experts per position, from ``routed_experts_start_len``
        (SGLang needs ``--enable-return-routed-experts``); ``image_data``: a vision-language prompt's
        images (base64), one placeholder token for each in ``input_ids``, which the server expands;
        ``lora_path``: the name of a loaded LoRA adapter to generate with (``load_lora_adapter``)."""
        if isinstance(sampling_params, SamplingParams):  # SGLang's names, every value sent: a server never
            sampling_params = sampling_params.model_dump(exclude_none=True)  # substitutes its own defaults
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = rid
        if top_logprobs:
            payload["top_logprobs_num"] = top_logprobs
        if image_data:
            payload["image_data"] = image_data
        if lora_path is not None:
            payload["lora_path"] = lora_path
        start = routed_experts_start_len if return_routed_experts else 0
        if return_routed_experts:
            payload["return_routed_experts"] = True
            if start:
                payload["routed_experts_start_len"] = start
        if on_tokens is None:
            return parse_generate_response(await self._post("/generate", timeout_s, json=payload), start)
        events, seen = [], 0
        async for event in self._post_events("/generate", timeout_s, json={**payload, "stream": True}):
            events.append(event)
            ids = event.get("output_ids") or []
            done = int(event.get("meta_info", {}).get("completion_tokens", len(ids)))
            new = ids[seen:] if len(ids) >= done else ids  # everything so far, or a delta
            seen += len(new)
            if new:
                on_tokens(list(new))
        if not events:
            raise EngineUnavailable(f"{self.base_url}/generate: a stream without an answer")
        return parse_generate_response(join_events(events), start)

    async def score(
        self, input_ids: list[int], start: int, timeout_s: float | None = None, top_k: int = 0
    ) -> ScoreResult:
        """The log-prob the model gives each token of ``input_ids`` from ``start`` (>= 1) on, and with
        ``top_k`` each position's most likely tokens: SGLang's prefill-only request
        (``logprob_start_len``, ``max_new_tokens`` 0, ``top_logprobs_num``); a teacher's call."""
        if start < 1:
            raise EngineRejected("logprob_start_len: the first token has no log-prob; start at 1 or later", "start")
        payload = {
            "input_ids": input_ids,
            "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
        } | ({"top_logprobs_num": top_k} if top_k else {})
        body = await self._post("/generate", timeout_s, json=payload)
        return parse_score_response(body, input_ids, start, top_k)

    async def generate_samples(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        rid: str,
        n: int,
        timeout_s: float | None = None,
        lora_path: str | None = None,
    ) -> list[EngineResult]:
        """``n`` samples of one prompt in one request (SGLang's parallel sampling, ``sampling_params.n``):
        the engine forwards the prompt once and samples each on its own; sample i is in flight as
        ``{rid}_{i}`` (SGLang's own naming of a parallel sample's rid; ``abort`` takes it)."""
        params = sampling_params.model_dump(exclude_none=True) | {"n": n}
        payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": rid}
        if lora_path is not None:
            payload["lora_path"] = lora_path
        body = await self._post("/generate", timeout_s, json=payload, listed=True)
        if not isinstance(body, list) or len(body) != n:
            raise EngineUnavailable(f"{self.base_url}/generate: asked {n} samples, got no list of them")
        return [parse_generate_response(b) for b in body]

    async def abort(self, rid: str | None = None, abort_all: bool = False, timeout_s: float = 5.0) -> dict:
        return await self._post("/abort_request", timeout_s, json={"rid": rid or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort", timeout_s: float = 10.0) -> dict:
        return await self._post("/pause_generation", timeout_s, json={"mode": mode})

    async def resume(self, timeout_s: float = 10.0) -> dict:
        return await self._post("/continue_generation", timeout_s, json={})

    async def update_weights_from_disk(self, model_path: str, weight_version: int, timeout_s: float = 120.0) -> dict:
        """Returns the engine's answer with ``weight_version`` the version it now serves (an int;
        -1 when it names none): SGLang's answer lacks it, so it is read back from the model info."""
        body = {"model_path": model_path, "weight_version": str(weight_version)}
        return await self._with_version(await self._post("/update_weights_from_disk", timeout_s, json=body), timeout_s)

    async def _with_version(self, res: dict, timeout_s: float) -> dict:
        """An update's answer with ``weight_version`` as an int, read back from the model info
        where the answer lacks it (SGLang's)."""
        if "weight_version" not in res:
            res["weight_version"] = (await self.model_info(min(timeout_s, 10.0))).get("weight_version")
        res["weight_version"] = int_version(res["weight_version"])
        return res

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
        """One bucket of named tensors as safetensors bytes (rollmesh extension); ``final`` applies
        every bucket of ``weight_version`` sent so far. ``base_version``: the buckets hold a delta
        against that version (``rollout/engines/weight_delta.py``); ``adapter``: a LoRA policy's
        factors (``rollout/engines/embedded/adapter_sync.py``); either's result must have ``checksum``."""
        params = {"final": str(final).lower(), "weight_version": weight_version}
        if base_version is not None:
            params |= {"base_version": base_version}
        if adapter:
            params |= {"adapter": "true"}
        if checksum:
            params |= {"checksum": checksum}
        # A connection per bucket: a pooled socket the server closed while the caller's loop was
        # busy broke midway through 256 MiB buckets sent through the proxy.
        return await self._post_alone("/update_weights_from_safetensors", timeout_s, params=params, data=data)

    async def update_weights_from_tensors(
        self, buckets: list[dict], weight_version: int, timeout_s: float = 120.0
    ) -> dict:
        """Send buckets of named CPU tensors in order; the last applies them."""
        from safetensors.torch import save

        if not buckets:
            raise ValueError("buckets: at least one bucket of tensors is needed")
        res: dict = {}
        for i, bucket in enumerate(buckets):
            data = save({k: v.contiguous() for k, v in bucket.items()})
            res = await self.update_weights_from_safetensors(data, weight_version, i == len(buckets) - 1, timeout_s)
        return res

    # ---- SGLang's collective weight update: the trainer is rank 0 of a group the engines join
    async def server_info(self, timeout_s: float = 5.0) -> dict:
        return await self._get("/get_server_info", timeout_s)

    async def lora_adapters(self, timeout_s: float = 5.0) -> list[str]:
        """The names of the LoRA adapters loaded (the embedded engine's server info lists them)."""
        return list((await self.server_info(timeout_s)).get("lora_adapters", []))

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
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._post("/init_weights_update_group", timeout_s, json=body)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None,
        timeout_s: float = 120.0,
        adapter: bool = False,
        checksum: str = "",
    ) -> dict:
        """Receive one bucket that rank 0 broadcasts; ``weight_version`` (the last bucket only)
        makes the engine serve it. The answer's ``weight_version`` is an int (-1: none named).
        ``adapter`` (rollmesh's): the tensors are a LoRA policy's factors, and the last bucket's
        result must have ``checksum``."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": True}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if adapter:
            body |= {"adapter": True, "checksum": checksum}
        res = await self._post("/update_weights_from_distributed", timeout_s, json=body)
        return res if weight_version is None else await self._with_version(res, timeout_s)

    async def update_weights_from_tensor(
        self,
        payload: str,
        weight_version: int | None,
        timeout_s: float = 120.0,
        adapter: bool = False,
        checksum: str = "",
    ) -> dict:
        """Tensors passed by handle (``rollout/engines/tensor_handles.py``) from a process on the same
        machine; ``weight_version`` (the last bucket only) makes the engine serve them. ``adapter``
        (rollmesh's): a LoRA policy's factors, the last bucket's result must have ``checksum``."""
        body = {"serialized_named_tensors": [payload], "flush_cache": True}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if adapter:
            body |= {"adapter": True, "checksum": checksum}
        res = await self._post("/update_weights_from_tensor", timeout_s, json=body)
        return res if weight_version is None else await self._with_version(res, timeout_s)

    async def release_memory_occupation(self, tags: list[str] | None = None, timeout_s: float = 60.0) -> dict:
        return await self._post("/release_memory_occupation", timeout_s, json={"tags": tags} if tags else {})

    async def resume_memory_occupation(self, tags: list[str] | None = None, timeout_s: float = 60.0) -> dict:
        return await self._post("/resume_memory_occupation", timeout_s, json={"tags": tags} if tags else {})

    async def destroy_weights_update_group(self, group_name: str, timeout_s: float = 10.0) -> dict:
        return await self._post("/destroy_weights_update_group", timeout_s, json={"group_name": group_name})

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float = 60.0) -> dict:
        """Serve the PEFT adapter in directory ``path`` (on the engine's machine) as ``name``."""
        return await self._post("/load_lora_adapter", timeout_s, json={"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str, timeout_s: float = 30.0) -> dict:
        return await self._post("/unload_lora_adapter", timeout_s, json={"lora_name": name})

    async def model_info(self, timeout_s: float = 5.0) -> dict:
        try:
            return await self._get(self._model_info_path, timeout_s)
        except EngineRejected as e:
            if e.status != 404 or self._model_info_path == "/get_model_info":
                raise
        self._model_info_path = "/get_model_info"  # an older SGLang: remembered for next time
        return await self._get(self._model_info_path, timeout_s)
