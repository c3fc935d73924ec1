import torch

from rollout.engines.embedded.sampling import SamplingParams, sample_next_tokens, token_logprobs, truncate_top_k_top_p


def _literal_keep(probs: list[float], k: int, p: float) -> set[int]:
    """Tokens a textbook top-k then top-p filter keeps."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if k > 0:
        order = order[:k]
    kept, mass = [], 0.0
    for i in order:
        if mass >= p and kept:
            break
        kept.append(i)
        mass += probs[i]
    return set(kept)


def test_truncation_matches_literal_filter():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    ks = torch.tensor([-1, 1, 5, 0, 10, 50])
    ps = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 0.05])
    lp = torch.log_softmax(logits, -1)
    out = truncate_top_k_top_p(lp, ks, ps)
    for row in range(6):
        kept = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert kept == _literal_keep(lp[row].exp().tolist(), int(ks[row]), float(ps[row]))
        assert torch.equal(out[row][list(kept)], lp[row][list(kept)])  # survivors keep their values


def test_logprobs_use_temperature_and_greedy_uses_one():
    logits = torch.randn(3, 20)
    lp = token_logprobs(logits, torch.tensor([0.5, 0.0, 2.0]))
    torch.testing.assert_close(lp[0], torch.log_softmax(logits[0] / 0.5, -1))
    torch.testing.assert_close(lp[1], torch.log_softmax(logits[1], -1))
    torch.testing.assert_close(lp[2], torch.log_softmax(logits[2] / 2.0, -1))


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """logits / 1e-45 overflows float32: NaN probabilities failed the whole batch. SGLang: greedy below 1e-6."""
    logits = torch.randn(2, 30) * 5
    params = [SamplingParams(temperature=1e-45), SamplingParams(temperature=1e-7)]
    tokens, lps = sample_next_tokens(logits, params, [None] * 2, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


def test_logprob_reported_before_truncation_and_top_k_one_is_argmax():
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.7, top_k=1)] * 4
    tokens, lps = sample_next_tokens(logits, params, [None] * 4, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))
    full = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(lps, full.gather(-1, tokens[:, None]).squeeze(-1))
    assert (lps < 0).all()  # not renormalised over the single surviving token


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    logits = torch.randn(3, 40)
    p = SamplingParams(temperature=1.0)
    draws = []
    for neighbours in (1, 2):
        gens = [torch.Generator().manual_seed(7)] + [None] * neighbours
        rows = torch.cat([logits[:1], logits[1 : 1 + neighbours]])
        t, _ = sample_next_tokens(rows, [p] * (1 + neighbours), gens, torch.Generator().manual_seed(neighbours))
        draws.append(int(t[0]))
    assert draws[0] == draws[1]


def test_top_logprobs_are_each_rows_most_likely_tokens_at_its_temperature():
    from rollout.engines.embedded.sampling import top_logprobs

    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    tops = top_logprobs(logits, params, [4, 2, 0])
    assert tops[2] == []  # a row that does not ask gets nothing
    for row, t, k in ((0, 0.5, 4), (1, 1.0, 2)):  # greedy reports as if at temperature 1, as for the sampled token
        full = torch.log_softmax(logits[row] / t, -1)
        want = full.topk(k)
        assert [i for i, _ in tops[row]] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in tops[row]]), want.values)
