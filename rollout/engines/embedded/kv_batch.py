"""The running batch's key/value cache: left-padded rows that join and leave token by token.

Continuous batching on a stock Hugging Face model needs every row of a decode step to share one
cache tensor per layer. Rows are kept right-aligned (padding on the left): a row that joins is
padded to the batch's length (or the batch to the row's), a row that leaves is dropped with an
index select, and padding that every row shares is trimmed away. Each row's real length drives
its position ids, and an explicit 4-D mask hides the padding, so the numbers equal an unpadded
forward pass of that row alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each [B, H, L, D]


def cache_to_kv(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def kv_to_cache(kv: KV) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(t, (0, 0, n, 0)) if n else t


def prefill_inputs(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, dict, list[int]]:
    """Left-padded ``input_ids``, ``position_ids`` and the 4-D masks of a batched prefill.

    Returns (input_ids [B, L], position_ids [B, L], masks, lengths). Padding query rows attend to
    themselves only, which keeps their (unused) activations finite: a fully masked row would be
    NaN and NaN values in the cache poison later steps even where the mask hides them.
    """
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        valid[i, width - len(p) :] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
    mask = causal[None] & valid[:, None, :]
    mask |= torch.eye(width, dtype=torch.bool)[None]
    return ids.to(device), positions.to(device), _mask_mapping(mask[:, None].to(device)), lengths


def _mask_mapping(mask: torch.Tensor) -> dict:
    # transformers >= 5 accepts a ready mapping of masks per attention type; rollmesh applies the
    # same mask to sliding layers (it serves models without sliding windows).
    return {"full_attention": mask, "sliding_attention": mask}


class KVBatch:
    """The cache and per-row real lengths of the requests currently being decoded."""

    def __init__(self) -> None:
        self.kv: KV = []
        self.lengths: list[int] = []  # real (unpadded) tokens in the cache, per row

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else 0

    def extend(self, kv: KV, lengths: list[int]) -> None:
        """Append rows (right-aligned, as produced by ``prefill_inputs``)."""
        if not self.kv:
            self.kv, self.lengths = kv, list(lengths)
            return
        new_width = kv[0][0].shape[2]
        width = max(self.width, new_width)
        self.kv = [
            (
                torch.cat([_left_pad(k0, width - self.width), _left_pad(k1, width - new_width)]),
                torch.cat([_left_pad(v0, width - self.width), _left_pad(v1, width - new_width)]),
            )
            for (k0, v0), (k1, v1) in zip(self.kv, kv, strict=True)
        ]
        self.lengths += lengths

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and trim padding every remaining row shares."""
        if not rows:
            self.kv, self.lengths = [], []
            return
        if rows != list(range(len(self.lengths))):
            index = torch.tensor(rows, device=self.kv[0][0].device)
            self.kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]
            self.lengths = [self.lengths[r] for r in rows]
        trim = self.width - max(self.lengths)
        if trim > 0:
            self.kv = [(k[:, :, trim:], v[:, :, trim:]) for k, v in self.kv]

    def decode_inputs(self, last_tokens: list[int], device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``input_ids`` [B, 1], ``position_ids`` [B, 1] and masks for one decode step."""
        width = self.width
        ids = torch.tensor(last_tokens, dtype=torch.long, device=device)[:, None]
        positions = torch.tensor(self.lengths, dtype=torch.long, device=device)[:, None]
        cols = torch.arange(width + 1, device=device)[None, :]
        pads = torch.tensor([width - n for n in self.lengths], device=device)[:, None]
        mask = (cols >= pads)[:, None, None, :]
        return ids, positions, _mask_mapping(mask)

    def cache(self) -> DynamicCache:
        return kv_to_cache(self.kv)

    def advance(self, cache: DynamicCache) -> None:
        """Take the cache a decode step returned (one more column, every row one more token)."""
        self.kv = cache_to_kv(cache)
        self.lengths = [n + 1 for n in self.lengths]
