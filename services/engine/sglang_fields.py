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

from rollout.engines.contract import EngineError

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
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
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
