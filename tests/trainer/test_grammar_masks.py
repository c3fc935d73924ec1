"""On-policy under a grammar: the trainer replays each constrained turn's masks, so its π is the
masked distribution the embedded engine sampled from (μ), not the free one."""

from __future__ import annotations

import json

import pytest
import torch

from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import Group, Trajectory, TrajectoryError
from trainer.batch import batch_from_groups
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine
from trainer.grammar_masks import allowed, mask_logits

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "yy", "zzz"]}}, "required": ["a"]})
REGEX = "(yes|no|maybe) [0-9]{1,3}"


def test_the_unpacked_bitmask_is_xgrammars():
    """``allowed`` reads xgrammar's packed bitmask as xgrammar's own kernel applies it."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    vocab = 100
    bits = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bits)
    assert torch.equal(allowed(bits, vocab), theirs > float("-inf"))
    ours = mask_logits(logits, torch.tensor([0, 1, 2]), bits)
    assert torch.equal(ours.softmax(-1), theirs.softmax(-1))  # a refused token has probability 0 either way
    assert torch.isfinite(ours).all()  # the lowest float, not -inf: an entropy stays a number


@pytest.fixture(scope="module")
def constrained_group(tiny_model) -> Group:
    """Two-turn trajectories the embedded engine sampled at 0.8: a JSON schema then a regex, a free
    turn then a regex, and a free one, all of one prompt (so tree packing finds prefixes to share)."""
    gen = EmbeddedEngine(EngineConfig(model_path=tiny_model, max_running_requests=4)).start()
    turns = [
        [("json_schema", SCHEMA), ("regex", REGEX)],
        [None, ("regex", REGEX)],
        [None, None],
        [("regex", REGEX), ("regex", REGEX)],
    ]
    trajs = []
    try:
        for i, grammars in enumerate(turns):
            ids, mask, mu, starts = [1, 20, 21, 22], [0, 0, 0, 0], [], []
            for k, grammar in enumerate(grammars):
                extra = {} if grammar is None else {grammar[0]: grammar[1]}
                params = SamplingParams(max_new_tokens=24, temperature=0.8, sampling_seed=i + 10 * k, **extra)
                out = gen.submit(f"t{i}-{k}", ids, params).result(60)
                starts.append(len(ids))
                ids, mask, mu = ids + out.output_ids, mask + [1] * len(out.output_ids), mu + out.behavior_logprobs
                ids, mask = ids + [5, 6], mask + [0, 0]  # the environment's answer between the turns
            meta = {
                "turn_starts": starts,
                "turn_temperatures": [0.8, 0.8],
                "turn_grammars": [None if g is None else list(g) for g in grammars],
            }
            trajs.append(Trajectory(f"g/{i}", "g", "p", ids, mask, mu, [0] * len(mu), float(i % 2), 0, metadata=meta))
    finally:
        gen.shutdown()
    return Group("g", "p", trajs)


@pytest.mark.parametrize("layout", ["padded", "packed", "tree"])
def test_the_trainers_log_probs_under_a_grammar_equal_the_engines(tiny_model, constrained_group, layout):
    """π of every generated token equals μ within the usual tolerance, on padded rows, packed rows
    and a prefix tree; computed without the masks (what the trainer did before) they do not."""
    kw = {"padded": {}, "packed": {"pack_sequences": True}, "tree": {"pack_sequences": True, "tree_packing": True}}
    eng = TrainEngine(TrainerConfig(model_path=tiny_model, **kw[layout]))
    batch = batch_from_groups([constrained_group])
    m = batch.loss_mask.bool()
    constrained = m & (batch.grammar_tags > 0)
    assert int(constrained.sum()) > 20 and int((m & ~constrained).sum()) > 10  # both kinds in the batch
    gap = (eng.logprobs(batch) - batch.behavior_logprobs)[m].abs()
    assert gap.max() < 1e-4, gap.max()
    free = batch_from_groups([constrained_group])
    free.grammar_spans = free.grammar_tags = None  # the trainer before: π unmasked
    unmasked = (eng.logprobs(free) - free.behavior_logprobs).abs()
    assert unmasked[constrained].mean() > 0.05  # every constrained token's ratio was off
    assert unmasked[m & ~constrained].max() < 1e-4  # and nothing else changed


def test_a_training_step_counts_the_replayed_tokens_and_leaves_out_what_cannot_be_replayed(
    tiny_model, constrained_group
):
    """A turn whose recorded tokens its grammar refuses (another tokenizer's, say) cannot be masked:
    its tokens are left out of the loss and counted, and the step trains on the rest."""
    bad = constrained_group.trajectories[3]
    meta = dict(bad.metadata, turn_grammars=[["regex", "q+"], ["regex", "q+"]])
    parts = (bad.token_ids, bad.loss_mask, bad.behavior_logprobs, bad.token_versions)
    broken = Trajectory("g/bad", "g", "p", *parts, 0.0, 0, metadata=meta)
    group = Group("g", "p", [*constrained_group.trajectories, broken])
    batch = batch_from_groups([group])
    before = batch.loss_mask.sum()
    out = TrainEngine(TrainerConfig(model_path=tiny_model, lr=1e-3)).train_step(batch)
    expected = int((batch_from_groups([constrained_group]).grammar_tags > 0).sum())
    assert out["grammar_tokens"] == expected
    assert out["grammar_tokens_excluded"] == int(broken.loss_mask.sum())
    assert batch.loss_mask.sum() == before - out["grammar_tokens_excluded"]
    assert out["grammar_replay_s"] > 0 and torch.isfinite(torch.tensor(out["loss"]))


def test_a_trajectorys_grammars_are_checked_where_it_is_made():
    tokens = ([1, 2, 3, 4], [0, 0, 1, 1], [-1.0, -1.0], [0, 0])
    meta = {"turn_starts": [2], "turn_temperatures": [1.0]}
    for grammars in ([["lark", "x"]], [["regex", 3]], [None, None], "regex", [["regex", "a" * 70_000]]):
        with pytest.raises(TrajectoryError, match="turn_grammars"):
            Trajectory("t", "g", "p", *tokens, 0.0, 0, metadata=meta | {"turn_grammars": grammars})
    Trajectory("t", "g", "p", *tokens, 0.0, 0, metadata=meta | {"turn_grammars": [None]})
