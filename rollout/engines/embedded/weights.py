"""Loading weights into a running engine: from a Hugging Face directory or from named tensors."""

from __future__ import annotations

import hashlib

import torch


def weights_checksum(state_dict: dict[str, torch.Tensor]) -> str:
    """A short fingerprint of a set of weights: sha256 over names, dtypes, shapes and bytes.

    The trainer computes the same over what it exported, so an engine's reported checksum proves
    it loaded exactly those weights. Tied tensors count once, under the first of their names (a
    model's state dict names the shared embedding again as ``lm_head.weight``; the trainer's export
    does not), so the two sides' checksums compare.
    """
    seen, names = set(), []
    for name, t in state_dict.items():
        key = (t.device, t.data_ptr(), tuple(t.shape), t.dtype, t.stride())
        if t.numel() and key in seen:
            continue
        seen.add(key)
        names.append(name)
    h = hashlib.sha256()
    for name in sorted(names):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def check_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first tensor that the model has no slot for."""
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for name, t in tensors.items():
        if name not in params:
            raise ValueError(f"unknown tensor name {name!r}: the served model has no such parameter")
        if tuple(params[name].shape) != tuple(t.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the model expects {tuple(params[name].shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a floating point dtype")


@torch.no_grad()
def copy_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model's parameters in place (tied weights share the copy)."""
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for name, t in tensors.items():
        params[name].copy_(t.to(device=params[name].device, dtype=params[name].dtype))
