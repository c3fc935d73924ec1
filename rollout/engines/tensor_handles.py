"""Tensors passed by handle between processes on one machine: SGLang's
``/update_weights_from_tensor`` contract.

The sender pickles a list of (name, tensor). A CUDA tensor becomes a CUDA IPC handle through torch's
multiprocessing pickler (the receiver maps the sender's GPU memory; nothing is copied until it loads
the weights), as SGLang sends it. CPU tensors are copied into one POSIX shared-memory segment per
payload (``/dev/shm/rollmesh_w_<random>``) and each is pickled as a reference into it (segment,
offset, dtype, shape), which the receiver maps read-only and copies out. SGLang sends one such
payload per tensor-parallel rank, base64-encoded in JSON.

Why not torch's ``file_system`` sharing for CPU tensors: its shared-memory manager is started by
forking the sending process, and a fork of a trainer with gRPC and server threads running crashed
in the child under load ("no response from torch_shm_manager", a child's segmentation fault in a
full test run). Creating a segment forks nothing.

Unpickling runs whatever a payload names, so the receiver's unpickler admits only what torch's
reductions of dense CUDA tensors need and rollmesh's segment references; anything else is refused.
It is pickle's Python unpickler with the opcodes that set or build objects' state (BUILD, INST,
OBJ, NEWOBJ) removed: with them an allowed class could be changed for the whole process (BUILD on
``UntypedStorage`` replaced its methods). Sparse and nested tensors are refused (their indices
were not checked against their shape). A reference may name only a rollmesh segment, and only
bytes inside it.
"""

from __future__ import annotations

import base64
import io
import mmap
import os
import pickle
import re
import secrets

import torch

_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),  # a dense CUDA tensor's IPC handle
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "TypedStorage"),  # what reduce_tensor names as a CUDA tensor's storage class
    ("torch.storage", "UntypedStorage"),
    ("torch.nn.parameter", "Parameter"),
}

SEGMENT_PREFIX = "rollmesh_w_"
_SEGMENT = re.compile(rf"{SEGMENT_PREFIX}[0-9a-f]{{16}}")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
_ALIGN = 64  # each tensor starts on a cache line of the segment


def _shm_tensor(segment: str, offset: int, dtype: str, shape: tuple) -> torch.Tensor:
    """The tensor at ``offset`` of ``segment``, mapped copy-on-write (the sender's bytes never change)."""
    if not isinstance(segment, str) or not _SEGMENT.fullmatch(segment):
        raise pickle.UnpicklingError(f"shared memory {segment!r} is not a rollmesh weight segment")
    if dtype not in _DTYPES:
        raise pickle.UnpicklingError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise pickle.UnpicklingError(f"shape {shape!r} is not a tuple of sizes")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * _DTYPES[dtype].itemsize
    fd = os.open(f"/dev/shm/{segment}", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not (isinstance(offset, int) and offset >= 0 and offset + nbytes <= size):
            raise pickle.UnpicklingError(f"bytes {offset}..{offset}+{nbytes} lie outside {segment} ({size} bytes)")
        if nbytes == 0:
            return torch.empty(shape, dtype=_DTYPES[dtype])
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=_DTYPES[dtype], count=numel, offset=offset).view(shape)


class _SegmentRef:
    """Pickles as a call of ``_shm_tensor``: what the receiver rebuilds a CPU tensor with."""

    def __init__(self, segment: str, offset: int, dtype: torch.dtype, shape: torch.Size) -> None:
        self.args = (segment, offset, str(dtype).removeprefix("torch."), tuple(shape))

    def __reduce__(self):
        return _shm_tensor, self.args


class Handles:
    """One payload and the shared memory its CPU tensors were copied into, which must stay until the
    receiver has copied them out; ``close()`` frees it (CUDA tensors: their memory is the caller's)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from multiprocessing.reduction import ForkingPickler

        self.segment = None
        cpu = [(n, t.detach().contiguous()) for n, t in named if not t.is_cuda]
        items, refs = list(named), {}
        if cpu:
            spans, total = [], 0
            for name, t in cpu:
                if str(t.dtype).removeprefix("torch.") not in _DTYPES:
                    raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot travel as a weight")
                spans.append(total)
                total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
            self.segment = _create_segment(max(total, 1))
            for (name, t), offset in zip(cpu, spans):
                n = t.numel() * t.element_size()
                if n:  # one copy, straight into the segment, and no view of it left behind
                    self.segment.buf[offset : offset + n] = t.reshape(-1).view(torch.uint8).numpy()
                refs[name] = _SegmentRef(self.segment.name, offset, t.dtype, t.shape)
            items = [(n, refs.get(n, t)) for n, t in named]
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(items)
        self.payload = base64.b64encode(buf.getvalue()).decode()

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None


def _create_segment(size: int):
    from multiprocessing import shared_memory

    # The name is random: a receiver can map only a segment whose name a payload it was sent holds.
    return shared_memory.SharedMemory(name=SEGMENT_PREFIX + secrets.token_hex(8), create=True, size=size)


def _refuse_opcode(name: str):
    def refuse(self):
        raise pickle.UnpicklingError(f"opcode {name} (building an object's state) is not part of a tensor handle")

    return refuse


class _TensorsOnly(pickle._Unpickler):  # the Python unpickler: its opcode table can be narrowed
    dispatch = dict(pickle._Unpickler.dispatch)
    for _op in ("BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"):
        dispatch[getattr(pickle, _op)[0]] = _refuse_opcode(_op)

    def _reduce(self):
        # Only these may be called: a class named above (UntypedStorage(10**12)) would allocate at will.
        if self.stack[-2] not in _CALLABLE:
            raise pickle.UnpicklingError(f"calling {self.stack[-2]!r} is not part of a tensor handle")
        pickle._Unpickler.load_reduce(self)

    dispatch[pickle.REDUCE[0]] = _reduce

    def find_class(self, module: str, name: str):
        if (module, name) == (__name__, "_shm_tensor"):
            return _shm_tensor
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor handle")


def _rebuild_cuda_tensor():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor


_CALLABLE = (_shm_tensor, torch.Size, _rebuild_cuda_tensor())


def dumps(named: list[tuple[str, torch.Tensor]]) -> Handles:
    """(name, tensor) pairs as one payload (``.payload``, base64) of handles: CUDA tensors' memory must
    stay alive and unchanged until the receiver has loaded them; CPU tensors are copied into shared
    memory that lives until ``.close()``."""
    return Handles(named)


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
    for name, t in named:
        if t.layout != torch.strided:
            raise ValueError(f"tensor {name!r}: layout {t.layout}: a weight is a dense tensor")
    return dict(named)
