"""Recording which experts a mixture-of-experts model routes each token to, as SGLang returns them.

transformers' MoE decoders (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...) route with a module per MoE
layer (``*TopKRouter``) that returns ``(logits, scores, expert ids)`` for the flattened tokens of the
forward. A forward hook on each keeps the last forward's ids; the engine takes the rows it needs
(``RoutingCapture.take``) and nothing is copied off the device for a forward no request asked about.

SGLang's layout: per token, ``top_k`` ids for every decoder layer (``num_hidden_layers``), a dense
layer's left 0 (Qwen2-MoE's ``mlp_only_layers``, DeepSeek's first dense layers).
"""

from __future__ import annotations

import numpy as np
import torch

from sample_buffer.routing import moe_shape, routers_of


class RoutingCapture:
    """Hooks on every router of ``model``; ``layers``, ``top_k`` and ``num_experts`` describe it."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers, shape = routers_of(model), moe_shape(model)
        if shape is None:
            raise ValueError("not a mixture-of-experts model: no router modules")
        self.layers, self.moe_layers = shape.layers, list(shape.moe_layers)  # SGLang's: every decoder layer
        self.top_k, self.num_experts = shape.top_k, shape.num_experts
        self._ids: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in routers.items()]

    @property
    def width(self) -> int:
        """Ids per token: ``top_k`` per decoder layer."""
        return self.layers * self.top_k

    def _hook(self, layer: int):
        def keep(_module, _args, output) -> None:
            self._ids[layer] = output[2]  # [tokens, top_k]: this forward's choices

        return keep

    def take(self, rows: int, columns: int) -> np.ndarray:
        """The last forward's ids as ``[rows, columns, layers × top_k]`` uint8/uint16 (its input was
        ``[rows, columns]`` tokens)."""
        ids = torch.zeros(
            rows, columns, self.layers, self.top_k, dtype=torch.long, device=self._ids[self.moe_layers[0]].device
        )
        for layer in self.moe_layers:
            ids[:, :, layer] = self._ids[layer].reshape(rows, columns, self.top_k)
        dtype = torch.uint8 if self.num_experts <= 256 else torch.int32  # numpy's uint16 below
        out = ids.reshape(rows, columns, self.width).to("cpu", dtype).numpy()
        return out if dtype == torch.uint8 else out.astype(np.uint16)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
