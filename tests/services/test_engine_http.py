"""The embedded engine's HTTP server in its own process, driven by the SGLang client and raw HTTP."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch
import uvicorn
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from rollout.engines.sglang.client import (
    EngineRejected,
    EngineUnavailable,
    parse_generate_response,
    parse_score_response,
)
from sample_buffer.deadlines import wait_for
from services.auth import AuthConfig, http_headers
from services.llm_proxy.server import engine_client


def post(url, path, headers=None, **kw):
    return httpx.post(url + path, timeout=60, headers={**http_headers(AuthConfig()), **(headers or {})}, **kw)


def test_generate_speaks_sglang_fields(engine_url):
    r = post(
        engine_url,
        "/generate",
        json={
            "input_ids": [1, 10, 11],
            "rid": "x1",
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 5,
                "temperature": 0.8,
                "top_p": 0.9,
                "top_k": 20,
                "ignore_eos": True,
                "sampling_seed": 3,
            },
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 5 and meta["id"] == "x1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5
    assert meta["weight_version"] == "0" and meta["e2e_latency"] > 0
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == body["output_ids"] and all(t[2] is None and t[0] <= 0 for t in triples)


def test_batch_generate_and_logprobs_match_teacher_forcing(engine_url, tiny_model):
    prompts = [[1, 2, 3], [1] + list(range(50, 80))]
    r = post(
        engine_url,
        "/generate",
        json={
            "input_ids": prompts,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
        },
    )
    outs = [parse_generate_response(b) for b in r.json()]
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p + o.output_ids])).logits[0], -1)[len(p) - 1 : -1]
        ref = lp.gather(-1, torch.tensor(o.output_ids)[:, None]).squeeze(-1)
        assert (ref - torch.tensor(o.behavior_logprobs)).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"input_ids": [], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ({"input_ids": [1, 999999], "sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ({"input_ids": [[1], [2, 999999]]}, "input_ids[1]"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": [[1], [2]], "stream": True}, "stream"),  # a stream carries one prompt
        ({"input_ids": [1], "rid": 5}, "rid"),  # a union member's type name is not a field
        ({"input_ids": [1] * 5000}, "input_ids"),  # longer than the context: the prompt, not max_new_tokens
        ({"input_ids": [1], "sampling_params": {"top_k": 2**70}}, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**64}}, "sampling_params.sampling_seed"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"input_ids": [1], "sampling_params": {"n": 10**6}}, "sampling_params.n"),
        ({"input_ids": [1], "sampling_params": {"n": 2.5}}, "sampling_params.n"),
        ({"input_ids": [[1], [2]], "sampling_params": {"n": 2}}, "sampling_params.n"),  # one prompt's samples
        ({"input_ids": [1], "sampling_params": {"n": 2}, "stream": True}, "sampling_params.n"),
        ({"text": ["a", "b"], "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"input_ids": [1] * 5000, "sampling_params": {"n": 1000}}, "sampling_params.n"),  # 5 M tokens from 20 KB
        ({"input_ids": [1], "sampling_params": {"n": 3}, "rid": ["a", "b"]}, "rid"),
        ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 65}, "top_logprobs_num"),  # at most 64
        # constrained decoding: a grammar that does not compile, two of them, or a batch's bad one, by field
        ({"input_ids": [1], "sampling_params": {"regex": "(unclosed"}}, "sampling_params.regex"),
        ({"input_ids": [1], "sampling_params": {"ebnf": "root ::= nothing"}}, "sampling_params.ebnf"),
        ({"input_ids": [1], "sampling_params": {"json_schema": "{nope"}}, "sampling_params.json_schema"),
        ({"input_ids": [1], "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params"),
        ({"input_ids": [1], "sampling_params": {"regex": "a" * 70_000}}, "sampling_params.regex"),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{"regex": "a"}, {"regex": "("}]},
            "sampling_params[1].regex",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(engine_url, payload, field):
    r = post(engine_url, "/generate", json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field, r.json()


def test_sglangs_scoring_request_returns_each_prompt_tokens_log_prob(engine_url, tiny_model):
    """SGLang's prefill-only request (logprob_start_len, max_new_tokens 0): input_token_logprobs, one
    [logprob, id, text] per token from the start on, equal to a forward of the model; nothing generated."""
    seqs = [[1, 30, 31, 32, 33, 34], [2, 7, 7, 9]]
    body = {"input_ids": seqs, "logprob_start_len": [2, 0], "sampling_params": {"max_new_tokens": 0}}
    r = post(engine_url, "/generate", json=body | {"return_logprob": True})
    assert r.status_code == 200, r.text
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for s, start, out in zip(seqs, [2, 0], r.json(), strict=True):
        assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
        triples = out["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in triples] == s[start:]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].float(), -1)
        want = ref.gather(-1, torch.tensor(s[1:])[:, None])[:, 0].tolist()
        got = [t[0] for t in triples]
        if start == 0:
            assert got[0] is None
            got = got[1:]
        assert max(abs(a - b) for a, b in zip(got, want[max(start, 1) - 1 :], strict=True)) <= 1e-4
    one = post(engine_url, "/generate", json={**body, "input_ids": seqs[0], "logprob_start_len": 5})
    assert one.status_code == 200 and len(one.json()["meta_info"]["input_token_logprobs"]) == 1


def test_the_engine_client_scores_and_refuses_an_answer_short_of_the_tokens_asked(engine_url):
    seq = [1, 30, 31, 32, 33, 34]

    async def go():
        client = engine_client(engine_url)
        try:
            return await client.score(seq, 2), await client.score(seq, 2, top_k=3)
        finally:
            await client.close()

    got, topped = asyncio.run(go())
    body = {"input_ids": seq, "logprob_start_len": 2, "sampling_params": {"max_new_tokens": 0}}
    direct = post(engine_url, "/generate", json=body).json()["meta_info"]
    assert got.logprobs == [t[0] for t in direct["input_token_logprobs"]] and len(got.logprobs) == 4
    assert got.weight_version == 0 and got.top_logprobs == [] and "input_top_logprobs" not in direct
    # SGLang's top_logprobs_num: each position's most likely tokens, as [logprob, id, text] triples
    meta = post(engine_url, "/generate", json=body | {"top_logprobs_num": 3}).json()["meta_info"]
    assert topped.logprobs == got.logprobs
    assert topped.top_logprobs == [[(t[1], t[0]) for t in row] for row in meta["input_top_logprobs"]]
    assert [len(row) for row in topped.top_logprobs] == [3] * 4
    with pytest.raises(EngineUnavailable, match="not 3 for each of the 4 tokens"):
        parse_score_response({"meta_info": meta | {"input_top_logprobs": meta["input_top_logprobs"][:3]}}, seq, 2, 3)
    short = {"meta_info": {"input_token_logprobs": [[-1.0, 31, None], [-2.0, 32, None]]}}
    with pytest.raises(EngineUnavailable, match="2 log-probs for the 4 tokens"):
        parse_score_response(short, seq, 2)
    positive = {"meta_info": {"input_token_logprobs": [[0.5, t, None] for t in seq[2:]]}}
    with pytest.raises(EngineUnavailable, match="finite and <= 0"):
        parse_score_response(positive, seq, 2)


@pytest.mark.parametrize(
    "payload, field",
    [
        (
            {"input_ids": [1, 2], "logprob_start_len": 1, "sampling_params": {"max_new_tokens": 4}},
            "sampling_params.max_new_tokens",
        ),
        ({"input_ids": [1, 2], "logprob_start_len": 1}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1, 2], "logprob_start_len": 2, "sampling_params": {"max_new_tokens": 0}}, "logprob_start_len"),
        (
            {"input_ids": [[1, 2], [1, 10**6]], "logprob_start_len": 1, "sampling_params": {"max_new_tokens": 0}},
            "input_ids[1]",
        ),
        (
            {"input_ids": [[1, 2]], "logprob_start_len": [1, 1], "sampling_params": {"max_new_tokens": 0}},
            "logprob_start_len",
        ),
        (
            {"input_ids": [1, 2], "logprob_start_len": 1, "sampling_params": {"max_new_tokens": 0}, "stream": True},
            "stream",
        ),
    ],
)
def test_a_bad_scoring_request_is_a_400_naming_the_field(engine_url, payload, field):
    r = post(engine_url, "/generate", json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field, r.json()


def test_sglangs_grammar_params_constrain_the_answer(engine_url, tiny_model):
    """SGLang's sampling params verbatim: each answer of a batch follows its own grammar (or none)."""
    import json
    import re

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": False}
    params = [
        {"max_new_tokens": 48, "json_schema": json.dumps(schema)},
        {"max_new_tokens": 16, "regex": "(red|blue)!"},
        {"max_new_tokens": 16, "ebnf": 'root ::= "A" [0-9] "Z"'},
        {"max_new_tokens": 4, "temperature": 0},
    ]
    r = post(engine_url, "/generate", json={"input_ids": [[1, 2, 3]] * 4, "sampling_params": params})
    assert r.status_code == 200, r.text
    answers = r.json()
    # SGLang's json_schema allows any whitespace between tokens, and an untrained policy may spend all
    # 48 tokens in it: every token must be one the schema's grammar accepts, and a finished answer is
    # a whole document of the schema.
    ids, finish = answers[0]["output_ids"], answers[0]["meta_info"]["finish_reason"]["type"]
    matcher = _matcher(tok, json.dumps(schema), tiny_model)
    assert all(matcher.accept_token(t) for t in ids), tok.decode(ids)
    if finish == "stop":
        assert matcher.is_terminated() and json.loads(tok.decode(ids[:-1]))["n"] in (1, 2)
    else:
        assert finish == "length" and len(ids) == 48
    texts = [tok.decode(a["output_ids"][:-1]) for a in answers[1:3]]
    assert re.fullmatch("(red|blue)!", texts[0]) and re.fullmatch("A[0-9]Z", texts[1]), texts
    assert all(a["meta_info"]["finish_reason"]["type"] == "stop" for a in answers[1:3])


