"""The training engine on the tiny model, single process on CPU."""

from __future__ import annotations

import pathlib
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.helpers import toy_batch
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainerConfig
from trainer.durable import MARKER, latest_checkpoint
from trainer.engine import TrainEngine
from trainer.export import export_hf, full_state_dict, weight_buckets


def engine(model, total_steps=None, **kw) -> TrainEngine:
    return TrainEngine(TrainerConfig(model_path=model, **({"lr": 1e-3} | kw)), total_steps=total_steps)


@pytest.mark.parametrize("tree", [False, True])  # each sequence whole, or a group's prompt once
def test_packed_logprobs_equal_unpacked(tiny_model, tree):
    batch = toy_batch()
    packer = engine(tiny_model, pack_sequences=True, micro_batch_tokens=64, tree_packing=tree)
    packed = packer.logprobs(batch, entropy=True)
    plain = engine(tiny_model, pack_sequences=False, micro_batch_tokens=64).logprobs(batch, entropy=True)
    width = batch.loss_mask.shape[1]
    for i, s in enumerate(batch.sequences):  # beyond each sequence both are 0
        assert packed[0][i, len(s) :].abs().max() == 0 if len(s) < width else True
    assert (packed[0] - plain[0]).abs().max().item() <= 1e-5
    assert (packed[1] - plain[1]).abs().max().item() <= 1e-5
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    s = batch.sequences[3].tolist()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([s])).logits[0, :-1], -1).gather(-1, torch.tensor(s[1:])[:, None])
    assert (packed[0][3, 1 : len(s)] - ref[:, 0]).abs().max().item() <= 1e-5


