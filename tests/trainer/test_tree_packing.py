"""Packed rows through variable-length attention, and tree packing: a prefix that sequences share
is computed once, and every number equals the unpacked computation (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.trainer.helpers import toy_batch
from trainer.batch import TrainBatch, batch_from_sequences
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine
from trainer.prefix_tree import build_layout, tree_tokens

PROMPT = [5, 6, 7, 8, 9, 10]
# Members of one group that diverge at different depths: right after the prompt, two and three
# tokens into the answer, a duplicate, and one that is a prefix of another.
FORKED = [
    PROMPT + [20, 21, 22, 23],
    PROMPT + [20, 21, 22, 24, 25],
    PROMPT + [20, 21, 30],
    PROMPT + [40, 41],
    PROMPT + [20, 21, 22, 23],
    PROMPT + [20],
]


def _check_layout(seqs, layout):
    for i, s in enumerate(seqs):
        where = layout.token_index[i, : len(s)]
        assert layout.ids[where].tolist() == s  # every sequence reads back whole
        assert layout.positions[where].tolist() == list(range(len(s)))
        assert layout.prev_index[where[1:]].tolist() == where[:-1].tolist()  # its own previous token
        assert bool(layout.first[where[0]]) and not layout.first[where[1:]].any()


def test_a_prefix_tree_stores_each_shared_run_once_and_every_sequence_reads_back_whole():
    other = [[7, 7, 7, 1], [7, 7, 2]]
    seqs = FORKED + other
    layout = build_layout(seqs, width=12)
    _check_layout(seqs, layout)
    # the prompt once, then 20 | 21 | 22 | 23 ; 24 25 ; 30 ; 40 41 — and the other group's 7 7 | 7 1 ; 2
    assert layout.num_tokens == len(PROMPT) + 9 + 5 == tree_tokens(seqs)
    flat = build_layout(seqs, width=12, share=False)
    _check_layout(seqs, flat)
    assert flat.num_tokens == sum(map(len, seqs)) and all(n.parent < 0 for n in flat.nodes)
    assert flat.starts() == {i: (0, int(flat.token_index[i, 0])) for i in range(len(seqs))}


@pytest.mark.parametrize("share", [True, False])
def test_an_empty_sequence_takes_no_place_in_the_row(share):
    seqs = [PROMPT + [20], [], PROMPT + [21]]
    layout = build_layout(seqs, 8, share=share)
    _check_layout([seqs[0], seqs[2]], build_layout([seqs[0], seqs[2]], 8, share=share))
    assert layout.num_tokens == (len(PROMPT) + 2 if share else 2 * len(PROMPT) + 2)
    assert layout.token_index[1].tolist() == [0] * 8 and int(layout.first.sum()) == (1 if share else 2)


def test_tokens_are_shared_only_where_they_were_sampled_at_the_same_temperature():
    seqs = [PROMPT + [20, 21], PROMPT + [20, 22]]
    temps = torch.ones(2, 8)
    temps[1, 6:] = 0.7  # the second answer was sampled cooler: its first token is its own
    layout = build_layout(seqs, 8, temps)
    _check_layout(seqs, layout)
    assert layout.num_tokens == len(PROMPT) + 4
    assert layout.temps[layout.token_index[1, 6:]].tolist() == pytest.approx([0.7, 0.7])


def _forked_batch(second_group: bool = False) -> TrainBatch:
    """FORKED as one group (one member sampled at another temperature); with ``second_group`` a
    second prompt's group beside it."""
    groups = [(len(PROMPT), FORKED)] + ([(3, [[3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 99]])] if second_group else [])
    seqs = [s for _, members in groups for s in members]
    starts = [p for p, members in groups for _ in members]
    width = max(map(len, seqs))
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(len(seqs), width)
    behav = torch.zeros(len(seqs), width)
    for i, (s, p) in enumerate(zip(seqs, starts)):
        mask[i, p : len(s)] = 1
        behav[i, p : len(s)] = -torch.rand(len(s) - p, generator=g) * 3
    rewards = torch.tensor([float(i % 2) for i in range(len(seqs))])
    gids = torch.tensor([gi for gi, (_, members) in enumerate(groups) for _ in members])
    batch = batch_from_sequences(seqs, mask, behav, rewards, gids)
    batch.temperatures = torch.ones(len(seqs), width)
    batch.temperatures[2, len(PROMPT) :] = 0.6
    return batch


LAYOUTS = {
    "unpacked": {"pack_sequences": False},
    "packed": {"pack_sequences": True},
    "tree": {"pack_sequences": True, "tree_packing": True},
}


def _engine(model, layout: str, **kw) -> TrainEngine:
    return TrainEngine(TrainerConfig(model_path=model, lr=1e-3, **LAYOUTS[layout], **kw))


def _logprobs_and_grads(eng: TrainEngine, batch: TrainBatch):
    """Log-probs, entropies, and the gradient of a weighted sum of the log-probs, over micro-batches."""
    width = batch.loss_mask.shape[1]
    weights = torch.linspace(-1, 1, width)[None] * batch.loss_mask
    eng.model.zero_grad()
    lps, ents = torch.zeros(len(batch.sequences), width), torch.zeros(len(batch.sequences), width)
    for rows in eng.micro_batches(batch):
        seqs = [batch.sequences[r] for r in rows]
        lp, ent, _ = eng._forward(eng.model, seqs, width, True, batch.temperatures[rows])
        ((lp * weights[rows]).sum() + (ent * weights[rows]).sum()).backward()
        lps[rows], ents[rows] = lp.detach(), ent.detach()
    grads = {n: p.grad.clone() for n, p in eng.model.named_parameters() if p.grad is not None}
    return lps, ents, grads


