"""Adapter-only weight updates of a LoRA policy: the trainer sends each adapted layer's factors
(``layer.lora_A``, ``layer.lora_B``, ``layer.lora_scaling``: bytes in proportion to the rank),
and the engine computes the layer's weight as the trainer merges it, ``W0 + scaling · B A`` in
float32 from the base ``W0`` read from its own model directory, then cast to its dtype (the
trainer keeps float32 weights: ``train_loop.publisher.adapter`` requires it). The
update is absolute (it does not depend on the version the engine holds); every other weight must
still be the base's, which the checksum of the whole result, compared with the trainer's, proves.
"""

from __future__ import annotations

import torch

from rollout.engines.embedded.lora import MAX_RANK, misfit

A, B, SCALING = ".lora_A", ".lora_B", ".lora_scaling"


def split(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A bucket's tensors by layer: (A, B, scaling), real or on the meta device (a collective
    update's, checked before it is received). Raises ``ValueError`` naming what is malformed."""
    layers = {}
    for key in tensors:
        suffix = next((s for s in (A, B, SCALING) if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{key!r} is not a LoRA factor (name.lora_A, .lora_B or .lora_scaling)")
        layers.setdefault(key.removesuffix(suffix), set()).add(suffix)
    out = {}
    for layer, parts in layers.items():
        if parts != {A, B, SCALING}:
            raise ValueError(f"{layer!r} needs lora_A, lora_B and lora_scaling in one bucket")
        a, b, s = tensors[layer + A], tensors[layer + B], tensors[layer + SCALING]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or s.numel() != 1:
            raise ValueError(
                f"{layer!r}: A [r, in], B [out, r] and a scalar scaling, got {tuple(a.shape)}, {tuple(b.shape)}"
            )
        if not 1 <= a.shape[0] <= MAX_RANK:  # bounds what a receive allocates: in and out are the layer's
            raise ValueError(f"{layer!r}: rank {a.shape[0]} outside [1, {MAX_RANK}]")
        if not (a.is_floating_point() and b.is_floating_point() and s.is_floating_point()):
            raise ValueError(f"{layer!r}: factors and scaling must be floating point")
        out[layer] = (a, b, s)
    return out


def check(model: torch.nn.Module, layers: dict) -> None:
    """Raise ``ValueError`` naming the first layer the factors cannot adapt (``lora.misfit``)."""
    modules = dict(model.named_modules())
    for name, (a, b, _) in layers.items():
        why = misfit(modules, name, a, b)
        if why is not None:
            raise ValueError(why)


def base_weights(model_path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """``names``' weights as the model directory holds them (in its dtype: a float32 trainer's
    frozen base is their float32 upcast), read from its safetensors files."""
    from pathlib import Path

    from safetensors import safe_open

    want, out = set(names), {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in want & set(f.keys()):
                out[key] = f.get_tensor(key)
    missing = want - set(out)
    if missing:
        raise ValueError(f"{sorted(missing)[0]!r} is not in {model_path}'s safetensors files")
    return out


def low_rank(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B A in float32, accumulated in float64: the trainer's merge and the engine's compute the same
    bits on different machines (a float32 product's last bits depend on the kernel's order)."""
    return (b.double() @ a.double()).float()


@torch.no_grad()
def apply(model: torch.nn.Module, layers: dict, base: dict[str, torch.Tensor]) -> list:
    """Set each layer's weight to base + scaling · B A (float32, then the weight's dtype); returns
    the undo list of ``weight_delta.restore`` (it puts everything back if anything fails midway)."""
    from rollout.engines.weight_delta import restore

    modules = dict(model.named_modules())
    undo: list = []
    try:
        for name, (a, b, scaling) in layers.items():
            w = modules[name].weight
            undo.append((w, None, w.to("cpu", copy=True)))
            merged = base[name + ".weight"].float() + float(scaling) * low_rank(a, b)
            w.copy_(merged.to(w.dtype))
    except BaseException:
        restore(undo)
        raise
    return undo
