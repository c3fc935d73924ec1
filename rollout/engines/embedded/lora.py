"""LoRA adapters served per request: SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``,
and a request's ``lora_path`` naming the adapter it is generated with.

Several adapters (and none) share one continuous batch: a forward hook on each adapted linear
layer adds ``scaling · (x A^T) B^T`` to the rows whose request names an adapter, each with its
own, so the base weights are never changed and a row without an adapter computes exactly what it
would alone. An adapter is read from a PEFT directory (``adapter_config.json`` and
``adapter_model.safetensors``, what ``PeftModel.save_pretrained`` and the trainer write) and
checked against the served model before it is used: every target a linear layer of this model,
every factor the shape that layer needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.engines.contract import EngineError

_FACTOR = ".lora_"  # PEFT's files: base_model.model.<module>.lora_A.weight and .lora_B.weight
_PREFIX = "base_model.model."
MAX_RANK = 1024


@dataclass
class Adapter:
    name: str
    path: str
    version: int  # what each token generated with it reports (token_versions)
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module -> (A [r, in], B [out, r], scaling)


def misfit(modules: dict[str, torch.nn.Module], name: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why factors ``a`` [r, in] and ``b`` [out, r] cannot adapt layer ``name`` of a model whose
    ``named_modules`` are ``modules``; None when they can. (Also the check of adapter-only updates.)"""
    layer = modules.get(name)
    if not isinstance(layer, torch.nn.Linear):
        return f"{name!r} is not a linear layer of the served model"
    if ".experts." in name or "shared_expert" in name:
        # their inputs are routed tokens, flattened: a row is no longer a request
        return f"{name!r} is an expert's layer; adapters on experts are not served"
    if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
        return (
            f"{name!r}: factors {tuple(a.shape)} and {tuple(b.shape)} do not fit this model's "
            f"{layer.in_features} -> {layer.out_features} layer (an adapter of another base model?)"
        )
    return None


def read(model: torch.nn.Module, name: str, path: Path, version: int, device) -> Adapter:
    """The adapter in PEFT directory ``path``, checked against ``model``; ``EngineError`` naming
    what does not fit (``lora_path``)."""
    from safetensors.torch import load_file

    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise EngineError("lora_path", f"{path} is not a PEFT LoRA adapter directory: {e}") from None
    plain = cfg.get("peft_type", "LORA") == "LORA" and cfg.get("bias", "none") == "none"
    if not plain or any(cfg.get(k) for k in ("use_dora", "lora_bias", "alpha_pattern", "rank_pattern")):
        raise EngineError(
            "lora_path", f"{path}: only plain LoRA adapters are served (no DoRA, bias, or per-layer rank or alpha)"
        )
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK or not isinstance(alpha, int | float):
        raise EngineError("lora_path", f"{path}: adapter_config.json needs r in [1, {MAX_RANK}] and lora_alpha")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    modules = dict(model.named_modules())
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if _FACTOR not in key or not key.startswith(_PREFIX):
            raise EngineError("lora_path", f"{path}: {key!r} is not a LoRA factor")
        module, _, factor = key[len(_PREFIX) :].rpartition(_FACTOR)
        factors.setdefault(module, {})[factor.split(".")[0]] = t
    if not factors:
        raise EngineError("lora_path", f"{path}: the adapter holds no factors")
    layers = {}
    for module, ab in factors.items():
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise EngineError("lora_path", f"{path}: {module!r} needs both lora_A and lora_B")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise EngineError(
                "lora_path", f"{path}: {module!r} factors {tuple(a.shape)}, {tuple(b.shape)} are not of rank {rank}"
            )
        why = misfit(modules, module, a, b)
        if why is not None:
            raise EngineError("lora_path", f"{path}: {why}")
        # float32 factors, added in float32 (as PEFT computes them), then rounded to the layer's dtype
        layers[module] = (a.to(device, torch.float32), b.to(device, torch.float32), float(scaling))
    return Adapter(name, str(path), version, layers)


class Adapters:
    """The adapters an engine serves, and the hooks that apply them to the rows of a forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.by_name: dict[str, Adapter] = {}
        self._groups: list[tuple[Adapter, torch.Tensor]] = []  # this forward's adapters and their rows
        self._rows = 0  # ... out of this many
        self._hooks: dict[str, object] = {}
        self.model = model

    def add(self, adapter: Adapter) -> None:
        modules = dict(self.model.named_modules())
        for module in adapter.layers:
            if module not in self._hooks:
                self._hooks[module] = modules[module].register_forward_hook(self._hook(module))
        self.by_name[adapter.name] = adapter

    def remove(self, name: str) -> Adapter:
        return self.by_name.pop(name)

    def rebind(self, model: torch.nn.Module) -> None:
        """The engine serves a new model object (weights loaded from disk): hook its layers. Raises
        ``EngineError`` (nothing changed) if an adapter does not fit it."""
        modules = dict(model.named_modules())
        for adapter in self.by_name.values():
            for name, (a, b, _) in adapter.layers.items():
                why = misfit(modules, name, a, b)
                if why is not None:
                    raise EngineError("model_path", f"adapter {adapter.name!r} does not fit the new model: {why}")
        for h in self._hooks.values():
            h.remove()
        self._hooks, self.model = {}, model
        for adapter in list(self.by_name.values()):
            self.add(adapter)

    def select(self, names: list[str | None], device) -> None:
        """The next forward's rows: row i is generated with adapter ``names[i]`` (None: the base)."""
        rows: dict[str, list[int]] = {}
        self._rows = len(names)
        for i, n in enumerate(names):
            if n is not None:
                rows.setdefault(n, []).append(i)
        self._groups = [(self.by_name[n], torch.tensor(r, device=device)) for n, r in rows.items()]

    def _hook(self, module: str):
        def add_adapters(layer, args, out):
            if not self._groups:
                return out
            x = args[0]
            if x.dim() != 3 or x.shape[0] != self._rows:  # rows must be requests (read() refuses experts)
                raise RuntimeError(f"{module}: input {tuple(x.shape)} is not [requests, tokens, features]")
            for adapter, rows in self._groups:
                factors = adapter.layers.get(module)
                if factors is not None:
                    a, b, scaling = factors
                    out[rows] += (scaling * ((x[rows].float() @ a.T) @ b.T)).to(out.dtype)
            return out

        return add_adapters
