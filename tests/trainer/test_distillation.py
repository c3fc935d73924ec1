"""On-policy distillation: the advantage and the top-k forward KL against their literal formulas, and
steps that move the student toward the teacher: on the tokens it sampled, and toward the teacher's
top-k distribution at each position, through the padded, packed and tree-packed forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sample_buffer.trajectory import Group, Trajectory
from tests.trainer.helpers import toy_batch
from trainer.batch import batch_from_groups
from trainer.config import TrainerConfig
from trainer.distillation import distillation_sums, distilled_advantages, reverse_kl_advantage, top_k_forward_kl
from trainer.engine import TrainEngine


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(5, 7, generator=g) > 0.3).double()
    adv = torch.randn(5, 7, generator=g, dtype=torch.float64) * mask
    student = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 4
    teacher = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 4
    return adv, student, teacher, mask, torch.tensor([True, False, True, True, False])


@pytest.mark.parametrize("coef, reward_coef", [(1.0, 1.0), (0.5, 0.0), (2.0, 0.3)])
def test_the_advantage_is_the_literal_formula_on_taught_rows_and_the_reward_s_elsewhere(coef, reward_coef):
    adv, student, teacher, mask, taught = _tensors()
    got = distilled_advantages(adv, student, teacher, mask, taught, coef=coef, reward_coef=reward_coef)
    for b in range(5):
        for t in range(7):
            if not mask[b, t]:
                want = float(adv[b, t])  # 0: the estimators' advantages are 0 off the mask
            elif taught[b]:
                want = reward_coef * float(adv[b, t]) - coef * (float(student[b, t]) - float(teacher[b, t]))
            else:
                want = float(adv[b, t])
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)
    assert torch.equal(reverse_kl_advantage(student, teacher, mask, coef), -coef * (student - teacher) * mask)


def test_the_group_baseline_is_the_mean_gap_over_each_groups_taught_tokens():
    adv, student, teacher, mask, taught = _tensors(2)
    groups = torch.tensor([0, 0, 1, 1, 1])
    got = distilled_advantages(adv, student, teacher, mask, taught, coef=0.5, reward_coef=1.0, group_ids=groups)
    for b in range(5):
        mates = [r for r in range(5) if groups[r] == groups[b] and taught[r]]
        gaps = [float(student[r, t] - teacher[r, t]) for r in mates for t in range(7) if mask[r, t]]
        base = sum(gaps) / len(gaps)
        for t in range(7):
            gap = float(student[b, t] - teacher[b, t])
            want = float(adv[b, t]) - 0.5 * (gap - base) if taught[b] and mask[b, t] else float(adv[b, t])
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)
    # Over a group's taught tokens the distillation term sums to zero: it only ranks them.
    term = got - adv
    assert abs(float(term[2:][mask[2:] > 0].sum())) < 1e-9


def test_the_gap_carries_no_gradient_and_its_sums_count_only_taught_tokens():
    adv, student, teacher, mask, taught = _tensors(1)
    student.requires_grad_(True)
    assert not distilled_advantages(adv, student, teacher, mask, taught, coef=1.0, reward_coef=1.0).requires_grad
    kl_sum, n = distillation_sums(student.detach(), teacher, mask, taught)
    rows = [b for b in range(5) if taught[b]]
    s = student.detach()
    want = sum(float(s[b, t] - teacher[b, t]) for b in rows for t in range(7) if mask[b, t])
    assert kl_sum == pytest.approx(want) and n == float(mask[rows].sum())


def test_the_top_k_forward_kl_is_the_literal_sum_zero_only_at_the_teachers_proportions():
    g = torch.Generator().manual_seed(3)
    student = torch.log_softmax(torch.randn(4, 6, 10, generator=g, dtype=torch.float64), -1)
    teacher = -torch.rand(4, 6, 3, generator=g, dtype=torch.float64) * 3
    teacher[0, 0, 2] = float("-inf")  # a row of fewer than k
    ids = torch.randint(0, 10, (4, 6, 3), generator=g)
    got = top_k_forward_kl(student.gather(-1, ids), teacher)
    for b in range(4):
        for t in range(6):
            z = sum(np.exp(float(x)) for x in teacher[b, t])
            want = sum(
                np.exp(float(x)) / z * (float(x) - np.log(z) - float(student[b, t, ids[b, t, k]]))
                for k, x in enumerate(teacher[b, t])
                if x > float("-inf")
            )
            assert got[b, t].item() == pytest.approx(want, abs=1e-9)
    assert (got >= 0).all()
    # A student with all its mass on the teacher's k tokens, in its proportions: 0, whatever their scale.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert top_k_forward_kl(p.log(), (p * 0.1).log()).item() == pytest.approx(0.0, abs=1e-12)
    assert top_k_forward_kl((p * 0.5).log(), p.log()).item() == pytest.approx(np.log(2), abs=1e-12)
    # A candidate the student's grammar refused (its log-prob the dtype's lowest, or -inf) is none: the
    # others renormalised; a position with none left weighs 0, never inf or NaN.
    refused = torch.tensor([np.log(0.5), np.log(0.5), torch.finfo(torch.float64).min], dtype=torch.float64)
    want = 0.625 * np.log(0.625 / 0.5) + 0.375 * np.log(0.375 / 0.5)  # the teacher's 0.5 : 0.3, renormalised
    assert top_k_forward_kl(refused, p.log()).item() == pytest.approx(want, abs=1e-12)
    none = torch.full((3,), float("-inf"), dtype=torch.float64)
    assert top_k_forward_kl(none, p.log()).item() == 0.0


def _groups_from(batch, teacher: torch.Tensor | None, taught_groups: set[int], top=None) -> list[Group]:
    """``batch`` (a toy batch) as the buffer hands it over, ``teacher`` [B, T] on the groups named;
    ``top``: the teacher's top-k ids and log-probs, each [B, T, k] (or a function of the row giving them)."""
    groups: dict[int, list[Trajectory]] = {}
    for i, seq in enumerate(batch.sequences):
        gi, m = int(batch.group_ids[i]), batch.loss_mask[i, : len(seq)].numpy().astype(np.int8)
        gen = m > 0
        groups.setdefault(gi, []).append(
            Trajectory(
                trajectory_id=f"g{gi}/{i}",
                group_id=f"g{gi}",
                prompt_id=f"p{gi}",
                token_ids=seq.numpy(),
                loss_mask=m,
                behavior_logprobs=batch.behavior_logprobs[i, : len(seq)].numpy()[gen],
                token_versions=np.zeros(int(gen.sum())),
                reward=float(batch.rewards[i]),
                start_version=0,
                teacher_logprobs=None if gi not in taught_groups else teacher[i, : len(seq)].numpy()[gen],
                **_top_of_row(top, i, len(seq), gen, gi in taught_groups),
            )
        )
    return [Group(f"g{gi}", f"p{gi}", trajs) for gi, trajs in groups.items()]


