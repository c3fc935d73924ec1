"""LoRA: the policy trains low-rank adapters on chosen linear layers (PEFT) while its base weights
stay frozen. The optimizer, gradients and checkpoints hold only the adapters; the reference
policy for a KL term is the same model with the adapters off (no second copy of the weights).

Engines receive whole weights (``merged`` folds each adapter into its base weight, W + scaling ·
B A, under the model's own names, so every weight transport and engine works as with full
fine-tuning) or, with ``http_buckets``' ``adapter: true``, each adapted layer's factors
(``factors``). ``adapter_state`` is the adapter alone, in PEFT's format.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# PEFT's names: the wrapper's prefix, a wrapped layer's frozen weight, and its adapter's factors.
PREFIX = "base_model.model."
BASE = ".base_layer"
ADAPTER = "default"


class LoraConfig(BaseModel):
    """Low-rank adapters (LoRA) instead of full fine-tuning."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, le=1024, description="Rank r of each adapter (A: r × in, B: out × r).")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: an adapter adds (alpha / rank) · B A.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input while training. Above 0 the log-probs of a step's own "
        "forward passes (π_prox, the ratio) are noisy too.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names (last component) of the linear layers that get an adapter, e.g. q_proj, v_proj, "
        "gate_proj, up_proj, down_proj; each must exist in the model.",
    )


def wrap(model, config: LoraConfig):
    """``model`` with adapters on ``config.target_modules`` (B = 0: it computes what it did);
    every other weight frozen. Raises ``ValueError`` naming a target the model lacks."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m).__name__ == "Linear"}
    if getattr(model.config, "tie_word_embeddings", False):
        linear.discard("lm_head")  # tied to the embedding: its merged weight would never reach an engine
    missing = [t for t in config.target_modules if t not in linear]
    if missing:
        raise ValueError(
            f"trainer.lora.target_modules: {missing} are not linear layers of this model (it has: {sorted(linear)})"
        )
    peft_config = PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=config.target_modules
    )
    return get_peft_model(model, peft_config)


def scalings(model) -> dict[str, float]:
    """Each adapted layer's scaling by its name in the merged state (``…q_proj``)."""
    out = {}
    for name, module in model.named_modules():
        s = getattr(module, "scaling", None)
        if isinstance(s, dict) and ADAPTER in s:
            out[_hf(name)] = float(s[ADAPTER])
    return out


def _hf(name: str) -> str:
    """A wrapped model's name as the plain model's (the prefix FSDP or PEFT put in front dropped)."""
    return name[name.index(PREFIX) + len(PREFIX) :] if PREFIX in name else name


def merged(state: dict, scaling: dict[str, float]) -> dict:
    """A PEFT model's full state as the plain model's: every adapted weight W + scaling · B A (in
    W's dtype, computed in float32 from a product accumulated in float64, as an engine merging
    factors computes it: ``rollout/engines/embedded/adapter_sync.py``), under the model's own
    names; the adapters' factors dropped."""

    out = {}
    for name, t in state.items():
        if ".lora_" in name:
            continue
        plain = _hf(name).replace(BASE, "")
        if BASE in name:
            layer = _hf(name).removesuffix(BASE + ".weight")
            if name.endswith(BASE + ".weight"):
                a = state[name.replace(BASE + ".weight", f".lora_A.{ADAPTER}.weight")]
                b = state[name.replace(BASE + ".weight", f".lora_B.{ADAPTER}.weight")]
                t = (t.float() + scaling[layer] * (b.double() @ a.double()).float()).to(t.dtype)
        out[plain] = t
    return out


def adapter_state(state: dict) -> dict:
    """The adapters' factors alone, named as PEFT saves them (``adapter_model.safetensors``)."""
    return {_hf_adapter(n): t for n, t in state.items() if ".lora_" in n}


def _hf_adapter(name: str) -> str:
    # PEFT's files name a factor base_model.model.<layer>.lora_A.weight (no adapter name)
    return PREFIX + _hf(name).replace(f".{ADAPTER}.", ".")


def factors(state: dict, scaling: dict[str, float]) -> dict:
    """Each adapted layer's factors and scaling by its plain name: ``layer.lora_A`` [r, in],
    ``layer.lora_B`` [out, r] and ``layer.lora_scaling`` (a 0-d float64 tensor), what an engine
    needs to compute the layer's weight from its base (``rollout/engines/embedded/adapter_sync.py``)."""
    import torch

    out = {}
    for name, t in state.items():
        if f".lora_A.{ADAPTER}.weight" in name:
            layer = _hf(name).removesuffix(f".lora_A.{ADAPTER}.weight")
            out[layer + ".lora_A"] = t
            out[layer + ".lora_B"] = state[name.replace(".lora_A.", ".lora_B.")]
            out[layer + ".lora_scaling"] = torch.tensor(scaling[layer], dtype=torch.float64)  # exactly the float
    return out
