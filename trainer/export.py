"""Weights out of the trainer, for the inference engines.

Two forms: a Hugging Face directory (what ``/update_weights_from_disk`` loads, and the restore
point of every transport) and buckets of (name, tensor) pairs, each at most ``max_bytes`` (what
an in-memory transport sends, such as the embedded engine's ``/update_weights_from_safetensors``).
The transports are the ``WeightPublisher``s in ``services/weight_transports/``. Names are
Hugging Face parameter names, so any engine that loads the checkpoint accepts them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer import lora

_HF_FILES = (  # beside the weights, what makes a directory a servable checkpoint (a vision model's processor too)
    "preprocessor_config.json",
    "processor_config.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def full_state_dict(model: torch.nn.Module, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded tensors by HF name, on CPU unless ``cpu_offload`` is off (every rank must call it
    under FSDP2; with the offload only rank 0 gets them), tied copies dropped; a LoRA policy's
    adapters merged into their weights."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    sd = get_model_state_dict(model, options=opts)
    if hasattr(model, "peft_config") and sd:  # LoRA: the adapters folded into the weights engines serve
        sd = lora.merged(sd, lora.scalings(model))
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd


def weight_buckets(state: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Split a state dict into ordered buckets of at most ``max_bytes`` (a bigger tensor travels alone)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
    bucket, size = {}, 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += n
    if bucket:
        yield bucket


def export_hf(
    model: torch.nn.Module, source_dir: str | Path, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None
) -> Path | None:
    """Write a HF directory (safetensors + the source's config and tokenizer files); rank 0 writes.
    ``state``: the ``full_state_dict`` already gathered (else every rank gathers it here)."""
    from safetensors.torch import save_file

    state = full_state_dict(model) if state is None else state
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return None
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in _HF_FILES:
        if (Path(source_dir) / name).exists():
            shutil.copy(Path(source_dir) / name, tmp / name)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}  # (a no-op for CPU tensors)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # an engine never sees a half-written directory
    return out


def _adapters_gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA policy's trainable tensors (the adapters alone, not the frozen base), unsharded on
    CPU: on rank 0 (every rank must call it under FSDP2)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=opts)


def adapter_factors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA policy's factors and scalings by plain layer name (``lora.factors``), on CPU; rank 0
    (every rank gathers)."""
    sd = _adapters_gathered(model)
    return lora.factors(sd, lora.scalings(model)) if sd else {}


def export_adapter(model: torch.nn.Module, out_dir: str | Path) -> Path | None:
    """A LoRA policy's adapters as PEFT saves them (``adapter_config.json`` and
    ``adapter_model.safetensors``: ``PeftModel.from_pretrained`` loads it onto the base model);
    every rank gathers, rank 0 writes."""
    from safetensors.torch import save_file

    sd = _adapters_gathered(model)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.peft_config[lora.ADAPTER].save_pretrained(str(out))
    state = {k: v.detach().to("cpu").contiguous() for k, v in lora.adapter_state(sd).items()}
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
