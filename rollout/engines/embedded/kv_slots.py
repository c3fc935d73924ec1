"""The running batch's key/value cache: a preallocated slot per running request.

Each layer keeps its keys and values in tensors [slots, heads, capacity, head_dim], allocated
ahead and grown by doubling, so a decode step writes one column per row in place. (A
``DynamicCache`` concatenates every layer's whole cache every step, and joining or leaving rows
rewrote the whole batch's.) Rows are left-aligned: column i of a row holds its token at position
i. A joining group's prefill (left-padded, so every row's last token is in the last column and
only that column's logits are computed) is written into the next free slots, each row shifted
to start at column 0; a row that leaves is replaced by the last running row, one row copied.
Masks hide each row's unused columns (see ``attention.py``), so the numbers equal an unpadded
forward of that row alone.

The model sees an ordinary transformers ``Cache`` whose layers write where the current step says:
``prefill`` (a block into new slots) or ``decode`` (one column per running row).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from rollout.engines.embedded.attention import AttentionLayout


class _SlotLayer(CacheLayerMixin):
    """One layer's storage; ``update`` writes what the owning ``KVSlots`` step says."""

    is_sliding = False  # the engine's masks, not the cache, apply windows

    def __init__(self, owner: KVSlots) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, length = self.owner.capacity
        k, v = key_states, value_states
        self.keys = k.new_zeros(b, k.shape[1], length, k.shape[3])
        self.values = v.new_zeros(b, v.shape[1], length, v.shape[3])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner.write(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.seen + query_length, 0

    def get_seq_length(self) -> int:  # tokens cached before this step (a model may derive positions)
        return self.owner.seen

    def get_max_length(self) -> int:
        return -1


class KVSlots:
    """Slots 0..n-1 hold the running requests, in the engine's order; ``lengths`` their tokens."""

    def __init__(self, layout: AttentionLayout, num_layers: int, max_slots: int, max_len: int, device) -> None:
        self.layout, self.device = layout, device
        self.max_slots, self.max_len = max_slots, max_len
        self.capacity = (min(8, max_slots), min(256, max_len))  # grown by doubling as needed
        self.layers = [_SlotLayer(self) for _ in range(num_layers)]
        self.cache = Cache(layers=self.layers)
        self.lengths: list[int] = []
        self.width = 0  # columns the current step attends over
        self.seen = 0  # of those, the columns cached before it
        self._step: tuple = ()

    @property
    def n(self) -> int:
        return len(self.lengths)

    # ------------------------------------------------------------- the model's forward calls these
    def write(self, layer: _SlotLayer, k: torch.Tensor, v: torch.Tensor):
        if layer.keys.shape[0] < self.capacity[0] or layer.keys.shape[2] < self.capacity[1]:
            self._grow(layer)
        kind, a, b = self._step
        if kind == "prefill":  # rows a..a+B-1 take the block, shifted left by each row's padding
            shift = b[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            width = k.shape[2]
            layer.keys[a : a + k.shape[0], :, :width] = k.gather(2, shift)
            layer.values[a : a + k.shape[0], :, :width] = v.gather(2, shift)
            return k, v  # the prefill attends over its own block
        rows, cols = a, b  # decode: row i's new column at its length
        layer.keys[rows, :, cols] = k[:, :, 0]
        layer.values[rows, :, cols] = v[:, :, 0]
        return layer.keys[: self.n, :, : self.width], layer.values[: self.n, :, : self.width]

    def _grow(self, layer: _SlotLayer) -> None:
        b, length = self.capacity
        keys, values = layer.keys, layer.values
        shape = (b, keys.shape[1], length, keys.shape[3])
        layer.keys, layer.values = keys.new_zeros(shape), values.new_zeros(shape)
        old_b, old_len = keys.shape[0], keys.shape[2]
        layer.keys[:old_b, :, :old_len] = keys
        layer.values[:old_b, :, :old_len] = values

    def _reserve(self, slots: int, length: int) -> None:
        if slots > self.max_slots or length > self.max_len:
            raise ValueError(
                f"the cache holds {self.max_slots} rows of {self.max_len} tokens; asked {slots} × {length}"
            )
        b, cap = self.capacity
        while b < slots:
            b = min(2 * b, self.max_slots)
        while cap < length:
            cap = min(2 * cap, self.max_len)
        self.capacity = (b, cap)  # each layer grows on its next write

    # ------------------------------------------------------------- the engine calls these
    def prefill(self, contexts: list[list[int]], dtype: torch.dtype):
        """Inputs to prefill ``contexts`` into the next free slots: (input_ids, position_ids, masks),
        left-padded. The rows join the batch (``lengths``) with this call."""
        lengths = [len(c) for c in contexts]
        width, first = max(lengths), self.n
        self._reserve(first + len(contexts), width)
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        valid = torch.zeros(len(contexts), width, dtype=torch.bool)
        for i, c in enumerate(contexts):
            ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
            valid[i, width - len(c) :] = True
        valid = valid.to(self.device)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        masks = self.layout.masks(positions, positions, valid, dtype)
        pads = torch.tensor([width - n for n in lengths], device=self.device)
        source = (torch.arange(width, device=self.device)[None] + pads[:, None]).clamp(max=width - 1)
        self._step, self.width, self.seen = ("prefill", first, source), width, 0
        self.lengths += lengths
        return ids.to(self.device), positions, masks

    def repeat(self, sources: list[int]) -> None:
        """New rows after the running ones, each a copy of slot ``sources[j]``'s cache: requests whose
        context equals one just prefilled share its forward (a group's samples of one prompt)."""
        if not sources:
            return
        first, n = self.n, max(self.lengths[i] for i in sources)
        self._reserve(first + len(sources), n)
        src = torch.tensor(sources, device=self.device)
        for layer in self.layers:
            if layer.is_initialized:
                if layer.keys.shape[0] < self.capacity[0] or layer.keys.shape[2] < self.capacity[1]:
                    self._grow(layer)
                layer.keys[first : first + len(sources), :, :n] = layer.keys[src, :, :n]
                layer.values[first : first + len(sources), :, :n] = layer.values[src, :, :n]
        self.lengths += [self.lengths[i] for i in sources]

    def decode(self, last_tokens: list[int], dtype: torch.dtype):
        """Inputs of one decode step over every running row: (input_ids, position_ids, masks)."""
        pos = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        self.width = max(self.lengths) + 1
        self.seen = self.width - 1
        self._reserve(self.n, self.width)
        cols = torch.arange(self.width, device=self.device)[None].expand(self.n, -1)
        masks = self.layout.masks(pos[:, None], cols, cols <= pos[:, None], dtype)
        self._step = ("decode", torch.arange(self.n, device=self.device), pos)
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        return ids, pos[:, None], masks

    def advance(self) -> None:
        """After a decode step: every row holds one more token."""
        self.lengths = [n + 1 for n in self.lengths]

    def release(self, gone: set[int]) -> list[int]:
        """Free the slots in ``gone``; the last running row moves into each hole. Returns the new
        order: slot j now holds the row that was in slot ``order[j]``."""
        order = list(range(self.n))
        for i in sorted(gone, reverse=True):
            last = len(order) - 1
            if i != last:
                n = self.lengths[last]
                for layer in self.layers:
                    if layer.is_initialized:
                        layer.keys[i, :, :n] = layer.keys[last, :, :n]
                        layer.values[i, :, :n] = layer.values[last, :, :n]
                self.lengths[i], order[i] = n, order[last]
            self.lengths.pop()
            order.pop()
        return order

    def clear(self) -> None:
        """Every row leaves (the storage stays, for the next batch)."""
        self.lengths = []
