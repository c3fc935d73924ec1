"""Delta weight updates (rollout/engines/weight_delta.py): the encoding is exact and picks the
smaller form per tensor, bad deltas are refused naming what is wrong, and the embedded engine
applies one only on the version it was made against, keeping its weights when the result's
checksum is not the trainer's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engines import weight_delta
from rollout.engines.contract import EngineError
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.engines.embedded.weights import weights_checksum
from rollout.sampling import SamplingParams

T = 60
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
BF16 = torch.bfloat16


def _states(seed: int = 0):
    """A base in bfloat16 and the next version: float32 masters moved by 1e-5, cast again."""
    g = torch.Generator().manual_seed(seed)
    master = {"a": torch.randn(64, 32, generator=g) * 0.02, "b": torch.randn(100, generator=g), "c": torch.ones(8)}
    new = {k: v + 1e-5 * torch.randn(v.shape, generator=g) for k, v in master.items()}
    new["b"] = new["b"] + 1.0  # every value of b changes: whole is smaller than indices + values
    return weight_delta.cast(master, BF16), weight_delta.cast(new, BF16)


def test_a_delta_rebuilds_the_new_weights_bit_for_bit_and_picks_the_smaller_form():
    base, new = _states()
    entries, stats = weight_delta.encode(base, new)
    changed_a = int((base["a"] != new["a"]).sum())
    assert 0 < changed_a < base["a"].numel() // 3  # a few values of a cross a bfloat16 boundary
    (tensors,) = weight_delta.buckets(entries, 1 << 20)
    assert set(tensors) == {"a#index", "a#value", "b"}  # c did not change: not sent
    assert tensors["a#index"].dtype == torch.int32 and tensors["a#value"].dtype == BF16
    assert stats.changed == changed_a + 100 and stats.values == 64 * 32 + 100 + 8
    assert stats.tensors_changed == 2 and stats.tensors_whole == 1
    assert stats.bytes == changed_a * 6 + 200 and stats.bytes_full == (64 * 32 + 108) * 2
    assert stats.bytes_changed_tensors == (64 * 32 + 100) * 2 and stats.bytes_sparse == (changed_a + 100) * 6
    params = {k: v.clone() for k, v in base.items()}
    undo = weight_delta.apply(params, weight_delta.split(tensors))
    assert weights_checksum(params) == weights_checksum(new)
    weight_delta.restore(undo)
    assert weights_checksum(params) == weights_checksum(base)


def test_bits_decide_what_changed():
    base = {"x": torch.tensor([0.0, float("nan")] + [1.0] * 6, dtype=BF16)}
    new = {"x": torch.tensor([-0.0, float("nan")] + [1.0] * 6, dtype=BF16)}
    entries, stats = weight_delta.encode(base, new)
    assert stats.changed == 1 and entries["x"][0].tolist() == [0]  # -0.0 is another value; NaN is itself


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({"a#index": torch.tensor([1], dtype=torch.int32)}, "has no 'a#value'"),
        ({"a#value": torch.zeros(1, dtype=BF16)}, "has no 'a#index'"),
        ({"a#index": torch.tensor([0.5]), "a#value": torch.zeros(1, dtype=BF16)}, "int32 or int64"),
        ({"a#index": torch.tensor([1, 2]), "a#value": torch.zeros(1, dtype=BF16)}, "one value per index"),
        ({"a#index": torch.tensor([2048]), "a#value": torch.zeros(1, dtype=BF16)}, r"indices must lie in \[0, 2048\)"),
        ({"a#index": torch.tensor([-1]), "a#value": torch.zeros(1, dtype=BF16)}, "indices must lie"),
        ({"a#index": torch.tensor([1]), "a#value": torch.zeros(1)}, "values are torch.float32"),
        ({"zz": torch.zeros(3, dtype=BF16)}, "unknown tensor name 'zz'"),
        ({"b": torch.zeros(100, dtype=BF16), "b#value": torch.zeros(1, dtype=BF16)}, "has no 'b#index'"),
        (
            {"b": torch.zeros(100, dtype=BF16), "b#index": torch.tensor([1]), "b#value": torch.zeros(1, dtype=BF16)},
            "'b' is sent both whole and as indices",
        ),
        ({"b": torch.zeros(99, dtype=BF16)}, "has shape"),
    ],
)
def test_a_malformed_delta_is_refused_naming_the_entry(tensors, match):
    base, _ = _states()
    with pytest.raises(ValueError, match=match):
        weight_delta.check(base, weight_delta.split(tensors))


def test_a_parameter_held_non_contiguous_is_refused():
    params = {"t": torch.zeros(4, 8, dtype=BF16).t()}  # written through a flat view: it must be contiguous
    with pytest.raises(ValueError, match="non-contiguous"):
        weight_delta.check(params, {"t": (torch.tensor([1]), torch.ones(1, dtype=BF16))})


def test_an_apply_that_fails_midway_puts_back_what_it_wrote():
    params = {"a": torch.zeros(8), "b": torch.zeros(4)}
    entries = {"a": (torch.tensor([1, 3]), torch.ones(2)), "b": torch.ones(5)}  # b unchecked: does not fit
    with pytest.raises(RuntimeError):
        weight_delta.apply(params, entries)
    assert params["a"].tolist() == [0.0] * 8 and params["b"].tolist() == [0.0] * 4


def test_the_base_is_a_copy_even_where_nothing_converts():
    master = {"w": torch.zeros(4)}  # float32 engines of a CPU trainer: the cast converts nothing
    held = weight_delta.cast(master, torch.float32)
    master["w"].add_(1.0)  # the optimizer steps in place
    entries, stats = weight_delta.encode(held, weight_delta.cast(master, torch.float32))
    assert held["w"].tolist() == [0.0] * 4 and stats.changed == 4


def test_encode_refuses_states_that_do_not_correspond():
    base, new = _states()
    with pytest.raises(ValueError, match="name different tensors"):
        weight_delta.encode(base, {k: v for k, v in new.items() if k != "c"})
    with pytest.raises(ValueError, match="c: base is"):
        weight_delta.encode(base, new | {"c": new["c"].float()})


# ---------------------------------------------------------------- the embedded engine


@pytest.fixture
def engine(tiny_model):
    eng = EmbeddedEngine(EngineConfig(model_path=tiny_model, dtype="bfloat16")).start()
    yield eng
    eng.shutdown()


def _next_version(tiny_model):
    """What a trainer would hold after a step: the float32 weights moved a little, and the delta
    from the engine's bfloat16 weights to their cast."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied, as the trainer exports
    g = torch.Generator().manual_seed(1)
    base = weight_delta.cast(state, BF16)
    new = weight_delta.cast({k: v + 1e-5 * torch.randn(v.shape, generator=g) for k, v in state.items()}, BF16)
    entries, stats = weight_delta.encode(base, new)
    return new, entries, stats