def _top_of_row(top, i: int, n: int, gen: np.ndarray, taught: bool) -> dict:
    if top is None or not taught:
        return {}
    ids, lps = top(i) if callable(top) else (top[0][i], top[1][i])
    return {"teacher_top_ids": ids[:n].numpy()[gen], "teacher_top_logprobs": lps[:n].numpy()[gen]}


def test_the_batch_carries_each_taught_rows_teacher_log_probs_at_their_tokens():
    toy = toy_batch(num_groups=3, group_size=2)
    teacher = -torch.rand(toy.loss_mask.shape) * toy.loss_mask
    batch = batch_from_groups(_groups_from(toy, teacher, {0, 2}))
    assert batch.taught.tolist() == [True, True, False, False, True, True]
    want = teacher * batch.taught[:, None]
    assert torch.allclose(batch.teacher_logprobs, want) and batch.select([1, 2]).taught.tolist() == [True, False]
    assert batch_from_groups(_groups_from(toy, None, set())).teacher_logprobs is None


@pytest.mark.parametrize("student", ["behavior", "proximal"])
def test_a_step_of_distillation_alone_moves_the_student_toward_the_teacher(tiny_model, tiny_model_b, student):
    """Rewards all equal (no RL signal), μ the student's own log-probs, the teacher another model: one
    step raises the tokens the teacher likes more than the student does and lowers the others."""
    toy = toy_batch(num_groups=3, group_size=4)
    toy.rewards = torch.ones_like(toy.rewards)
    cfg = {"lr": 1e-3, "distill": {"coef": 1.0, "reward_coef": 0.0, "student": student}}
    eng = TrainEngine(TrainerConfig(model_path=tiny_model, **cfg))
    teacher = TrainEngine(TrainerConfig(model_path=tiny_model_b)).logprobs(toy) * toy.loss_mask
    toy.behavior_logprobs = eng.logprobs(toy).detach() * toy.loss_mask
    batch = batch_from_groups(_groups_from(toy, teacher, {0, 1, 2}))
    before = eng.logprobs(batch).detach()
    metrics = eng.train_step(batch)
    after = eng.logprobs(batch).detach()
    m = batch.loss_mask > 0
    gap = (batch.teacher_logprobs - before)[m]  # > 0: the teacher gives the token more than the student
    moved = (after - before)[m]
    assert moved[gap > 0.5].mean() > 0 > moved[gap < -0.5].mean()
    assert metrics["taught_share"] == 1.0
    assert metrics["teacher_kl"] == pytest.approx(float((before - batch.teacher_logprobs)[m].mean()), abs=1e-4)
    assert torch.nn.functional.mse_loss(after[m], batch.teacher_logprobs[m]) < torch.nn.functional.mse_loss(
        before[m], batch.teacher_logprobs[m]
    )


