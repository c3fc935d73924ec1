"""Attention over a packed row without a dense [T, T] mask.

A packed row (``trainer/prefix_tree.py``) holds nodes: whole sequences, or with tree packing runs
of tokens that several sequences share. Each node's queries attend causally to its own keys and
to every key of its ancestors. Nodes of similar shape are gathered into a padded batch, one
``scaled_dot_product_attention`` per batch and layer: a root node needs no mask (keys are its own
queries, right-padded, so ``is_causal`` is exact for every real query); a node with ancestors gets
a small [Lq, Lk] mask built from positions (a key is visible when its position is not after the
query's: along one root-to-node path positions only grow). Attention then costs what each
sequence costs alone, not the row's length squared, and a shared prefix is attended once.

Registered with transformers as the attention implementation ``rollmesh_varlen``; a forward
passes its plan as the ``rollmesh_pack`` keyword, which the models hand down to every attention
call (and which activation checkpointing's recompute keeps). A forward without one (the empty
micro-batch a rank runs under FSDP2, a vision tower) takes transformers' sdpa path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from trainer.prefix_tree import PackLayout

NAME = "rollmesh_varlen"
KWARG = "rollmesh_pack"
# A batch of nodes may spend this much more on padding than its nodes' own attention costs, plus
# a little; fewer, larger batches mean fewer kernel calls per layer.
PAD_FACTOR = 1.3
PAD_SLACK = 4096


@dataclass
class NodeBatch:
    """Nodes attended in one call: ``q`` [N, Lq] the packed positions of each node's queries,
    ``k`` [N, Lk] of its keys (ancestors' then its own; None: its queries, causal)."""

    q: torch.Tensor
    k: torch.Tensor | None
    q_pos: torch.Tensor  # [N, Lq] positions (padding: a large number)
    k_pos: torch.Tensor  # [N, Lk] positions (padding: -1)
    real: torch.Tensor  # indices into the flattened [N * Lq] outputs of the real queries
    # (first, N, Lq): the queries are the row's tokens first .. first + N * Lq, N nodes of one length
    span: tuple[int, int, int] | None = None
    masks: dict = field(default_factory=dict)  # by sliding window

    def mask(self, window: int | None, dtype) -> torch.Tensor | None:
        """[N, 1, Lq, Lk] additive (0 or -inf, in ``dtype``: sdpa would convert a bool one at every
        call), or None where ``is_causal`` says it all. Made once per forward, shared by the layers."""
        if self.k is None and window is None:
            return None
        if (window, dtype) not in self.masks:
            k_pos = self.q_pos.masked_fill(self.q_pos >= _PAD_POS, -1) if self.k is None else self.k_pos
            real_key = k_pos[:, None, :] >= 0
            seen = (k_pos[:, None, :] <= self.q_pos[:, :, None]) & real_key
            if window is not None:
                seen &= (self.q_pos[:, :, None] - k_pos[:, None, :]) < window
            # a padding query sees every real key: a row with no key at all gives NaN gradients in
            # some CUDA kernels, which index_select's backward would carry into real tokens
            seen |= (self.q_pos >= _PAD_POS)[:, :, None] & real_key
            hidden = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, float("-inf"))
            self.masks[window, dtype] = hidden[:, None]
        return self.masks[window, dtype]


_PAD_POS = 1 << 40


@dataclass
class AttentionPlan:
    batches: list[NodeBatch]
    inverse: torch.Tensor | None  # [T] where each token's output sits in the batches' outputs (None: in order)


def _group(costs: list[tuple[int, int, int]]) -> list[list[int]]:
    """Nodes (index, Lq, Lk), sorted by Lk then Lq descending, cut into batches whose padded cost
    stays within PAD_FACTOR of their real cost."""
    groups: list[list[int]] = []
    cur: list[int] = []
    real = 0
    lq = lk = 0
    for n, q, k in sorted(costs, key=lambda c: (-c[2], -c[1])):
        if cur and (len(cur) + 1) * max(lq, q) * lk > PAD_FACTOR * (real + q * k) + PAD_SLACK:
            groups.append(cur)
            cur, real, lq = [], 0, 0
        if not cur:
            lk = k
        cur.append(n)
        real += q * k
        lq = max(lq, q)
    return groups + ([cur] if cur else [])