def _one_bucket(entries):
    (tensors,) = weight_delta.buckets(entries, 1 << 30)
    return tensors


def test_the_engine_applies_a_delta_to_exactly_the_trainer_weights(engine, tiny_model):
    new, entries, stats = _next_version(tiny_model)
    assert 0 < stats.changed_share < 0.5 and stats.tensors_whole < stats.tensors_changed
    before = engine.submit("a", [1, 5, 9], GREEDY).result(T)
    buckets = list(weight_delta.buckets(entries, stats.bytes // 3))  # an entry's parts travel together
    assert len(buckets) >= 3
    for bucket in buckets:
        engine.stage_delta(bucket, 1, 0)
    res = engine.commit_delta(1, 0, weights_checksum(new)).result(T)
    assert res["weight_version"] == 1 and engine.checksum == weights_checksum(new)
    assert weights_checksum(engine.model.state_dict()) == weights_checksum(new)  # tied lm_head counted once
    after = engine.submit("b", [1, 5, 9], GREEDY).result(T)
    assert set(after.token_versions) == {1} and set(before.token_versions) == {0}


def test_a_delta_against_another_version_is_refused_and_nothing_changes(engine, tiny_model):
    new, entries, _ = _next_version(tiny_model)
    tensors = _one_bucket(entries)
    checksum = engine.checksum
    with pytest.raises(EngineError, match="against version 4; this engine holds 0") as e:
        engine.stage_delta(tensors, 5, 4)
    assert e.value.field == "base_version"
    with pytest.raises(EngineError, match="against version 4"):
        engine.commit_delta(5, 4, weights_checksum(new)).result(T)
    assert engine.weight_version == 0 and engine.checksum == checksum


def test_a_result_with_another_checksum_puts_the_weights_back(engine, tiny_model):
    new, entries, _ = _next_version(tiny_model)
    tensors = _one_bucket(entries)
    held = weights_checksum(engine.model.state_dict())
    engine.stage_delta(tensors, 1, 0)
    with pytest.raises(EngineError, match="version 0 is served unchanged") as e:
        engine.commit_delta(1, 0, "0" * 16).result(T)
    assert e.value.field == "checksum"
    assert engine.weight_version == 0 and weights_checksum(engine.model.state_dict()) == held
    # Buckets lost between staging and commit are caught the same way: nothing staged, another sum.
    with pytest.raises(EngineError, match="served unchanged"):
        engine.commit_delta(1, 0, weights_checksum(new)).result(T)
    assert weights_checksum(engine.model.state_dict()) == held


def test_a_delta_in_another_dtype_is_refused(engine, tiny_model):
    _, entries, _ = _next_version(tiny_model)
    wrong = {k: (v.float() if v.is_floating_point() else v) for k, v in _one_bucket(entries).items()}
    with pytest.raises(EngineError, match="values are torch.float32, the engine holds torch.bfloat16"):
        engine.stage_delta(wrong, 1, 0)