@pytest.mark.parametrize("layout", ["packed", "tree"])
@pytest.mark.parametrize("budget", [10_000, 16])  # one micro-batch, or several (flat: a group split up)
def test_packed_and_tree_logprobs_entropies_and_gradients_equal_unpacked(tiny_model, layout, budget):
    batch = _forked_batch(second_group=True)
    plain = _logprobs_and_grads(_engine(tiny_model, "unpacked", micro_batch_tokens=budget), batch)
    eng = _engine(tiny_model, layout, micro_batch_tokens=budget)
    got = _logprobs_and_grads(eng, batch)
    assert (got[0] - plain[0]).abs().max().item() <= 1e-5
    assert (got[1] - plain[1]).abs().max().item() <= 1e-5
    assert got[2].keys() == plain[2].keys()
    for name, g in plain[2].items():
        assert (got[2][name] - g).abs().max().item() <= 1e-5, name
    if layout == "tree":  # a group stays whole in one micro-batch, costing its tree's 15 and 8 tokens
        bins = [sorted(int(batch.group_ids[r]) for r in rows) for rows in eng.micro_batches(batch)]
        assert sorted(bins) == ([[0] * 6 + [1] * 2] if budget > 23 else [[0] * 6, [1] * 2])


def test_a_group_whose_tree_outgrows_the_budget_is_cut_between_neighbours(tiny_model):
    batch = _forked_batch()  # one group: a 15-token tree
    eng = _engine(tiny_model, "tree", micro_batch_tokens=12)
    bins = eng.micro_batches(batch)
    assert len(bins) > 1 and sorted(r for b in bins for r in b) == list(range(len(FORKED)))
    for b in bins:  # each run's tree fits, unless one member alone is longer
        tokens = tree_tokens([batch.sequences[r].tolist() for r in b])
        assert tokens <= 12 or len(b) == 1
    plain = _logprobs_and_grads(_engine(tiny_model, "unpacked"), batch)
    got = _logprobs_and_grads(eng, batch)
    assert (got[0] - plain[0]).abs().max().item() <= 1e-5


def test_the_position_limit_counts_a_rope_scaling_that_extends_it(windowed_model):
    eng = _engine(windowed_model, "packed")
    assert eng._max_positions(eng.model) == 64
    eng.model.config.rope_parameters = eng.model.config.rope_parameters | {"rope_type": "yarn", "factor": 4.0}
    assert eng._max_positions(eng.model) == 256


def test_a_packed_model_refuses_a_forward_of_several_tokens_without_its_plan(tiny_model):
    eng = _engine(tiny_model, "packed")
    with pytest.raises(ValueError, match="needs its packing plan"):
        eng.model(input_ids=torch.tensor([[5, 6, 7]]))
    assert eng.model(input_ids=torch.tensor([[5]])).logits.shape[1] == 1  # one token: no plan needed


def test_a_tree_packed_training_step_equals_an_unpacked_one(tiny_model):
    batch = toy_batch()
    after = []
    for layout in ("unpacked", "tree"):
        eng = _engine(tiny_model, layout, micro_batch_tokens=40, loss={"type": "decoupled_ppo"})
        metrics = eng.train_step(batch)
        after.append((metrics["loss"], {n: p.detach().clone() for n, p in eng.model.named_parameters()}))
    assert after[0][0] == pytest.approx(after[1][0], abs=1e-6)
    for name, w in after[0][1].items():  # a tenth of one Adam step (see test_engine's accumulation test)
        assert (after[1][1][name] - w).abs().max().item() <= 1e-4, name


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory) -> str:
    """A tiny Qwen2 whose upper layers attend within a 4-token sliding window."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("windowed")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("layout", ["packed", "tree"])
def test_sliding_window_layers_keep_their_window_in_packed_rows(windowed_model, layout):
    batch = _forked_batch()
    plain = _logprobs_and_grads(_engine(windowed_model, "unpacked"), batch)
    got = _logprobs_and_grads(_engine(windowed_model, layout), batch)
    assert (got[0] - plain[0]).abs().max().item() <= 1e-5
    for name, g in plain[2].items():
        assert (got[2][name] - g).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("layout", ["unpacked", "tree"])
def test_a_trajectory_longer_than_the_model_allows_is_not_trained_on_and_counted(windowed_model, layout):
    seqs = [[1] * 70, [2] * 10]  # the model has 64 positions
    mask = torch.zeros(2, 70)
    mask[0, 5:], mask[1, 5:10] = 1, 1
    batch = batch_from_sequences(seqs, mask, -mask, torch.tensor([1.0, 0.0]), torch.tensor([0, 1]))
    eng = _engine(windowed_model, layout, loss={"type": "reinforce"})
    lp = eng.logprobs(batch)
    assert torch.isfinite(lp).all() and (lp[0, 64:] == 0).all()  # computed up to the limit only
    metrics = eng.train_step(batch)
    assert metrics["too_long_dropped"] == 1 and metrics["tokens"] == 5  # the short one's 5 answer tokens


def test_tree_packing_is_refused_where_a_sequence_needs_its_own_place(tiny_model, tiny_vl):
    with pytest.raises(ValueError, match="needs pack_sequences"):
        TrainerConfig(model_path=tiny_model, tree_packing=True)
    with pytest.raises(ValueError, match="routing 'replay'"):
        TrainerConfig(model_path=tiny_model, pack_sequences=True, tree_packing=True, moe={"routing": "replay"})
    with pytest.raises(ValueError, match="text policies only"):
        _engine(tiny_vl, "tree")
