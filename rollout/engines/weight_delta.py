"""Delta weight updates: only the values that changed, in the engine's dtype, since a version the
engine holds. Both sides use this module: the trainer's publisher encodes
(``services/weight_transports/http_buckets.py``), the embedded engine checks and applies.

Why the engine's dtype: the trainer keeps float32 master weights and every optimizer step moves
nearly all of them, but an engine serving bfloat16 sees a value change only when its float32
master crosses a bfloat16 rounding boundary, a few percent of values per step at RL learning
rates. Comparing the cast of the new weights with the cast the engine holds finds exactly those.

Encoding, per tensor, whichever is smaller: the whole tensor (``name``), or the flat indices of
the changed values and the values (``name#index``, int32 or int64, and ``name#value``, the
engine's dtype). Indices cost 4 bytes each, so a tensor goes whole once more than about a third of
a bfloat16 tensor's values changed. Unchanged tensors are not sent. The engine verifies the
result against the checksum of the whole new state (``weights_checksum``) and restores what it
touched on a mismatch, so a delta against the wrong base can fail but never leave wrong weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

INDEX, VALUE = "#index", "#value"  # '#' appears in no parameter name


@dataclass
class DeltaStats:
    """What an encoded delta holds, for the publisher's metrics and the bench."""

    values: int = 0  # values in the model
    changed: int = 0  # values whose engine-dtype bits changed
    tensors_changed: int = 0  # tensors with at least one changed value
    tensors_whole: int = 0  # of those, sent whole (cheaper than indices + values)
    bytes: int = 0  # the delta's tensor bytes (indices + values + whole tensors)
    bytes_full: int = 0  # the whole state's bytes in the engine's dtype
    bytes_changed_tensors: int = 0  # had every changed tensor been sent whole
    bytes_sparse: int = 0  # had every changed tensor been sent as indices + values
    by_tensor: dict[str, int] = field(default_factory=dict, repr=False)  # name -> changed values

    @property
    def changed_share(self) -> float:
        return self.changed / self.values if self.values else 0.0


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state``'s floating tensors in the engine's dtype, on CPU, contiguous (what the engine holds)."""
    # A copy even where nothing converts (float32 on CPU): the trainer's own tensors change in place.
    return {
        n: t.detach().to(device="cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True).contiguous()
        for n, t in state.items()
    }


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def _changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat indices where the bits differ (a bit compare: NaN == NaN, -0.0 != 0.0, as the checksum)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    return torch.nonzero(old.view(-1).view(ints) != new.view(-1).view(ints)).view(-1)


Entry: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"  # a whole tensor, or (flat indices, values)


def encode(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[dict[str, Entry], DeltaStats]:
    """The delta from ``base`` to ``new`` (both from ``cast``, the same names, shapes and dtype):
    parameter name -> the whole tensor or (flat indices, values), for the changed ones."""
    if base.keys() != new.keys():
        raise ValueError(f"base and new weights name different tensors ({len(base)} vs {len(new)})")
    out: dict[str, Entry] = {}
    stats = DeltaStats()
    for name, t in new.items():
        old = base[name]
        if old.shape != t.shape or old.dtype != t.dtype:
            raise ValueError(f"{name}: base is {old.dtype} {tuple(old.shape)}, new is {t.dtype} {tuple(t.shape)}")
        stats.values += t.numel()
        whole = t.numel() * t.element_size()
        stats.bytes_full += whole
        idx = _changed(old, t)
        if not len(idx):
            continue
        stats.changed += len(idx)
        stats.tensors_changed += 1
        stats.by_tensor[name] = len(idx)
        index_dtype = _index_dtype(t.numel())
        sparse = len(idx) * (t.element_size() + torch.empty((), dtype=index_dtype).element_size())
        stats.bytes_changed_tensors += whole
        stats.bytes_sparse += sparse
        if whole <= sparse:
            out[name] = t
            stats.tensors_whole += 1
            stats.bytes += whole
        else:
            out[name] = (idx.to(index_dtype), t.view(-1)[idx])
            stats.bytes += sparse
    return out, stats


def buckets(entries: dict[str, Entry], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """The entries as named tensors (``name``, or ``name#index`` and ``name#value``) in buckets of
    at most ``max_bytes`` (a bigger entry travels alone); an entry's two parts share a bucket."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, e in entries.items():
        parts = {name + INDEX: e[0], name + VALUE: e[1]} if isinstance(e, tuple) else {name: e}
        n = sum(t.numel() * t.element_size() for t in parts.values())
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket |= parts
        size += n
    if bucket:
        yield bucket


def split(tensors: dict[str, torch.Tensor]) -> dict[str, Entry]:
    """A bucket's named tensors as entries again (what ``encode`` made). Raises ``ValueError``
    naming the entry for anything that is not a well-formed delta."""
    whole = {k: t for k, t in tensors.items() if not k.endswith((INDEX, VALUE))}
    sparse = {k.removesuffix(INDEX) for k in tensors if k.endswith(INDEX)}
    for key in tensors:
        if key.endswith(VALUE) and key.removesuffix(VALUE) not in sparse:
            raise ValueError(f"{key!r} has no {key.removesuffix(VALUE) + INDEX!r}")
    out: dict[str, Entry] = dict(whole)
    for name in sparse:
        if name in whole:
            raise ValueError(f"{name!r} is sent both whole and as indices")
        idx, values = tensors[name + INDEX], tensors.get(name + VALUE)
        if values is None:
            raise ValueError(f"{name + INDEX!r} has no {name + VALUE!r}")
        if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
            raise ValueError(f"{name + INDEX!r} must be 1-D int32 or int64, got {idx.dtype} {tuple(idx.shape)}")
        if values.dim() != 1 or len(values) != len(idx):
            raise ValueError(f"{name + VALUE!r} must be 1-D with one value per index ({len(idx)})")
        out[name] = (idx, values)
    return out


def check(params: dict[str, torch.Tensor], entries: dict[str, Entry]) -> None:
    """Raise ``ValueError`` naming the first entry that does not fit ``params`` exactly: an unknown
    name, another shape or dtype (a delta is made in the engine's dtype), an index out of range."""
    for name, e in entries.items():
        p = params.get(name)
        if p is None:
            raise ValueError(f"unknown tensor name {name!r}: the served model has no such parameter")
        if not p.is_contiguous():  # written through a flat view
            raise ValueError(f"{name!r}: the engine holds it non-contiguous; send whole weights")
        values = e[1] if isinstance(e, tuple) else e
        if values.dtype != p.dtype:
            raise ValueError(f"{name!r}: values are {values.dtype}, the engine holds {p.dtype}")
        if isinstance(e, tuple):
            idx = e[0]
            if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= p.numel()):
                raise ValueError(f"{name + INDEX!r}: indices must lie in [0, {p.numel()})")
        elif tuple(e.shape) != tuple(p.shape):
            raise ValueError(f"{name!r} has shape {tuple(e.shape)}, the model expects {tuple(p.shape)}")


@torch.no_grad()
def apply(params: dict[str, torch.Tensor], entries: dict[str, Entry]) -> list:
    """Write ``entries`` (checked) into ``params`` in place; returns what ``restore`` needs (the
    old values, in host memory: a whole tensor's copy must not cost the device a second model).
    Whatever fails midway (memory, a device error) puts back what was written before it raises."""
    undo: list = []
    try:
        for name, e in entries.items():
            p = params[name]
            flat = p.view(-1)
            if isinstance(e, tuple):
                idx = e[0].to(device=p.device, dtype=torch.int64)
                undo.append((p, idx, flat[idx].to("cpu", copy=True)))
                flat[idx] = e[1].to(p.device)
            else:
                undo.append((p, None, p.to("cpu", copy=True)))
                p.copy_(e)
    except BaseException:
        restore(undo)
        raise
    return undo


@torch.no_grad()
def restore(undo: list) -> None:
    for p, idx, old in reversed(undo):
        if idx is None:
            p.copy_(old)
        else:
            p.view(-1)[idx] = old.to(p.device)