def _matcher(tok, schema: str, model_path: str):
    """xgrammar's matcher of a JSON schema as SGLang compiles it (any whitespace), for ``tok``, ending
    at the tokens the engine stops at."""
    import xgrammar as xgr

    from sample_buffer.grammars import stop_token_ids

    stops = sorted(stop_token_ids(model_path))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=stops)
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(schema))


def test_parallel_sampling_is_n_samples_of_one_prompt_each_with_its_rid(engine_url, tiny_model):
    """SGLang's sampling_params.n: a list of n answers, each sampled on its own, each under its own rid
    (SGLang's {rid}_{i} from one rid, or a list), each's log-probs the teacher-forced ones."""
    prompt = [1, 50, 51, 52]
    r = post(
        engine_url,
        "/generate",
        json={
            "input_ids": prompt,
            "rid": "par",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "n": 4},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [b["meta_info"]["id"] for b in body] == [f"par_{i}" for i in range(4)]
    assert len({tuple(b["output_ids"]) for b in body}) > 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for b in body:
        ids = b["output_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1], -1)
        ref = lp.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert (ref - torch.tensor(parse_generate_response(b).behavior_logprobs)).abs().max() < 1e-4
    listed = post(engine_url, "/generate", json={"input_ids": prompt, "rid": ["a", "b"], "sampling_params": {"n": 2}})
    assert [b["meta_info"]["id"] for b in listed.json()] == ["a", "b"]


def test_malformed_json_is_a_400_and_the_server_keeps_serving(engine_url):
    r = post(engine_url, "/generate", content=b'{"input_ids": [1, 2', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["message"]
    r = post(engine_url, "/generate", content=b"\x80", headers={"content-type": "application/json"})  # not UTF-8
    assert r.status_code == 400 and r.json()["field"] == "body" and "malformed JSON" in r.json()["message"]
    r = post(engine_url, "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200


def test_abort_request_returns_partial(engine_url):
    async def go():
        client = engine_client(engine_url)
        # Nearly the whole context (1024), about a second of decoding: the abort lands mid-request.
        task = asyncio.create_task(client.generate([1, 4], {"max_new_tokens": 1000, "ignore_eos": True}, rid="abt"))
        await asyncio.sleep(0.1)
        res = await client.abort("abt")
        out = await task
        await client.close()
        return res, out

    res, out = asyncio.run(go())
    assert res["num_aborted"] == 1
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 1000
    assert len(out.behavior_logprobs) == len(out.output_ids)


def test_pause_continue_and_model_info(engine_url):
    async def go():
        client = engine_client(engine_url)
        await client.pause("in_place")
        task = asyncio.create_task(client.generate([1, 4], {"max_new_tokens": 3}))
        await asyncio.sleep(0.3)
        waiting = not task.done()
        await client.resume()
        out = await wait_for(task, 30)
        info = await client.model_info()
        with pytest.raises(EngineRejected, match="mode"):
            await client.pause("sideways")
        await client.close()
        return waiting, out, info

    waiting, out, info = asyncio.run(go())
    assert waiting and len(out.output_ids) >= 1
    assert info["weight_version"] == "0" and info["is_generation"] and len(info["weights_checksum"]) == 16


def test_metrics_endpoint(engine_url):
    post(engine_url, "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    text = httpx.get(engine_url + "/metrics").text
    assert "rollmesh_engine_generated_tokens_total" in text
    assert "rollmesh_engine_weight_version" in text and "rollmesh_engine_generation_latency_seconds_bucket" in text


def test_weight_updates_over_http(make_engine_process, tiny_model_b):
    _, url = make_engine_process()
    b = AutoModelForCausalLM.from_pretrained(tiny_model_b).eval()
    prompt = [1, 60, 61]
    ref = b.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref[0, 3:].tolist()
    greedy = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}

    async def go():
        client = engine_client(url)
        res = await client.update_weights_from_disk(tiny_model_b, 4)
        after_disk = (await client.generate(prompt, greedy)).output_ids
        version = (await client.model_info())["weight_version"]
        state = {k: v for k, v in b.state_dict().items() if k != "lm_head.weight"}
        names = sorted(state)
        buckets = [{n: state[n] for n in names[i : i + 10]} for i in range(0, len(names), 10)]
        res2 = await client.update_weights_from_tensors(buckets, 5)
        after_tensors = await client.generate(prompt, greedy)
        with pytest.raises(EngineRejected, match="model_path"):
            await client.update_weights_from_disk("/does/not/exist", 6)
        await client.close()
        return res, after_disk, version, res2, after_tensors

    res, after_disk, version, res2, after_tensors = asyncio.run(go())
    assert res["success"] and res["weight_version"] == 4 and version == "4"
    assert after_disk == ref
    assert res2["weight_version"] == 5 and res2["checksum"] == res["checksum"]
    assert after_tensors.output_ids == ref and set(after_tensors.token_versions) == {5}
    bad = post(url, "/update_weights_from_safetensors", content=b"not safetensors")
    assert bad.status_code == 400 and bad.json()["field"] == "body"
    bad = post(url, "/update_weights_from_safetensors", content=save({"nope": torch.zeros(1)}))
    assert bad.status_code == 400 and "nope" in bad.json()["message"]


def test_weights_load_only_from_the_engines_own_directories(tmp_path, tiny_model_b):
    """A caller's model_path used to reach from_pretrained as it came: a hub name was fetched, any
    directory loaded. Now only the model's directory and ``engine.load_roots`` are loadable."""
    from services.processes import start_engine_process, stop_process

    root, elsewhere = tmp_path / "exports", tmp_path / "elsewhere"
    root.mkdir()
    (elsewhere / "v1").mkdir(parents=True)
    (root / "escape").symlink_to(elsewhere / "v1")
    proc, url = start_engine_process(tiny_model_b, extra=[f"load_roots=[{root}]"])
    try:
        refusals = {
            path: post(url, "/update_weights_from_disk", json={"model_path": path, "weight_version": "1"}).json()
            for path in ("HuggingFaceTB/SmolLM2-135M", str(elsewhere / "v1"), str(root / "escape"), "/etc")
        }
        shutil.copytree(tiny_model_b, root / "v2")  # inside a root: loaded
        ok = post(url, "/update_weights_from_disk", json={"model_path": str(root / "v2"), "weight_version": "2"})
    finally:
        stop_process(proc)
    for path, body in refusals.items():
        assert body["field"] == "model_path" and "outside the directories" in body["message"], (path, body)
    assert ok.status_code == 200 and ok.json()["weight_version"] == 2


def test_the_client_drops_idle_connections_before_the_server_does(engine_url):
    """uvicorn (SGLang's server and ours) closes a connection idle for ``timeout_keep_alive``; a
    client that pooled it longer could reuse a socket just closed under it and take a healthy
    engine out of rotation (seen in `bench async`). The client's keep-alive must be shorter."""

    async def go():
        client = engine_client(engine_url)
        try:
            await client.model_info()
            return client._http().connector._keepalive_timeout  # aiohttp keeps it private
        finally:
            await client.close()

    assert asyncio.run(go()) < uvicorn.Config(app=None).timeout_keep_alive


def test_text_prompts_and_sglang_fields_it_accepts_or_names(engine_url, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    inert = {"log_metrics": False, "routing_key": "k", "priority": 3, "lora_path": None, "logprob_start_len": -1}
    params = {
        "max_new_tokens": 6,
        "ignore_eos": True,
        "temperature": 0,
        "skip_special_tokens": True,
        "n": 1,
        "frequency_penalty": 0.0,
        "stop": None,
    }
    r = post(engine_url, "/generate", json={"text": "kq7x", "sampling_params": params, **inert})
    assert r.status_code == 200, r.text
    by_ids = post(engine_url, "/generate", json={"input_ids": tok.encode("kq7x"), "sampling_params": params}).json()
    assert r.json()["output_ids"] == by_ids["output_ids"] and r.json()["text"] == tok.decode(by_ids["output_ids"])
    for body, field, says in [
        (
            {"text": "a", "sampling_params": {**params, "frequency_penalty": 0.5}},
            "sampling_params.frequency_penalty",
            "not supported by the embedded engine",
        ),
        ({"text": "a", "lora_path": "/adapters/x"}, "lora_path", "no adapter named '/adapters/x' is loaded"),
        ({"text": "a", "sampling_params": {"no_such_field": 1}}, "sampling_params.no_such_field", "unknown field"),
        ({"text": "a", "input_ids": [1]}, "input_ids", "exactly one of input_ids and text"),
        ({"text": ["a", "b"], "stream": True}, "stream", "one prompt"),
    ]:
        bad = post(engine_url, "/generate", json=body)
        assert bad.status_code == 400 and bad.json()["field"] == field and says in bad.json()["message"], bad.text


def test_top_level_fields_sglang_does_not_define_are_ignored_and_counted(engine_url):
    """SGLang's router adds `model` to every /generate it forwards; SGLang's server ignores such
    fields, so the embedded engine does too (counted), and answers the same tokens."""

    def ignored(field: str) -> float:
        text = httpx.get(engine_url + "/metrics", timeout=10).text
        line = f'rollmesh_engine_ignored_fields_total{{field="{field}"}}'
        return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)

    body = {"input_ids": [1, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    before = ignored("model"), ignored("other")
    plain = post(engine_url, "/generate", json=body)
    routed = post(engine_url, "/generate", json={**body, "model": "default", "x_router_hint": 3})
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == plain.json()["output_ids"]
    assert (ignored("model"), ignored("other")) == (before[0] + 1, before[1] + 1)


def test_stream_sends_each_token_then_the_answer_and_a_dropped_stream_aborts(engine_url):
    body = {
        "input_ids": [1, 4, 5],
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
    }
    with httpx.stream("POST", engine_url + "/generate", json=body, headers=http_headers(AuthConfig()), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [__import__("json").loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks[:-1]] == [1, 2, 3, 4, 5]  # cumulative, one event per token
    final = chunks[-1]
    assert final["output_ids"] == chunks[-2]["output_ids"] and final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["meta_info"]["output_token_logprobs"]) == 5

    long = {
        "input_ids": [1, 4, 6],
        "stream": True,
        "rid": "gone",
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
    }
    with httpx.stream("POST", engine_url + "/generate", json=long, headers=http_headers(AuthConfig()), timeout=60) as r:
        for n, line in enumerate(r.iter_lines()):  # noqa: B007
            if n >= 4:
                break  # the client goes away mid-stream
    running = 1
    for _ in range(50):
        running = httpx.get(engine_url + "/get_server_info", headers=http_headers(AuthConfig()), timeout=5).json()
        running = running["num_running"] + running["num_waiting"]
        if running == 0:
            break
        __import__("time").sleep(0.1)
    assert running == 0, "the dropped stream's request kept generating"


def test_sglang_housekeeping_endpoints(engine_url):
    h = http_headers(AuthConfig())
    assert httpx.get(engine_url + "/health_generate", headers=h, timeout=30).status_code == 200
    flushed = httpx.post(engine_url + "/flush_cache", headers=h, timeout=5)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    info = httpx.get(engine_url + "/get_model_info", headers=h, timeout=5).json()
    assert info["is_generation"] is True and "weight_version" in info
    server = httpx.get(engine_url + "/get_server_info", headers=h, timeout=5).json()
    assert {"num_running", "num_waiting", "counters"} <= set(server)


def test_a_streamed_answer_is_joined_from_cumulative_and_from_incremental_events():
    """SGLang streams everything so far by default and only what is new with
    --incremental-streaming-output; the answer is the same either way."""
    from rollout.engines.sglang.client import join_events

    def event(ids, done, lps, finish=None):
        triples = [[lp, t, None] for lp, t in zip(lps, ids)]
        return {
            "output_ids": ids,
            "meta_info": {
                "completion_tokens": done,
                "finish_reason": finish,
                "output_token_logprobs": triples,
                "weight_version": "3",
            },
        }

    cumulative = [
        event([5], 1, [-0.1]),
        event([5, 6], 2, [-0.1, -0.2]),
        event([5, 6, 7], 3, [-0.1, -0.2, -0.3], {"type": "length"}),
    ]
    incremental = [event([5], 1, [-0.1]), event([6], 2, [-0.2]), event([7], 3, [-0.3], {"type": "length"})]
    for events in (cumulative, incremental):
        res = parse_generate_response(join_events(events))
        assert res.output_ids == [5, 6, 7] and res.behavior_logprobs == [-0.1, -0.2, -0.3]
        assert res.token_versions == [3, 3, 3] and res.finish_reason == "length"


def test_routed_experts_from_a_start_position_as_sglang_sends_them(make_engine_process, tiny_moe):
    """``routed_experts_start_len``: the rows from that position on, the same ids as a whole answer's;
    past the prompt it is refused by name, and the client reads either answer back."""
    _, url = make_engine_process(model=tiny_moe)
    prompt = [1, 10, 11, 12, 13]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    whole = post(url, "/generate", json={**body, "return_routed_experts": True}).json()
    tail = post(url, "/generate", json={**body, "return_routed_experts": True, "routed_experts_start_len": 3}).json()
    full = parse_generate_response(whole).routed_experts
    part = parse_generate_response(tail, routing_start=3).routed_experts
    assert full.shape == (len(prompt) + 6 - 1, 4 * 2) and (part == full[3:]).all()
    bad = post(url, "/generate", json={**body, "return_routed_experts": True, "routed_experts_start_len": 6})
    assert bad.status_code == 400 and bad.json()["field"] == "routed_experts_start_len"


def test_images_in_sglang_image_data_one_per_placeholder_and_bad_ones_named(make_engine_process, tiny_vl, engine_url):
    from transformers import AutoTokenizer

    from tests.rollout.test_engine_vision import png

    _, url = make_engine_process(model=tiny_vl)
    start, pad, end = AutoTokenizer.from_pretrained(tiny_vl).convert_tokens_to_ids(
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    )
    prompt = [1, start, pad, end, 70, 71]
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    one = post(url, "/generate", json={"input_ids": prompt, "image_data": png(28, 28, 0), "sampling_params": greedy})
    assert one.status_code == 200, one.text
    assert one.json()["meta_info"]["prompt_tokens"] == len(prompt) - 1 + 16  # 28 px → 32: 8 × 8 patches, 2 × 2 merged
    batch = post(
        url,
        "/generate",
        json={"input_ids": [prompt, [1, 70, 71]], "image_data": [[png(28, 28, 0)], []], "sampling_params": greedy},
    )
    assert batch.status_code == 200, batch.text
    assert batch.json()[0]["output_ids"] == one.json()["output_ids"]
    for body, field in (
        ({"input_ids": prompt, "image_data": [[png(28, 28, 0)]]}, "image_data"),  # a batch's shape for one prompt
        ({"input_ids": [prompt, prompt], "image_data": [png(28, 28, 0)]}, "image_data"),
        ({"input_ids": prompt, "image_data": ["https://example.com/a.png"]}, "image_data[0]"),
        ({"input_ids": prompt, "image_data": [png(28, 28, 0), png(28, 28, 1)]}, "image_data"),
    ):
        bad = post(url, "/generate", json={**body, "sampling_params": greedy})
        assert bad.status_code == 400 and bad.json()["field"] == field, bad.text
    # a batch whose second prompt's image is bad: refused whole, the first aborted (its id free again)
    pair = {"input_ids": [prompt, prompt], "rid": ["b0", "b1"], "sampling_params": {**greedy, "max_new_tokens": 20}}
    bad = post(url, "/generate", json={**pair, "image_data": [[png(28, 28, 0)], ["https://x/y.png"]]})
    assert bad.status_code == 400 and bad.json()["field"] == "image_data[1][0]", bad.text
    retried = post(url, "/generate", json={**pair, "image_data": [[png(28, 28, 0)], [png(28, 28, 1)]]})
    assert retried.status_code == 200, retried.text
    again = post(url, "/generate", json={"input_ids": prompt, "image_data": png(28, 28, 0), "sampling_params": greedy})
    assert again.json()["output_ids"] == one.json()["output_ids"]
    text_only = post(engine_url, "/generate", json={"input_ids": [1, 2], "image_data": png(8, 8, 0)})
    assert text_only.status_code == 400 and text_only.json()["field"] == "image_data"
