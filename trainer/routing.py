"""Rollout routing replay (R3): the trainer's MoE layers route each token to the engine's experts.

The engine reports, per position, the experts each MoE layer chose (``sample_buffer/routing.py``:
SGLang's layout, ``top_k`` ids per decoder layer). With ``trainer.moe.routing: replay`` each router
of the model still computes its logits from the trainer's hidden states (so the router learns), but
the experts are the recorded ones, and their gates are the model's own formula over those experts:
softmax over all experts in float32, gathered at the recorded ids, renormalised where the router
renormalises (Mixtral always; Qwen2-MoE, Qwen3-MoE and OLMoE where ``norm_topk_prob``), in the dtype
the router returns. Replaying the trainer's own choices reproduces its free forward exactly.

What a router's auxiliary load-balancing loss sees is unchanged: transformers computes it from the
routers' logits (their own top-k), not from the replayed ids; rollmesh's losses add none.
"""

from __future__ import annotations

import numpy as np
import torch

from sample_buffer import routing
from sample_buffer.routing import MoEShape, moe_shape, routers_of

# Routers whose gates are softmax → top-k → optional renormalisation (what replay recomputes).
SOFTMAX_TOPK_ROUTERS = frozenset({"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter"})


class RoutingReplay:
    """A forward hook on every router of ``model``: with ids ``set`` ([tokens, layers, top_k] for the
    tokens of the next forward, flattened as the model flattens its [rows, columns] input) the routers'
    outputs become the replayed experts and their gates; with None they route freely. The trainer sets
    them for each of its forwards and keeps them until its backward is done (activation checkpointing
    recomputes each layer there, which must replay the same experts), then clears them: any other
    forward (the audit's, a copy of the model's: a hook is copied with its module) routes freely."""

    def __init__(self, model: torch.nn.Module, where: str = "trainer.moe.routing") -> None:
        routers = routers_of(model)
        if not routers:
            raise ValueError(f"{where}: replay needs a mixture-of-experts model; {model.config.model_type} has none")
        unknown = sorted({type(r).__name__ for r in routers.values()} - SOFTMAX_TOPK_ROUTERS)
        if unknown:
            raise ValueError(
                f"{where}: replay knows softmax top-k routers ({sorted(SOFTMAX_TOPK_ROUTERS)}), not {unknown}"
            )
        self.shape = moe_shape(model)
        self._ids: torch.Tensor | None = None
        for layer, router in routers.items():
            router.register_forward_hook(self._replaying(layer))

    def set(self, ids: torch.Tensor | None) -> None:
        self._ids = ids

    def _replaying(self, layer: int):
        def hook(router, _args, output):
            if self._ids is None:
                return None  # the router's own choice stands
            logits, scores, chosen = output
            ids = self._ids[:, layer].to(chosen.device, torch.long)
            if ids.shape != chosen.shape:
                raise ValueError(f"routing replay: ids {tuple(ids.shape)} for a forward of {tuple(chosen.shape)}")
            gates = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
            if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
                gates = gates / gates.sum(dim=-1, keepdim=True)
            return logits, gates.to(scores.dtype), ids

        return hook


def replay_ids(
    per_sequence: list[np.ndarray], places: list[tuple[int, int]], rows: int, columns: int, shape: MoEShape, device
) -> torch.Tensor:
    """The ids of one forward over a ``[rows, columns]`` input: sequence i's routing (``[P_i, layers ×
    top_k]``) at row ``places[i][0]`` from column ``places[i][1]``; every other position (a sequence's
    last token, padding) routes to experts 0..top_k-1, which nothing trained on depends on."""
    k = shape.top_k
    ids = torch.arange(k, dtype=torch.int32).expand(rows, columns, shape.layers, k).clone()
    for r, (row, col) in zip(per_sequence, places, strict=True):
        ids[row, col : col + len(r)] = torch.from_numpy(r.astype(np.int32)).reshape(len(r), shape.layers, k)
    return ids.reshape(rows * columns, shape.layers, k).to(device)


def usable(r: np.ndarray | None, needed: int, shape: MoEShape) -> str | None:
    """Why a trajectory's routing cannot be replayed (None: it can): missing, partial (fewer than the
    ``needed`` positions: every one before its last generated token), or not this model's."""
    if r is None:
        return "missing"
    if len(r) < needed:
        return "partial"
    try:
        routing.check_model(r, shape.layers, shape.top_k, shape.num_experts)
    except routing.RoutingError:
        return "mismatch"
    return None
