"""Which attention a served model has, and the masks the embedded engine hands it.

The engine builds its own 4-D masks (its cache rows are padded and of different lengths), so it
must build them the way each layer attends: full causal attention, or a sliding window of the
last ``sliding_window`` positions. A model whose layers all attend alike takes one mask tensor
(Llama's and Mistral's forwards accept nothing else); a model that mixes both (Gemma 2/3, Qwen2
with windowed layers) takes a mapping per attention type. Anything else (linear attention,
chunked attention, state-space layers) is refused at load: its cache is not keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedModel(ValueError):
    """A model the embedded engine cannot serve; the message says what and why."""


@dataclass(frozen=True)
class AttentionLayout:
    types: frozenset[str]  # the attention types the model's layers use
    window: int | None  # positions a sliding layer sees, itself included
    eager: bool = False  # the eager implementation adds a float mask; SDPA takes booleans

    @classmethod
    def of(cls, config, where: str) -> AttentionLayout:
        config = config.get_text_config()
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModel(
                f"{where}: {config.model_type} is an encoder-decoder model; the embedded engine "
                "serves decoder-only causal LMs"
            )
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:  # older configs: a window set (and switched on) applies to every layer
            on = window is not None and getattr(config, "use_sliding_window", True)
            types = [SLIDING if on else FULL]
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise UnsupportedModel(
                f"{where}: {config.model_type} has {', '.join(unknown)} layers; the embedded "
                "engine serves full and sliding-window attention only"
            )
        if SLIDING in types and not window:
            raise UnsupportedModel(f"{where}: sliding-window layers without a sliding_window size")
        return cls(frozenset(types), int(window) if SLIDING in types else None)

    def masks(self, query_pos: torch.Tensor, key_pos: torch.Tensor, key_valid: torch.Tensor, dtype: torch.dtype):
        """Masks for queries at positions ``query_pos`` [B, Q] over keys at ``key_pos`` [B, K], of
        which ``key_valid`` [B, K] are tokens (the rest padding). Positions, not columns, decide:
        a padding query of a left-padded prefill (position 0) sees the row's first token and is
        never fully masked, which would make its unused activations NaN."""
        q, k = query_pos[:, :, None], key_pos[:, None, :]
        full = key_valid[:, None, :] & (k <= q)
        out = {FULL: full}
        if self.window is not None:
            out[SLIDING] = full & (k > q - self.window)
        out = {t: self._format(m[:, None], dtype) for t, m in out.items() if t in self.types}
        return out if len(out) > 1 else next(iter(out.values()))

    def _format(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self.eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
