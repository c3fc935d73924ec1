"""Tensors passed by handle between processes on one machine: SGLang's
``/update_weights_from_tensor`` contract.

The sender pickles a list of (name, tensor) with torch's multiprocessing pickler: a CUDA tensor
becomes a CUDA IPC handle (the receiver maps the sender's GPU memory, nothing is copied until it
loads the weights), a CPU tensor a shared-memory segment by name (the ``file_system`` sharing
strategy; torch's default, file descriptors, cannot cross between unrelated processes). SGLang
sends one such payload per tensor-parallel rank, base64-encoded in JSON.

Unpickling runs whatever a payload names, so the receiver's unpickler admits only what torch's
reductions of tensors and storages need; anything else is refused.
"""

from __future__ import annotations

import base64
import io
import pickle

import torch

_ALLOWED = {
    ("torch.multiprocessing.reductions", n) for n in (
        "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
        "rebuild_storage_empty", "rebuild_nested_tensor", "rebuild_sparse_coo_tensor",
    )
} | {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
     ("torch.nn.parameter", "Parameter"), ("torch._utils", "_rebuild_tensor_v2"),
     ("collections", "OrderedDict")}  # fmt: skip


def _torch_segment_only(cls, manager, handle, size, dtype=None):
    """``rebuild_storage_filename``, for the shared-memory segments torch names (``/torch_...``)
    only: a payload may not map any other file of /dev/shm into this process."""
    from torch.multiprocessing.reductions import rebuild_storage_filename

    name = handle.decode(errors="replace") if isinstance(handle, bytes) else str(handle)
    if not name.startswith("/torch_") or "/" in name[1:]:
        raise pickle.UnpicklingError(f"shared memory {name!r} is not a torch segment")
    return rebuild_storage_filename(cls, manager, handle, size, dtype)


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return _torch_segment_only
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor handle")


def dumps(named: list[tuple[str, torch.Tensor]]) -> str:
    """(name, tensor) pairs as one base64 payload: handles to the tensors' memory, which must stay
    alive (and unchanged) until the receiver has loaded them."""
    from multiprocessing.reduction import ForkingPickler

    if any(not t.is_cuda for _, t in named):
        torch.multiprocessing.set_sharing_strategy("file_system")  # shareable with an unrelated process
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode()


def loads(payload: str | bytes) -> dict[str, torch.Tensor]:
    """The (name, tensor) pairs of one payload; ``ValueError`` for anything else."""
    try:
        raw = base64.b64decode(payload, validate=True)
        named = _TensorsOnly(io.BytesIO(raw)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, RuntimeError, OSError, TypeError) as e:
        raise ValueError(f"not a tensor-handle payload: {e}") from None
    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor) for p in named
    ):
        raise ValueError("a tensor-handle payload is a list of (name, tensor) pairs")
    return dict(named)