def test_the_batch_carries_the_teachers_top_k_at_each_generated_position_padded_to_the_largest_k():
    toy = toy_batch(num_groups=3, group_size=2)
    teacher = -torch.rand(toy.loss_mask.shape) * toy.loss_mask
    b, t = toy.loss_mask.shape
    ids, lps = torch.randint(0, 250, (b, t, 3)), -torch.rand(b, t, 3)

    def top(i):  # group 2's teacher sent two a position, the others three
        k = 2 if int(toy.group_ids[i]) == 2 else 3
        return ids[i, :, :k], lps[i, :, :k]

    batch = batch_from_groups(_groups_from(toy, teacher, {0, 2}, top))
    m = batch.loss_mask > 0
    assert batch.topped.tolist() == [True, True, False, False, True, True]
    assert batch.teacher_top_ids.shape == (b, t, 3)
    for i in range(b):
        if not batch.topped[i]:
            assert not batch.teacher_top_ids[i].any() and not batch.teacher_top_logprobs[i].any()
            continue
        k = 2 if int(toy.group_ids[i]) == 2 else 3
        assert torch.equal(batch.teacher_top_ids[i][m[i], :k], ids[i][m[i], :k])
        assert torch.equal(batch.teacher_top_logprobs[i][m[i], :k], lps[i][m[i], :k])
        assert (batch.teacher_top_logprobs[i][m[i], k:] == float("-inf")).all()  # the padding weighs nothing
        assert not batch.teacher_top_logprobs[i][~m[i]].any()
    picked = batch.select([1, 2])
    assert picked.topped.tolist() == [True, False] and picked.teacher_top_ids.shape[0] == 2
    assert batch_from_groups(_groups_from(toy, teacher, {0})).teacher_top_ids is None


def _distributions(model_path: str, batch) -> torch.Tensor:
    """A model's log-probs over the vocabulary at each position of ``batch`` (the token's own position:
    the logits of the one before; 0 at the first and past the end), [B, T, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    width = batch.loss_mask.shape[1]
    with torch.no_grad():
        rows = [torch.log_softmax(model(seq[None]).logits[0, :-1].float(), -1) for seq in batch.sequences]
    return torch.stack([torch.nn.functional.pad(r, (0, 0, 1, width - 1 - len(r))) for r in rows])


@pytest.mark.parametrize("packing", ["padded", "packed", "tree"])
def test_a_step_of_top_k_distillation_moves_the_student_toward_the_teachers_distribution(
    tiny_model, tiny_model_b, packing
):
    """No reward signal and no sampled-token term (coef 0): the loss is the top-k forward KL alone. Its
    metric is the formula at the step's start; a few steps lower it; every forward path agrees."""
    toy = toy_batch(num_groups=2, group_size=3)
    toy.rewards = torch.ones_like(toy.rewards)
    kw = {"padded": {}, "packed": {"pack_sequences": True}, "tree": {"pack_sequences": True, "tree_packing": True}}
    cfg = {"lr": 3e-3, "distill": {"coef": 0.0, "reward_coef": 0.0, "top_k_coef": 1.0}, **kw[packing]}
    eng = TrainEngine(TrainerConfig(model_path=tiny_model, **cfg))
    toy.behavior_logprobs = eng.logprobs(toy).detach() * toy.loss_mask
    best = _distributions(tiny_model_b, toy).topk(4, dim=-1)
    top_ids, top_lps = best.indices, best.values
    teacher = top_lps[..., 0] * toy.loss_mask  # any log-probs: coef 0 leaves them out
    batch = batch_from_groups(_groups_from(toy, teacher, {0, 1}, (top_ids, top_lps)))
    m = batch.loss_mask > 0
    before = top_k_forward_kl(_distributions(tiny_model, batch).gather(-1, top_ids), top_lps)[m]
    first = eng.train_step(batch)
    assert first["teacher_top_kl"] == pytest.approx(float(before.mean()), rel=1e-4)
    for _ in range(4):
        last = eng.train_step(batch)
    assert last["teacher_top_kl"] < 0.8 * first["teacher_top_kl"]
