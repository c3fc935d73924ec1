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
    """The cache and per-row real lengths of the requests currently being decoded.

    One ``DynamicCache`` lives as long as the batch: decode steps append to it in place, joins
    and leaves rewrite its per-layer tensors, so no step copies the cache twice.
    """

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []  # real (unpadded) tokens in the cache, per row

    @property
    def width(self) -> int:
        return self.cache.layers[0].keys.shape[2] if self.cache is not None else 0

    def _set(self, kv: KV) -> None:
        for layer, (k, v) in zip(self.cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v

    def extend(self, kv: KV, lengths: list[int]) -> None:
        """Append rows (right-aligned, as produced by ``prefill_inputs``)."""
        if self.cache is None:
            self.cache, self.lengths = kv_to_cache(kv), list(lengths)
            return
        new_width = kv[0][0].shape[2]
        width = max(self.width, new_width)
        self._set(
            [
                (
                    torch.cat([_left_pad(layer.keys, width - self.width), _left_pad(k1, width - new_width)]),
                    torch.cat([_left_pad(layer.values, width - self.width), _left_pad(v1, width - new_width)]),
                )
                for layer, (k1, v1) in zip(self.cache.layers, kv, strict=True)
            ]
        )
        self.lengths += lengths

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and trim padding every remaining row shares."""
        if not rows:
            self.cache, self.lengths = None, []
            return
        trim = self.width - max(self.lengths[r] for r in rows)
        if rows != list(range(len(self.lengths))):
            index = torch.tensor(rows, device=self.cache.layers[0].keys.device)
            self._set([(y.keys.index_select(0, index), y.values.index_select(0, index)) for y in self.cache.layers])
            self.lengths = [self.lengths[r] for r in rows]
        if trim > 0:
            self._set([(y.keys[:, :, trim:], y.values[:, :, trim:]) for y in self.cache.layers])

    def decode_inputs(self, last_tokens: list[int], device) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``input_ids`` [B, 1], ``position_ids`` [B, 1] and masks for one decode step."""
        width = self.width
        ids = torch.tensor(last_tokens, dtype=torch.long, device=device)[:, None]
        positions = torch.tensor(self.lengths, dtype=torch.long, device=device)[:, None]
        cols = torch.arange(width + 1, device=device)[None, :]
        pads = torch.tensor([width - n for n in self.lengths], device=device)[:, None]
        mask = (cols >= pads)[:, None, None, :]
        return ids, positions, _mask_mapping(mask)

    def advance(self) -> None:
        """After a decode step appended one column in place: every row holds one more token."""
        self.lengths = [n + 1 for n in self.lengths]
