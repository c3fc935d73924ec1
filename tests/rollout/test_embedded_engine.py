"""The engine core in-process, against plain transformers on the same weights."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engines.contract import EngineError
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams
from tests.rollout.engine_waits import wait_decoding

T = 60  # seconds: no test waits on the engine longer than this


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = EmbeddedEngine(EngineConfig(model_path=tiny_model, max_running_requests=8)).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


PROMPTS = [[1, 20, 21, 22], [1] + list(range(40, 75)), [3] * 9, [1, 100, 101, 102, 103, 104, 105]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_forward(engine, hf, temperature):
    futs = [
        engine.submit(
            f"lp{temperature}-{i}",
            p,
            SamplingParams(max_new_tokens=25 + 5 * i, temperature=temperature, ignore_eos=True, sampling_seed=i),
        )
        for i, p in enumerate(PROMPTS)
    ]
    for p, f in zip(PROMPTS, futs):
        out = f.result(T)
        ref = teacher_forced_logprobs(hf, p, out.output_ids, temperature)
        assert (ref - torch.tensor(out.behavior_logprobs)).abs().max().item() <= 1e-4
        assert out.finish_reason == {"type": "length", "length": len(out.output_ids)}


@pytest.mark.parametrize("start", [0, 1, 4])
def test_scoring_gives_each_token_from_start_its_teacher_forced_log_prob(engine, hf, start):
    """A teacher's answer: log p(x_t | x_<t) at temperature 1 for t >= start (None at position 0)."""
    seqs = PROMPTS[1:3]
    futs = [engine.score(s, start, top_k=4) for s in seqs]
    for s, f in zip(seqs, futs):
        got, tops = f.result(T)
        first = max(start, 1)
        ref = teacher_forced_logprobs(hf, s[:first], s[first:])
        assert len(got) == len(s) - start and got[: first - start] == [None] * (first - start)
        assert (ref - torch.tensor(got[first - start :])).abs().max().item() <= 1e-4
        # each position's four most likely tokens, best first, from the same distribution
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([s])).logits[0, first - 1 : -1].float(), -1)
        best = logp.topk(4, dim=-1)
        assert len(tops) == len(got) and tops[: first - start] == [None] * (first - start)
        assert [[i for i, _ in row] for row in tops[first - start :]] == best.indices.tolist()
        values = torch.tensor([[lp for _, lp in row] for row in tops[first - start :]])
        assert (best.values - values).abs().max() <= 1e-4
    assert engine.score(seqs[0], start).result(T)[1] == []  # none asked, none sent


def test_scores_that_wait_together_are_one_forward_and_each_equals_its_own(engine):
    """A group's members arrive at once: scored in one left-padded forward, each distinct sequence once,
    every answer what scoring it alone gives (lengths, starts and top-k all differ; one is sent twice)."""
    jobs = [(PROMPTS[1], 30, 3), (PROMPTS[0], 1, 0), (PROMPTS[3], 4, 2), (PROMPTS[0], 1, 0), ([5], 0, 2)]
    alone = [engine.score(ids, start, top_k=k).result(T) for ids, start, k in jobs]
    batches = engine.counters["score_batches"]
    gate = threading.Event()
    engine._commands.put(lambda: gate.wait(T))  # the scheduler thread busy: the scores wait together
    futures = [engine.score(ids, start, top_k=k) for ids, start, k in jobs]
    gate.set()
    together = [f.result(T) for f in futures]
    assert engine.counters["score_batches"] == batches + 1
    for (lps, tops), (want_lps, want_tops) in zip(together, alone, strict=True):
        assert len(lps) == len(want_lps) and len(tops) == len(want_tops)
        assert all(a == b or abs(a - b) <= 1e-4 for a, b in zip(lps, want_lps, strict=True))
        for row, want in zip(tops, want_tops, strict=True):
            assert row is want is None or [t for t, _ in row] == [t for t, _ in want]
    assert together[4] == ([None], [None])  # a lone token: no context, nothing scored