def test_a_step_moves_probability_towards_rewarded_samples(tiny_model):
    eng = engine(tiny_model, loss={"type": "reinforce"}, grad_clip=None)
    batch = toy_batch()
    before = eng.logprobs(batch)
    metrics = eng.train_step(batch)
    after = eng.logprobs(batch)
    gain = ((after - before) * batch.loss_mask).sum(-1)
    assert gain[batch.rewards > 0].min() > 0 and gain[batch.rewards == 0].max() < 0
    assert eng.step == 1 and eng.version == 1 and metrics["tokens"] == batch.loss_mask.sum()
    for key in ("loss", "pg_loss", "clip_frac", "ratio_mean", "approx_kl", "grad_norm", "lr", "reward_mean"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key


@pytest.mark.parametrize(
    "agg, pack", [("token-mean", True), ("seq-mean-token-mean", False), ("seq-mean-token-sum-norm", True)]
)
def test_gradient_accumulation_equals_one_big_batch(tiny_model, agg, pack):
    batch = toy_batch()
    results = []
    for budget in (10_000, 40):
        loss = {"type": "decoupled_ppo", "agg_mode": agg}
        eng = engine(tiny_model, micro_batch_tokens=budget, pack_sequences=pack, loss=loss)
        assert (len(eng.micro_batches(batch)) > 1) == (budget == 40)
        m = eng.train_step(batch)
        results.append((m["loss"], full_state_dict(eng.model)))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    # One Adam step moves weights by up to lr = 1e-3; Adam's normalisation amplifies float noise
    # in near-zero gradients, so the bound is a tenth of a step rather than float epsilon.
    for k, v in results[0][1].items():
        assert (v - results[1][1][k]).abs().max().item() <= 1e-4, k


def test_checkpoint_resume_is_bit_for_bit(tiny_model, tmp_path):
    batches = [toy_batch(seed=s) for s in range(3)]
    cfg = dict(warmup_steps=2, lr_schedule="cosine", total_steps=10)
    straight = engine(tiny_model, **cfg)
    losses = [straight.train_step(b)["loss"] for b in batches]

    first = engine(tiny_model, **cfg)
    for b in batches[:2]:
        first.train_step(b)
    path = save_checkpoint(first, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "step_9.partial").mkdir()  # a crash while writing step 9
    (tmp_path / "ckpt" / "step_8").mkdir()  # a directory without the marker
    assert latest_checkpoint(tmp_path / "ckpt") == path and (path / MARKER).exists()

    resumed = engine(tiny_model, **cfg)
    load_checkpoint(resumed, latest_checkpoint(tmp_path / "ckpt"))
    assert (resumed.step, resumed.version) == (2, 2)
    assert resumed.train_step(batches[2])["loss"] == losses[2]  # exactly, not approximately
    with pytest.raises(FileNotFoundError, match=MARKER):
        load_checkpoint(resumed, tmp_path / "ckpt" / "step_8")
    # A checkpoint's extras rewritten by someone else with a pickled object: refused, never run.
    planted = tmp_path / "ran"
    torch.save({"step": 2, "version": 2, "x": _Planted(str(planted))}, path / "extra_rank0.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(engine(tiny_model, **cfg), path)
    assert not planted.exists()


def test_a_checkpoint_s_metadata_and_values_run_no_code_at_resume(tiny_model, tmp_path):
    """torch's DCP reader unpickles ``.metadata`` and reads non-tensor values with
    ``weights_only=False``; rollmesh's (trainer/checkpoint_reader.py) takes DCP's own classes only."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from trainer.checkpoint_reader import SafePlanner, SafeReader

    first = engine(tiny_model)
    first.train_step(toy_batch(seed=0))
    path = save_checkpoint(first, tmp_path / "ckpt")
    meta_file = path / "state" / ".metadata"
    meta = SafeReader(path / "state").read_metadata()  # what DCP wrote reads back
    assert meta.state_dict_metadata and all(i.relative_path.endswith(".distcp") for i in meta.storage_data.values())
    original = meta_file.read_bytes()
    planted = tmp_path / "ran"
    for hostile, message in (
        ({"x": _Planted(str(planted))}, "may not name pathlib.Path.touch|may not name"),
        (["not metadata"], "not a checkpoint's metadata"),
    ):
        meta_file.write_bytes(pickle.dumps(hostile))
        with pytest.raises(pickle.UnpicklingError, match=message):
            load_checkpoint(engine(tiny_model), path)
    assert not planted.exists()
    key = next(iter(meta.storage_data))
    meta.storage_data[key].relative_path = "../../elsewhere.distcp"  # a data file outside the checkpoint
    meta_file.write_bytes(pickle.dumps(meta))
    with pytest.raises(pickle.UnpicklingError, match="outside the checkpoint"):
        load_checkpoint(engine(tiny_model), path)
    meta_file.write_bytes(original)
    resumed = engine(tiny_model)
    load_checkpoint(resumed, path)  # the genuine one still resumes
    assert resumed.step == 1
    # a value that is not a tensor (an optimizer's lr) is read with weights_only: an object is refused
    planner, raw = SafePlanner(), io.BytesIO()
    torch.save(_Planted(str(planted)), raw)
    raw.seek(0)
    item = type("Item", (), {"dest_index": MetadataIndex("optim.param_groups.0.lr")})()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        planner.load_bytes(item, raw)
    assert not planted.exists()


class _Planted:
    """Unpickling this writes a file: what a hostile checkpoint would do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_exported_weights_serve_identically(tiny_model, tmp_path):
    from rollout.engines.embedded.config import EngineConfig
    from rollout.engines.embedded.engine import EmbeddedEngine
    from rollout.sampling import SamplingParams

    eng = engine(tiny_model)
    eng.train_step(toy_batch())
    state = full_state_dict(eng.model)
    buckets = list(weight_buckets(state, max_bytes=200_000))
    assert len(buckets) > 1 and all(
        sum(t.numel() * t.element_size() for t in b.values()) <= 200_000 or len(b) == 1 for b in buckets
    )
    out = export_hf(eng.model, tiny_model, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    for k, v in state.items():
        assert torch.equal(reloaded.state_dict()[k], v), k

    prompt, greedy = [1, 40, 41, 42], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    outputs = []
    for how in ("disk", "buckets"):
        srv = EmbeddedEngine(EngineConfig(model_path=tiny_model)).start()
        try:
            if how == "disk":
                srv.load_weights_from_disk(str(out), 1).result(60)
            else:
                for b in buckets:
                    srv.stage_tensors(b, 1)
                srv.commit_staged(1).result(60)
            outputs.append(srv.submit("x", prompt, greedy).result(60))
        finally:
            srv.shutdown()
    direct = eng.model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + outputs[0].output_ids])
        lp = torch.log_softmax(direct(ids).logits[0, len(prompt) - 1 : -1], -1)
    ref = lp.gather(-1, torch.tensor(outputs[0].output_ids)[:, None])[:, 0]
    assert outputs[0].output_ids == outputs[1].output_ids
    assert outputs[0].behavior_logprobs == outputs[1].behavior_logprobs
    assert (ref - torch.tensor(outputs[0].behavior_logprobs)).abs().max() <= 1e-5


def test_reference_kl_and_critic_with_gae(tiny_model):
    batch = toy_batch()
    eng = engine(
        tiny_model,
        ref_model_path=tiny_model,
        kl_coef=0.1,
        entropy_coef=0.01,
        critic=True,
        critic_lr=1e-3,
        advantages={"type": "gae", "gamma": 1.0, "lam": 1.0},
    )
    first = eng.train_step(batch)
    assert abs(first["kl"]) < 1e-6  # the policy starts as the reference
    # With gamma = lam = 1 the critic's targets are the rewards themselves: a fixed regression.
    later = [eng.train_step(batch) for _ in range(6)]
    assert later[-1]["kl"] > 0
    assert later[-1]["value_loss"] < 0.75 * first["value_loss"]


def test_mini_batches_and_epochs_move_the_ratio_inside_a_step_so_the_clip_binds(tiny_model):
    """One update per step takes the ratio against π_prox at exactly 1: PPO's clip never binds.
    With mini-batches and epochs the later updates see a policy that has moved."""
    batch = toy_batch()
    loss = {"type": "ppo", "old_policy": "proximal"}
    single = engine(tiny_model, loss=loss, lr=1e-2).train_step(batch)
    assert single["updates"] == 1 and single["clip_frac"] == 0
    assert single["ratio_proximal_mean"] == pytest.approx(1.0, abs=1e-5)
    eng = engine(tiny_model, loss=loss, lr=1e-2, mini_batches=2, ppo_epochs=3)
    many = eng.train_step(batch)
    assert many["updates"] == 6 and eng.step == 1 and eng.version == 1  # still one version per step
    assert many["clip_frac"] > 0 and abs(many["ratio_proximal_mean"] - 1) > 1e-3


def test_mini_batches_are_whole_groups_and_cover_the_batch_every_epoch(tiny_model):
    batch = toy_batch(num_groups=5)
    eng = engine(tiny_model, mini_batches=2, ppo_epochs=2)
    gids = batch.group_ids.tolist()
    for epoch in (0, 1):
        slices = eng._mini_batches(batch, epoch)
        assert len(slices) == 2 and sorted(r for s in slices for r in s) == list(range(len(gids)))
        assert not {gids[r] for r in slices[0]} & {gids[r] for r in slices[1]}  # no group split
    assert eng._mini_batches(batch, 1) == eng._mini_batches(batch, 1)  # seeded: the same run twice


def test_stale_tokens_are_told_apart_by_version_and_measured(tiny_model):
    """Tokens sampled at an older version than the trainer's weights are stale: their ratio and the
    log-prob gap |log μ − log π_prox| are reported apart from the fresh ones'."""
    batch = toy_batch()
    eng = engine(tiny_model, loss={"type": "cispo"})
    eng.version = 2
    stale_rows = batch.group_ids >= 2
    versions = torch.where(stale_rows[:, None], 0, 2)
    batch.token_versions = torch.where(batch.loss_mask > 0, versions, -1)
    fresh_tokens, stale_tokens = float(batch.loss_mask[~stale_rows].sum()), float(batch.loss_mask[stale_rows].sum())
    m = eng.train_step(batch)
    assert (m["mismatch_fresh_tokens"], m["mismatch_stale_tokens"]) == (fresh_tokens, stale_tokens)
    assert m["mismatch_stale_mean"] > 0 and m["mismatch_stale_max"] >= m["mismatch_stale_mean"]
    assert "ratio_mean_stale" in m and "clip_frac_stale" in m and m["ratio_behavior_mean_stale"] > 0


def test_the_audit_measures_policy_movement_and_checks_mu_against_each_tokens_version(tiny_model):
    """μ set to the teacher-forced log-probs of the weights each token is tagged with passes the
    audit (error ~ float noise); a token tagged with the wrong version shows up as an error the
    size of the policy's movement. policy_kl_k grows with k as the policy keeps moving."""
    eng = engine(tiny_model, loss={"type": "reinforce"}, audit_versions=2, grad_clip=None, lr=1e-2)
    batches = [toy_batch(seed=s) for s in range(4)]
    logprobs = []  # per version: each batch's log-probs under that version's weights
    metrics = []
    for step, batch in enumerate(batches):
        logprobs.append([eng.logprobs(b) for b in batches])
        # Rows of group 0 come from two versions ago (where there is one), the others are fresh.
        age = torch.where(batch.group_ids == 0, min(step, 2), 0)
        tag = (step - age)[:, None].expand_as(batch.loss_mask)
        batch.token_versions = torch.where(batch.loss_mask > 0, tag, -1)
        batch.behavior_logprobs = (
            torch.stack([logprobs[v][step][i] for i, v in enumerate(step - age)]) * batch.loss_mask
        )
        metrics.append(eng.train_step(batch))
    assert "policy_kl_1" not in metrics[0] and metrics[0]["audit_mu_err_max"] < 1e-4
    assert "policy_kl_2" not in metrics[1] and metrics[1]["policy_kl_1"] > 0
    last = metrics[-1]
    assert last["policy_kl_2"] > last["policy_kl_1"] > 0
    assert last["audit_stale_tokens"] == batches[-1].loss_mask[batches[-1].group_ids == 0].sum()
    assert last["audit_mu_err_stale_max"] < 1e-4 and last["audit_missing_tokens"] == 0
    # The same batch told it was sampled by the current weights: the audit sees the gap.
    wrong = toy_batch(seed=3)
    wrong.behavior_logprobs = logprobs[1][3] * wrong.loss_mask
    wrong.token_versions = torch.where(wrong.loss_mask > 0, eng.version, -1)
    assert eng.train_step(wrong)["audit_mu_err_mean"] > 1e-3


@pytest.mark.parametrize("pack", [False, True])
def test_the_trainers_log_probs_are_at_each_turns_sampling_temperature(tiny_model, pack):
    """Two-turn trajectories sampled by the embedded engine at 0.7 then 1.3 (and greedy): the
    trainer's log-probs of the generated tokens equal the engine's μ. Taken at temperature 1,
    as before the turns carried their temperature, they do not: every ratio π/μ was off."""
    from rollout.engines.embedded.config import EngineConfig
    from rollout.engines.embedded.engine import EmbeddedEngine
    from rollout.sampling import SamplingParams
    from sample_buffer.trajectory import Group, Trajectory
    from trainer.batch import batch_from_groups

    gen = EmbeddedEngine(EngineConfig(model_path=tiny_model, max_running_requests=4)).start()
    trajs = []
    try:
        for i, temps in enumerate([(0.7, 1.3), (0.0, 0.7), (1.0, 1.0)]):
            ids, mask, mu, starts = [1, 20 + i, 21, 22], [0, 0, 0, 0], [], []
            for k, temp in enumerate(temps):
                params = SamplingParams(max_new_tokens=12, temperature=temp, ignore_eos=True, sampling_seed=i)
                out = gen.submit(f"t{i}-{k}", ids, params).result(60)
                starts.append(len(ids))
                ids, mask, mu = ids + out.output_ids, mask + [1] * len(out.output_ids), mu + out.behavior_logprobs
                ids, mask = ids + [5, 6], mask + [0, 0]  # the environment's answer between the turns
            meta = {"turn_starts": starts, "turn_temperatures": list(temps)}
            trajs.append(Trajectory(f"g/{i}", "g", "p", ids, mask, mu, [0] * len(mu), 1.0, 0, metadata=meta))
    finally:
        gen.shutdown()
    batch = batch_from_groups([Group("g", "p", trajs)])
    eng = engine(tiny_model, pack_sequences=pack)
    m = batch.loss_mask.bool()
    gap = (eng.logprobs(batch) - batch.behavior_logprobs)[m].abs()
    assert gap.max() < 1e-4, gap.max()
    tempered = m & (batch.temperatures != 1)
    batch.temperatures = None  # what the trainer computed before
    assert (eng.logprobs(batch) - batch.behavior_logprobs)[tempered].abs().mean() > 0.05


def test_decoupled_ppo_reports_how_often_its_behaviour_weight_is_capped(tiny_model):
    batch = toy_batch()
    low = batch.loss_mask.bool() & (batch.group_ids[:, None] == 0)  # μ far below π_prox: π_prox/μ over the cap
    batch.behavior_logprobs = torch.where(low, torch.tensor(-30.0), batch.behavior_logprobs)
    m = engine(tiny_model, loss={"type": "decoupled_ppo", "behavior_weight_cap": 5.0}).train_step(batch)
    assert m["behavior_weight_capped_frac"] == pytest.approx(float(low.sum() / batch.loss_mask.sum()))


def test_the_trust_region_pulls_a_step_back_under_its_kl_bound(tiny_model):
    """A large step (lr 0.05) moves the policy far; with max_step_kl it is halved back towards
    π_prox until KL(π_prox ‖ π_new) is under the bound: the weights end at 1/2^k of the free step.
    (The random tiny model is far from smooth: KL does not shrink with the square of the step.)"""
    batch = toy_batch()
    free = engine(tiny_model, lr=0.05, loss={"type": "reinforce"}, max_step_kl=1e9)
    m_free = free.train_step(batch)
    bounded = engine(tiny_model, lr=0.05, loss={"type": "reinforce"}, max_step_kl=0.3)
    m = bounded.train_step(batch)
    assert m_free["step_halvings"] == 0 and m_free["step_kl"] > 0.3
    assert m["step_kl_unbounded"] == pytest.approx(m_free["step_kl"], rel=1e-4)
    assert m["step_halvings"] >= 1 and m["step_kl"] <= 0.3
    w0 = engine(tiny_model).model.get_output_embeddings().weight
    move = lambda e: (e.model.get_output_embeddings().weight - w0).abs().max().item()  # noqa: E731
    assert move(bounded) == pytest.approx(move(free) / 2 ** m["step_halvings"], rel=1e-3)


def _grads_and_metrics(eng: TrainEngine, batch) -> tuple[dict, list[torch.Tensor]]:
    """One train_step's metrics and the gradients its optimizer stepped with."""
    grads: list[torch.Tensor] = []
    step = eng.optimizer.step

    def record(*a, **kw):
        grads.extend(p.grad.detach().clone() for p in eng.model.parameters() if p.grad is not None)
        return step(*a, **kw)

    eng.optimizer.step = record
    return eng.train_step(batch), grads


@pytest.mark.parametrize(
    "kw",
    [
        {"loss": {"type": "decoupled_ppo"}},
        {"loss": {"type": "ppo", "old_policy": "proximal"}, "mismatch": {"type": "truncate", "cap": 2.0}},
        {"loss": {"type": "tis"}, "pack_sequences": True, "tree_packing": True, "micro_batch_tokens": 40},
    ],
)
def test_one_update_a_batch_takes_the_proximal_log_probs_from_its_own_forward(tiny_model, kw, monkeypatch):
    """With one optimizer step a batch, π_prox is the update's own forward (detached): no separate
    forward runs, and the loss, every metric and the gradients equal the separate forward's to 1e-6."""
    batch = toy_batch()
    batch.token_versions = torch.where(batch.loss_mask.bool() & (batch.group_ids[:, None] == 1), -1, 0)
    separate = engine(tiny_model, **kw)
    monkeypatch.setattr(separate, "_prox_from_update", lambda ref: False)
    want, want_grads = _grads_and_metrics(separate, batch)
    fused = engine(tiny_model, **kw)
    calls = []
    monkeypatch.setattr(fused, "logprobs", lambda *a, **k: calls.append(a) or TrainEngine.logprobs(fused, *a, **k))
    got, got_grads = _grads_and_metrics(fused, batch)
    assert calls == [], "a separate proximal forward ran"
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-6), k
    assert len(got_grads) == len(want_grads) > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "kw",
    [{"ppo_epochs": 2}, {"mini_batches": 2}, {"max_step_kl": 1e9}, {"ref_model_path": "SELF", "kl_in_reward": True}],
)
def test_the_proximal_forward_still_runs_where_an_update_needs_it_first(tiny_model, kw, monkeypatch):
    """Several updates a batch (epochs, mini-batches), a trust region or a KL in the reward need π_prox
    at the step's starting weights before (or after) the first update moves them: computed apart."""
    kw = {k: tiny_model if v == "SELF" else v for k, v in kw.items()}
    kw |= {"kl_coef": 0.1} if "kl_in_reward" in kw else {}
    eng = engine(tiny_model, **kw)
    assert eng._prox_from_update(eng._reference_logprobs(toy_batch())) is False
    calls = []
    monkeypatch.setattr(eng, "logprobs", lambda *a, **k: calls.append(a) or TrainEngine.logprobs(eng, *a, **k))
    eng.train_step(toy_batch())
    assert len(calls) >= 1
