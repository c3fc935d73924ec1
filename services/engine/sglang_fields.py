"""The fields of SGLang's ``/generate`` that the embedded engine accepts without serving them.

SGLang's own tools send fields from its ``GenerateReqInput`` and ``SamplingParams`` (see
``io_struct.py`` and ``sampling_params.py`` in SGLang). A field SGLang defines is not unknown
here: one that cannot change the tokens generated (routing hints, logging, detokenizer options)
is accepted and ignored; one that would change them is accepted at SGLang's default and refused,
named, at any other value, since silently ignoring it would return something else than asked.

A top-level field SGLang does not define is ignored, as SGLang's HTTP server ignores it (its request
is a dataclass FastAPI reads leniently): SGLang's router adds ``model`` to every ``/generate`` it
forwards. It is counted (``rollmesh_engine_ignored_fields_total``). Inside ``sampling_params`` an
unknown name stays an error, as it is in SGLang's ``SamplingParams``.
"""

from __future__ import annotations

from rollout.engines.contract import MAX_SAMPLES, EngineError

INERT_REQUEST = frozenset(
    {
        "session_id",
        "log_metrics",
        "priority",
        "routing_key",
        "conversation_id",
        "data_parallel_rank",
        "routed_dp_rank",
        "disagg_prefill_dp_rank",
        "kv_router_hint",
        "custom_labels",
        "no_logs",
        "extra_key",
        "cache_salt",
        "return_text_in_logprobs",
        "background",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "received_time",
        "external_trace_header",
        "http_worker_ipc",
    }
)
DEFAULT_ONLY_REQUEST = {
    "input_embeds": None,
    "video_data": None,
    "audio_data": None,
    "modalities": None,
    "session_params": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "logprob_start_len": -1,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "positional_embed_overrides": None,
}
INERT_SAMPLING = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"})
DEFAULT_ONLY_SAMPLING = {
    "stop": None,
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "structural_tag": None,  # (json_schema, regex and ebnf are SamplingParams': constrained decoding)
    "custom_params": None,
    "logit_bias": None,
}


def _at_default(value, default) -> bool:
    # SGLang reads null (and an empty stop list) as its default
    return value is None or value == default or (default is None and value in ([], "", {}))


def _strip(fields: dict, inert: frozenset, default_only: dict, where: str) -> dict:
    out = {}
    for name, value in fields.items():
        if name in default_only and not _at_default(value, default_only[name]):
            raise EngineError(
                f"{where}{name}",
                f"SGLang's {name} is not supported by the embedded engine; leave it at {default_only[name]!r}",
            )
        if name not in inert and name not in default_only:
            out[name] = value
    return out


# Prompt tokens n samples may hold in all (n × the prompt; a text prompt counts its characters): about
# what a request body of the engine's largest size holds as token ids, so n never grows a small body
# past what one could send anyway.
MAX_SAMPLED_TOKENS = 1 << 22


def expand_samples(body: dict) -> dict:
    """SGLang's parallel sampling, ``sampling_params.n`` > 1 on one prompt, as the batch it stands for:
    the prompt ``n`` times, each sample with its own rid (a list of ``n``, or SGLang's ``{rid}_{i}``
    from one), the answer a list of ``n``. The engine forwards a prompt admitted several times once
    (its samples share the prefill) and samples each on its own."""
    params = body.get("sampling_params")
    if not isinstance(params, dict) or "n" not in params:
        return body
    n = params["n"]
    if type(n) is not int or not 1 <= n <= MAX_SAMPLES:
        raise EngineError("sampling_params.n", f"must be an integer in [1, {MAX_SAMPLES}], got {n!r}")
    params = {k: v for k, v in params.items() if k != "n"}
    if n == 1:
        return body | {"sampling_params": params}
    prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], list | str)
    if not prompt or batch or body.get("stream"):
        raise EngineError("sampling_params.n", "n > 1 takes one prompt, not a batch or a stream")
    if n * len(prompt) > MAX_SAMPLED_TOKENS:  # what a small body may not grow into
        raise EngineError(
            "sampling_params.n", f"{n} samples of a {len(prompt)}-token prompt: at most {MAX_SAMPLED_TOKENS} tokens"
        )
    rid = body.get("rid")
    if isinstance(rid, list) and len(rid) != n:
        raise EngineError("rid", f"got {len(rid)} ids for n = {n} samples")
    out = body | {"sampling_params": [params] * n, "rid": rid if isinstance(rid, list) else None}
    out["input_ids" if body.get("input_ids") is not None else "text"] = [prompt] * n
    if isinstance(rid, str):
        out["rid"] = [f"{rid}_{i}" for i in range(n)]
    if body.get("image_data") is not None:
        images = body["image_data"]
        out["image_data"] = [[images] if isinstance(images, str) else list(images)] * n
    return out


def strip_request(body: dict, known: frozenset[str] = frozenset(), ignored: list[str] | None = None) -> dict:
    """``body`` without the SGLang fields the engine accepts and ignores (in its sampling params too);
    ``known``: the engine's own top-level fields: any other name is dropped and added to ``ignored``."""
    out = _strip(body, INERT_REQUEST, DEFAULT_ONLY_REQUEST, "")
    if known:
        for name in [n for n in out if n not in known]:
            del out[name]
            if ignored is not None:
                ignored.append(name)
    params = out.get("sampling_params")
    if isinstance(params, dict):
        out["sampling_params"] = _strip(params, INERT_SAMPLING, DEFAULT_ONLY_SAMPLING, "sampling_params.")
    elif isinstance(params, list):
        out["sampling_params"] = [
            _strip(p, INERT_SAMPLING, DEFAULT_ONLY_SAMPLING, f"sampling_params[{i}].") if isinstance(p, dict) else p
            for i, p in enumerate(params)
        ]
    return out
