"""Constrained decoding in the embedded engine (SGLang's json_schema / regex / ebnf sampling params,
xgrammar's token bitmask): answers follow their grammar, in one continuous batch with rows that are
not constrained, and each token's log-prob is that of the masked distribution it was sampled from."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.engines.contract import EngineError
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams

T = 60
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}
REGEX = "(yes|no) [0-9]{2}"


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = EmbeddedEngine(EngineConfig(model_path=tiny_model, num_threads=1)).start()
    yield eng
    eng.shutdown()


def _text(tok, out) -> str:
    ids = out.output_ids[:-1] if out.finish_reason.get("type") == "stop" else out.output_ids
    return tok.decode(ids)


def test_answers_follow_their_grammar_beside_rows_that_are_not_constrained(engine, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.encode("hello there")
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.submit("alone", prompt, greedy).result(T).output_ids
    futures = {}
    for i in range(4):  # one prompt: its samples share a prefill, each with a matcher of its own
        futures[f"re{i}"] = engine.submit(
            f"re{i}", prompt, SamplingParams(max_new_tokens=32, sampling_seed=i, regex=REGEX)
        )
        schema = SamplingParams(max_new_tokens=64, sampling_seed=i, json_schema=json.dumps(SCHEMA))
        futures[f"js{i}"] = engine.submit(f"js{i}", prompt, schema)
    futures["plain"] = engine.submit("plain", prompt, greedy)
    outs = {k: f.result(T) for k, f in futures.items()}
    for k, out in outs.items():
        if k == "plain":
            assert out.output_ids == alone  # the masks of its neighbours changed nothing of its own
            continue
        assert out.finish_reason["type"] == "stop", (k, out.finish_reason)
        text = _text(tok, out)
        if k.startswith("re"):
            assert re.fullmatch(REGEX, text), text
        else:
            assert json.loads(text)["a"] in ("x", "y") and set(json.loads(text)) == {"a"}, text
    assert engine.counters["constrained_tokens"] >= sum(len(o.output_ids) for k, o in outs.items() if k != "plain")


def test_a_constrained_tokens_logprob_is_the_masked_distributions(engine, tiny_model):
    """μ of every constrained token equals log_softmax over the tokens its grammar allowed there
    (replayed with a matcher over the answer); without the mask it would not."""
    import xgrammar as xgr

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.encode("a json please")
    params = SamplingParams(max_new_tokens=64, temperature=1.0, sampling_seed=3, json_schema=json.dumps(SCHEMA))
    out = engine.submit("mu", prompt, params).result(T)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1].float()
    matcher = engine.grammars.matcher(params)
    bitmask = xgr.allocate_token_bitmask(len(out.output_ids), logits.shape[-1])
    for i, t in enumerate(out.output_ids):
        matcher.fill_next_token_bitmask(bitmask, i)
        assert matcher.accept_token(t)
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    at = torch.arange(len(out.output_ids)), torch.tensor(out.output_ids)
    with_mask = torch.log_softmax(masked, -1)[at]
    without = torch.log_softmax(logits, -1)[at]
    mu = torch.tensor(out.behavior_logprobs)
    assert torch.allclose(mu, with_mask, atol=1e-4), (mu - with_mask).abs().max()
    assert (without < mu - 0.5).any()  # the unmasked policy is far from μ on constrained tokens


def test_a_grammar_that_does_not_compile_is_refused_by_field_and_the_engine_serves_on(engine):
    for params, field in (
        (SamplingParams(regex="(unclosed"), "sampling_params.regex"),
        (SamplingParams(ebnf="root ::= missing_rule"), "sampling_params.ebnf"),
        (SamplingParams(json_schema=json.dumps({"type": "no-such-type"})), "sampling_params.json_schema"),
        (SamplingParams(regex="a", ignore_eos=True), "sampling_params.ignore_eos"),
    ):
        with pytest.raises(EngineError) as e:
            engine.grammars.compile_within(params)
            engine.submit("bad", [1, 2, 3], params)
        assert e.value.field == field, (field, e.value)
    with pytest.raises(ValueError, match="regex and ebnf: one grammar a request"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match="not JSON"):
        SamplingParams(json_schema="{nope")
    with pytest.raises(ValueError, match="not JSON: RecursionError"):  # nested too deep to parse: a clean refusal
        SamplingParams(json_schema="[" * 60_000)
    with pytest.raises(ValueError, match="at most 65536 characters"):
        SamplingParams(regex="a" * 65_537)
    out = engine.submit("after", [1, 2, 3], SamplingParams(max_new_tokens=4, regex="[ab]+")).result(T)
    assert out.output_ids


def test_an_episode_under_a_grammar_records_it_for_the_trainer_turn_by_turn(engine, tiny_model):
    """An episode's sampling may name a grammar: each turn is decoded under it by the engine and the
    trajectory records it per turn (``turn_grammars``), which the trainer replays (its masks)."""
    import asyncio

    from rollout.episode import EpisodeConfig, run_episode
    from rollout.ports import Generation
    from sample_buffer.trajectory import FinishReason
    from tests.rollout.test_chat_turns import ScriptedChat

    tok = AutoTokenizer.from_pretrained(tiny_model)
    config = EpisodeConfig(max_turns=2, sampling={"json_schema": json.dumps(SCHEMA), "max_new_tokens": 48})
    asked = []

    async def generate(input_ids, sampling, trajectory_id, timeout_s):
        asked.append(sampling.grammar())
        out = await asyncio.wrap_future(engine.submit(f"{trajectory_id}-{len(asked)}", input_ids, sampling))
        reason = FinishReason.of_engine(out.finish_reason.get("type"))
        return Generation(out.output_ids, out.behavior_logprobs, [0] * len(out.output_ids), reason)

    env = ScriptedChat([("user", "again"), None])
    traj = asyncio.run(run_episode(env, 0, generate, tok, config, trajectory_id="t", group_id="g", prompt_id="p"))
    assert asked == [("json_schema", json.dumps(SCHEMA))] * 2
    assert traj.metadata["turn_grammars"] == [["json_schema", json.dumps(SCHEMA)]] * 2
    assert [json.loads(a)["a"] in ("x", "y") for a in env.actions] == [True, True]  # each turn's answer follows it


def test_top_logprobs_under_a_grammar_are_the_tokens_it_allows(engine):
    """A grammar that allows two tokens next: the top five are those two (finite), never -inf entries
    (which JSON cannot carry)."""
    out = engine.submit("tops", [1, 2, 3], SamplingParams(max_new_tokens=2, regex="[ab]"), top_logprobs_num=5).result(T)
    first = out.top_logprobs[0]
    assert 1 <= len(first) <= 2 and all(v > float("-inf") for _, v in first), first
    assert abs(sum(torch.tensor([v for _, v in first]).exp().tolist()) - 1) < 1e-4  # all the masked mass


def test_a_compile_past_its_deadline_does_not_hold_up_the_next_grammar(tiny_model):
    """xgrammar's compile cannot be stopped: one past its deadline is refused and runs on alone,
    while the next grammar compiles on a thread of its own (it waited behind it before); at most
    ``MAX_OVERDUE`` such compiles run at once, past that a new grammar is refused by name."""
    import threading
    import time

    from rollout.engines.embedded.grammar import MAX_OVERDUE, Grammars

    grammars = Grammars(AutoTokenizer.from_pretrained(tiny_model), 256, [2])
    gate, real = threading.Event(), grammars._compile
    slow = {("regex", f"slow{i}") for i in range(MAX_OVERDUE)}
    grammars._compile = lambda key: (key in slow and gate.wait(30), real(key))[1]  # held until the test says
    try:
        for i in range(MAX_OVERDUE):
            with pytest.raises(EngineError, match="did not compile within 0.2 s"):
                grammars.compile_within(SamplingParams(regex=f"slow{i}"), timeout_s=0.2)
            if i + 1 < MAX_OVERDUE:  # below the bound: the next one is not held up behind the slow ones
                grammars.compile_within(SamplingParams(regex=f"fast{i}"), timeout_s=5)
        with pytest.raises(EngineError, match=f"{MAX_OVERDUE} grammars past their compile deadline") as e:
            grammars.compile_within(SamplingParams(regex="next"), timeout_s=5)
        assert e.value.field == "sampling_params.regex"
    finally:
        gate.set()
    deadline = time.monotonic() + 10
    while grammars._overdue and time.monotonic() < deadline:
        time.sleep(0.01)
    grammars.compile_within(SamplingParams(regex="next"), timeout_s=5)  # the slow ones ended: room again
    assert grammars._cached(("regex", "slow0")) is not None  # and their compiles were kept
