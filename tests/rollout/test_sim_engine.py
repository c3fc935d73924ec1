import math
import statistics
import time

import pytest

from rollout.engines.embedded.sampling import SamplingParams
from rollout.engines.sim import LengthModel, SimEngineConfig
from rollout.engines.sim.engine import SimEngine
from rollout.engines.sim.lengths import draw_length, trailing_run


def test_lengths_follow_the_configured_median_and_p99():
    model = LengthModel()
    xs = sorted(draw_length(model, f"r{i}") for i in range(20000))
    assert xs == sorted(draw_length(model, f"r{i}") for i in range(20000))  # deterministic per key
    assert 900 < statistics.median(xs) < 1100
    p99 = xs[int(0.99 * len(xs))]
    assert 12000 < p99 < 16384 and max(xs) == 16384  # the cap holds
    with pytest.raises(ValueError, match="p99"):
        draw_length(LengthModel(median=10, p99=5), "x")


def test_trailing_run():
    assert trailing_run([1, 2, 7, 7], 7) == 2 and trailing_run([7], 7) == 1 and trailing_run([1], 7) == 0


def _engine(**kw) -> SimEngine:
    length = kw.pop("length", 1000)
    cfg = SimEngineConfig(lengths=LengthModel(median=length, p99=length), **kw)
    return SimEngine(cfg).start()


def test_time_comes_from_the_decode_model():
    # 1000 tokens x 10 ms = 10 simulated seconds = 0.1 s of wall time at time_scale 100.
    eng = _engine(time_scale=100, decode_base_ms=10, decode_per_seq_ms=0)
    try:
        t0 = time.perf_counter()
        futs = [eng.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=5000)) for i in range(4)]
        outs = [f.result(timeout=5) for f in futs]
        wall = time.perf_counter() - t0
        assert [len(o.output_ids) for o in outs] == [1000] * 4
        assert all(o.finish_reason["type"] == "stop" for o in outs)
        assert 0.09 < wall < 0.3, wall
        # A larger batch makes every step slower: 8 sequences x 5 ms = 40 ms per step.
        eng2 = _engine(time_scale=100, decode_base_ms=0, decode_per_seq_ms=5, length=100)
        t0 = time.perf_counter()
        futs = [eng2.submit(f"s{i}", [1], SamplingParams(max_new_tokens=500)) for i in range(8)]
        [f.result(timeout=5) for f in futs]
        assert 0.035 < time.perf_counter() - t0 < 0.2  # 100 steps x 40 ms / 100
        eng2.shutdown()
    finally:
        eng.shutdown()


def test_max_new_tokens_ends_with_length_and_continuation_keeps_the_target():
    eng = _engine(time_scale=1000, decode_base_ms=10, decode_per_seq_ms=0, length=300)
    try:
        out = eng.submit("t#0", [5, 6], SamplingParams(max_new_tokens=100)).result(timeout=5)
        assert len(out.output_ids) == 100 and out.finish_reason["type"] == "length"
        # Continued with the partial tokens appended (what the LLMProxy does): 200 remain.
        out2 = eng.submit("t#1", [5, 6, *out.output_ids], SamplingParams(max_new_tokens=500)).result(timeout=5)
        assert len(out2.output_ids) == 200 and out2.finish_reason["type"] == "stop"
    finally:
        eng.shutdown()


def test_abort_pause_and_weight_versions(tmp_path):
    eng = _engine(time_scale=100, decode_base_ms=10, decode_per_seq_ms=0, length=1000, weight_load_s=0.1)
    try:
        fut = eng.submit("a", [1], SamplingParams(max_new_tokens=2000))
        time.sleep(0.03)
        assert eng.load_weights_from_disk(str(tmp_path), 7).result(timeout=5)["weight_version"] == "7"
        out = fut.result(timeout=5)
        assert out.token_versions[0] == 0 and out.token_versions[-1] == 7 and len(out.output_ids) == 1000
        fut = eng.submit("b", [1], SamplingParams(max_new_tokens=2000))
        time.sleep(0.02)
        assert eng.pause("abort").result(timeout=5) == 1
        out = fut.result(timeout=5)
        assert out.finish_reason["type"] == "abort" and 0 < len(out.output_ids) < 1000
        held = eng.submit("c", [1], SamplingParams(max_new_tokens=2000))
        time.sleep(0.05)
        assert not held.done()  # paused: nothing advances
        eng.resume().result(timeout=5)
        assert len(held.result(timeout=5).output_ids) == 1000
        with pytest.raises(ValueError, match="model_path"):
            eng.load_weights_from_disk(str(tmp_path / "missing"), 8)
    finally:
        eng.shutdown()


def test_a_prompts_share_of_the_length_makes_its_answers_alike_and_keeps_the_distribution():
    model = LengthModel(median=100, p99=2000, cap=100_000, prompt_share=0.8)
    alone = LengthModel(median=100, p99=2000, cap=100_000)
    draws = [[draw_length(model, f"p{p}/r{r}", prompt_key=f"p{p}") for r in range(8)] for p in range(400)]
    flat = sorted(x for row in draws for x in row)
    assert 80 <= flat[len(flat) // 2] <= 125  # the median stays the lognormal's
    logs = [[math.log(x) for x in row] for row in draws]
    within = statistics.mean(statistics.pvariance(row) for row in logs)
    between = statistics.pvariance([statistics.mean(row) for row in logs])
    assert between > 2 * within  # answers to one prompt are alike
    assert draw_length(alone, "k") == draw_length(alone, "k", prompt_key="anything")  # share 0: as before