@pytest.mark.parametrize(
    "ids, start, field",
    [
        ([], 0, "input_ids"),
        ([1, 10**6], 1, "input_ids"),
        ([1, 2, 3], 3, "logprob_start_len"),
        ([1, 2], -1, "logprob_start_len"),
        ([1, 2], 1, "top_logprobs_num"),
    ],
)
def test_a_bad_scoring_request_is_refused_by_field(engine, ids, start, field):
    with pytest.raises(EngineError) as e:
        engine.score(ids, start, top_k=65 if field == "top_logprobs_num" else 0)
    assert e.value.field == field


def test_greedy_equals_hf_generate(engine, hf):
    futs = [
        engine.submit(f"g{i}", p, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    for p, f in zip(PROMPTS, futs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert f.result(T).output_ids == ref[0, len(p) :].tolist()


def test_short_request_is_not_held_back_by_a_long_one(engine):
    long = engine.submit("long", [1, 2, 3], SamplingParams(max_new_tokens=400, ignore_eos=True))
    wait_decoding(engine, "long")
    short = engine.submit("short", [1, 5], SamplingParams(max_new_tokens=3, ignore_eos=True))
    out = short.result(T)
    assert len(out.output_ids) == 3
    assert not long.done(), "the short request had to wait for the long one"
    assert len(long.result(T).output_ids) == 400


def test_stop_tokens_and_eos(engine, hf):
    greedy = engine.submit("s0", PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    ids = greedy.result(T).output_ids
    stop = ids[4]
    out = engine.submit("s1", PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[stop]))
    out = out.result(T)
    assert out.output_ids == ids[: ids.index(stop) + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop}


def test_abort_returns_exactly_the_tokens_generated_so_far(engine, hf):
    prompt = [1, 7, 8, 9]
    fut = engine.submit("ab", prompt, SamplingParams(max_new_tokens=600, temperature=0, ignore_eos=True))
    wait_decoding(engine, "ab")
    assert engine.abort("ab").result(T) == 1
    out = fut.result(T)
    assert out.finish_reason["type"] == "abort"
    assert 0 < len(out.output_ids) < 600
    assert len(out.behavior_logprobs) == len(out.output_ids)
    full = engine.submit(
        "ab2", prompt, SamplingParams(max_new_tokens=len(out.output_ids), temperature=0, ignore_eos=True)
    ).result(T)
    assert out.output_ids == full.output_ids  # a true prefix of what it would have generated


def test_seeded_sampling_is_reproducible_whatever_else_runs(engine):
    p = SamplingParams(max_new_tokens=20, temperature=1.0, sampling_seed=123, ignore_eos=True)
    alone = engine.submit("seed-a", PROMPTS[0], p).result(T).output_ids
    noise = [engine.submit(f"noise{i}", PROMPTS[1], SamplingParams(max_new_tokens=30)) for i in range(4)]
    crowded = engine.submit("seed-b", PROMPTS[0], p).result(T).output_ids
    [f.result(T) for f in noise]
    assert alone == crowded


def test_pause_in_place_holds_requests_and_continue_finishes_them(engine):
    fut = engine.submit("pp", [1, 2], SamplingParams(max_new_tokens=300, ignore_eos=True))
    wait_decoding(engine, "pp")
    engine.pause("in_place").result(T)
    queued = engine.submit("pq", [1, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    time.sleep(0.3)
    assert not fut.done() and not queued.done()
    engine.resume().result(T)
    assert len(fut.result(T).output_ids) == 300
    assert len(queued.result(T).output_ids) == 2


def test_pause_abort_returns_partial_and_retract_keeps_going(engine):
    fut = engine.submit("pa", [1, 2], SamplingParams(max_new_tokens=500, ignore_eos=True))
    wait_decoding(engine, "pa")
    assert engine.pause("abort").result(T) == 1
    out = fut.result(T)
    assert out.finish_reason["type"] == "abort" and len(out.output_ids) < 500
    engine.resume().result(T)
    fut = engine.submit("pr", [1, 2], SamplingParams(max_new_tokens=300, ignore_eos=True))
    wait_decoding(engine, "pr")
    engine.pause("retract").result(T)
    time.sleep(0.1)
    assert not fut.done()
    engine.resume().result(T)
    assert len(fut.result(T).output_ids) == 300


def test_bad_input_is_refused_with_the_field_named(engine):
    cases = [
        ([], SamplingParams(), "input_ids"),
        ([1, engine.vocab_size], SamplingParams(), "input_ids"),
        ([-1], SamplingParams(), "input_ids"),
        # The model refuses 0 where it is built; the engine checks again for callers that bypass it.
        ([1], SamplingParams.model_construct(max_new_tokens=0), "sampling_params.max_new_tokens"),
        ([1], SamplingParams(max_new_tokens=engine.max_context), "sampling_params.max_new_tokens"),
        ([1], SamplingParams(stop_token_ids=[10**6]), "sampling_params.stop_token_ids"),
        ([1] * engine.max_context, SamplingParams(max_new_tokens=1), "input_ids"),  # the prompt alone is too long
        # Beyond what a torch tensor / generator takes: they failed the whole running batch.
        ([1], SamplingParams(top_k=2**63), "sampling_params.top_k"),
        ([1], SamplingParams(sampling_seed=2**64), "sampling_params.sampling_seed"),
    ]
    for ids, params, field in cases:
        with pytest.raises(EngineError) as e:
            engine.submit("bad", ids, params)
        assert e.value.field == field
    assert len(engine.submit("ok", [1], SamplingParams(max_new_tokens=2)).result(T).output_ids) >= 1


def test_a_step_that_fails_while_admitting_answers_the_requests_it_admitted(engine, monkeypatch):
    import rollout.engines.embedded.engine as engine_module

    def broken(*args, **kwargs):
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(engine_module, "sample_next_tokens", broken)
    out = engine.submit("doomed", [1, 2, 3], SamplingParams(max_new_tokens=4)).result(T)  # hung before
    assert out.finish_reason["type"] == "abort" and "sampler exploded" in out.finish_reason["message"]
    monkeypatch.undo()
    # ignore_eos: a sampled EOS (1 in vocab) would end it after one token and fail this for no reason
    again = engine.submit("doomed", [1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True)).result(T)
    assert len(again.output_ids) == 2


def test_samples_of_one_prompt_admitted_together_share_its_prefill(engine, hf):
    """A group's samples of one prompt, admitted in one step, are forwarded once: the copies take its
    cache rows and last logits, then sample on their own. Each answer equals the same seed's alone,
    its log-probs the teacher-forced ones; other prompts in the same step are their own rows."""
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=s, ignore_eos=True) for s in range(6)]
    alone = [engine.submit(f"alone{s}", PROMPTS[1], p).result(T).output_ids for s, p in enumerate(params)]
    before = dict(engine.counters)
    engine.pause("in_place").result(T)  # everything submitted now is admitted in one step
    try:
        futs = [engine.submit(f"shared{s}", PROMPTS[1], p) for s, p in enumerate(params)]
        others = [engine.submit(f"other{i}", p, params[0]) for i, p in enumerate((PROMPTS[0], PROMPTS[2]))]
    finally:
        engine.resume().result(T)
    outs = [f.result(T) for f in futs]
    assert [o.output_ids for o in outs] == alone
    assert len({tuple(o.output_ids) for o in outs}) > 1  # the copies sampled on their own
    for o in outs:
        ref = teacher_forced_logprobs(hf, PROMPTS[1], o.output_ids)
        assert (ref - torch.tensor(o.behavior_logprobs)).abs().max().item() <= 1e-4
    for p, f in zip((PROMPTS[0], PROMPTS[2]), others):
        out = f.result(T)
        ref = teacher_forced_logprobs(hf, p, out.output_ids)
        assert (ref - torch.tensor(out.behavior_logprobs)).abs().max().item() <= 1e-4
    assert engine.counters["prefill_shared_tokens"] - before.get("prefill_shared_tokens", 0) == 5 * len(PROMPTS[1])
    assert engine.counters["prefill_tokens"] - before["prefill_tokens"] == len(PROMPTS[1]) + len(PROMPTS[0]) + 9