def plan_attention(layout: PackLayout, device) -> AttentionPlan:
    nodes = layout.nodes
    positions = layout.positions.tolist()
    keys_of: list[list[int]] = []  # each node's keys: its ancestors' packed positions, then its own
    for n in nodes:
        own = list(range(n.offset, n.offset + len(n)))
        keys_of.append(own if n.parent < 0 else keys_of[n.parent] + own)
    batches, order = [], []
    for rooted in (True, False):
        costs = [(j, len(n), len(keys_of[j])) for j, n in enumerate(nodes) if (n.parent < 0) == rooted]
        for group in _group(costs):
            lq = max(len(nodes[j]) for j in group)
            lk = max(len(keys_of[j]) for j in group)
            q, q_pos, k, k_pos, real = [], [], [], [], []
            for r, j in enumerate(group):
                n, keys = nodes[j], keys_of[j]
                own = keys[len(keys) - len(n) :]
                q.append(own + [0] * (lq - len(n)))
                q_pos.append(positions[n.offset : n.offset + len(n)] + [_PAD_POS] * (lq - len(n)))
                k.append(keys + [0] * (lk - len(keys)))
                k_pos.append([positions[x] for x in keys] + [-1] * (lk - len(keys)))
                real += range(r * lq, r * lq + len(n))
                order += own
            first = nodes[group[0]].offset
            whole = all(len(nodes[j]) == lq and nodes[j].offset == first + r * lq for r, j in enumerate(group))
            batches.append(
                NodeBatch(
                    torch.tensor(q, device=device),
                    None if rooted else torch.tensor(k, device=device),
                    torch.tensor(q_pos, device=device),
                    torch.tensor(k_pos, device=device),
                    torch.tensor(real, device=device),
                    (first, len(group), lq) if whole else None,
                )
            )
    if order == list(range(layout.num_tokens)):
        return AttentionPlan(batches, None)
    inverse = torch.empty(layout.num_tokens, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(layout.num_tokens)
    return AttentionPlan(batches, inverse.to(device))


def varlen_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None, **kwargs
):
    """transformers' attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] over one
    packed row → ([1, T, H, D], None)."""
    plan: AttentionPlan | None = kwargs.pop(KWARG, None)
    if plan is None:
        # Without a plan no mask was made (transformers makes none for this implementation): only
        # a single token (the empty micro-batch a rank runs under FSDP2) is attended right then.
        if query.shape[2] > 1:
            raise ValueError("rollmesh_varlen: a forward of several tokens needs its packing plan")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("trainer.pack_sequences: attention logit soft-capping is not supported in packed rows")
    groups = query.shape[1] // key.shape[1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    dim = q.shape[-1]

    def rows(x, index, span):  # a batch's rows of x: [N, heads, L, D]
        if span is not None:  # a contiguous block: a view
            first, n, length = span
            return x[first : first + n * length].view(n, length, x.shape[1], dim).transpose(1, 2)
        # index_select: its backward is an index_add (indexing's is a slower scatter on CPU)
        return x.index_select(0, index.flatten()).view(*index.shape, x.shape[1], dim).transpose(1, 2)

    outs = []
    for b in plan.batches:
        mask = b.mask(sliding_window, q.dtype)
        keys, key_span = (b.q, b.span) if b.k is None else (b.k, None)
        kb, vb = rows(k, keys, key_span), rows(v, keys, key_span)
        # Key/value heads shared in the kernel, not copied per query head; with a mask CUDA's
        # kernels would fall back to the math path for that, so there they are copied.
        gqa = groups > 1 and (mask is None or q.device.type == "cpu")
        if groups > 1 and not gqa:
            kb, vb = repeat_kv(kb, groups), repeat_kv(vb, groups)
        out = torch.nn.functional.scaled_dot_product_attention(
            rows(q, b.q, b.span),
            kb,
            vb,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
        out = out.transpose(1, 2).reshape(-1, q.shape[1], dim)
        outs.append(out if b.span is not None else out.index_select(0, b.real))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return (out if plan.inverse is None else out.index_select(0, plan.inverse))[None], None


def use_varlen(model) -> None:
    """Make ``model``'s language model attend through ``varlen_attention`` (a vision tower keeps
    its own: its calls carry no plan)."""
    AttentionInterface.register(NAME, varlen_attention)
    model.config.get_text_config()._attn_implementation = NAME
