"""Tensors passed by handle between processes on one machine: the ``ipc`` weight transport's payloads
(SGLang's ``/update_weights_from_tensor`` contract: one base64 string per tensor-parallel rank).

CPU tensors are copied into one POSIX shared-memory segment per payload
(``/dev/shm/rollmesh_w_<random>``) and travel as references into it; the receiver maps the segment
copy-on-write and copies them out. CUDA tensors travel as CUDA IPC handles to the sender's own memory
(nothing is copied until the receiver loads them). Two encodings of the same (name, tensor) list:

- ``rollmesh`` (what the embedded engine takes): base64 of a JSON object, one entry per tensor with
  its name, dtype, shape, strides and storage: ``{"shm": {segment, offset}}`` or ``{"cuda": {device,
  handle, ...}}`` (the fields of ``UntypedStorage._share_cuda_``). It is read by code, not by an
  unpickler: every field is checked, the names, dtypes and shapes against the receiver's parameters
  before any memory is mapped, and every element against the bytes of its storage. Dense tensors
  only: there is nothing else to say.
- ``sglang``: torch's multiprocessing pickle of CUDA tensors, which SGLang's server unpickles itself.
  rollmesh never unpickles a payload.

Why not torch's ``file_system`` sharing for CPU tensors: its shared-memory manager is started by
forking the sending process, and a fork of a trainer with gRPC and server threads running crashed in
the child under load. Creating a segment forks nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass

import torch

SEGMENT_PREFIX = "rollmesh_w_"
FORMAT = "rollmesh_tensors/1"
_SEGMENT = re.compile(rf"{SEGMENT_PREFIX}[0-9a-f]{{16}}")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
_ALIGN = 64  # each tensor starts on a cache line of the segment
_CUDA_FIELDS = ("device", "handle", "size", "offset", "ref_counter", "ref_counter_offset", "event", "event_sync")
_BYTES_FIELDS = ("handle", "ref_counter", "event")
# What torch's CUDA IPC takes as it is (torch/csrc/StorageSharing.cpp, CudaIPCTypes.h): handles of
# CUDA_IPC_HANDLE_SIZE bytes, a reference-counter file of CUDA_IPC_REF_COUNTER_FILE_SIZE int64 slots
# that its deleter decrements at ``ref_counter_offset`` unchecked, a counter named /torch_<...>.
# ``size`` and ``offset`` cannot be checked here: they are the sender's word for its allocation.
_CUDA_IPC_HANDLE_SIZE = 64
# Since torch 2.3 the caching allocator's handle is framed (CUDACachingAllocator's shareIpcHandle): a
# version byte, then b"c" and the 64-byte cudaIpcMemHandle_t of a cudaMalloc block, or b"e" and an
# expandable segment's description (a header and one handle per page), which torch itself parses.
_MAX_CUDA_HANDLE = 1 << 16
_HANDLE_VERSION = b"\x02"  # torch 2.3 to 2.11 (seen on an H100 with 2.11)
_CUDA_REF_COUNTER_SLOTS = 10_000
_REF_COUNTER = re.compile(rb"/torch_[0-9A-Za-z_]{1,64}")


@dataclass(frozen=True)
class TensorRef:
    """One entry of a payload, checked: what to map, before anything is."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    shm: tuple[str, int] | None = None  # (segment, byte offset)
    cuda: tuple | None = None  # UntypedStorage._share_cuda_'s fields, bytes decoded

    def nbytes_spanned(self) -> int:
        """The bytes of storage the tensor's elements reach, from the storage's start."""
        if any(n == 0 for n in self.shape):
            return 0
        last = self.storage_offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return (last + 1) * self.dtype.itemsize


class Handles:
    """One payload and the shared memory its CPU tensors were copied into, which must stay until the
    receiver has copied them out; ``close()`` frees it (CUDA tensors: their memory is the caller's)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], encoding: str = "rollmesh") -> None:
        self.segment = None
        if encoding == "sglang":
            self.payload = _sglang_payload(named)
            return
        if encoding != "rollmesh":
            raise ValueError(f"encoding {encoding!r}: expected rollmesh or sglang")
        for name, t in named:
            if str(t.dtype).removeprefix("torch.") not in _DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot travel as a weight")
        cpu = [(n, t.detach().contiguous()) for n, t in named if not t.is_cuda]
        shm = {}
        if cpu:
            spans, total = [], 0
            for _, t in cpu:
                spans.append(total)
                total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
            self.segment = _create_segment(max(total, 1))
            for (name, t), offset in zip(cpu, spans, strict=True):
                n = t.numel() * t.element_size()
                if n:  # one copy, straight into the segment, and no view of it left behind
                    self.segment.buf[offset : offset + n] = t.reshape(-1).view(torch.uint8).numpy()
                shm[name] = {"segment": self.segment.name, "offset": offset}
        entries = []
        for name, t in named:
            entry = {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            if name in shm:  # copied contiguous
                entry |= {"stride": list(torch.empty(t.shape).stride()), "storage_offset": 0, "shm": shm[name]}
            else:
                entry |= {"stride": list(t.stride()), "storage_offset": t.storage_offset(), "cuda": _cuda_fields(t)}
            entries.append(entry)
        self.payload = base64.b64encode(json.dumps({"format": FORMAT, "tensors": entries}).encode()).decode()

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None


def _cuda_fields(t: torch.Tensor) -> dict:
    fields = dict(zip(_CUDA_FIELDS, t.untyped_storage()._share_cuda_(), strict=True))
    return {k: base64.b64encode(v).decode() if k in _BYTES_FIELDS else v for k, v in fields.items()}


def _sglang_payload(named: list[tuple[str, torch.Tensor]]) -> str:
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    cpu = [n for n, t in named if not t.is_cuda]
    if cpu:
        raise ValueError(f"tensor {cpu[0]!r}: SGLang takes CUDA tensors by handle, not CPU ones")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def _create_segment(size: int):
    from multiprocessing import shared_memory

    # The name is random: a receiver can map only a segment whose name a payload it was sent holds.
    return shared_memory.SharedMemory(name=SEGMENT_PREFIX + secrets.token_hex(8), create=True, size=size)


def dumps(named: list[tuple[str, torch.Tensor]], encoding: str = "rollmesh") -> Handles:
    """(name, tensor) pairs as one payload (``.payload``, base64) of handles: CUDA tensors' memory must
    stay alive and unchanged until the receiver has loaded them; CPU tensors are copied into shared
    memory that lives until ``.close()``."""
    return Handles(named, encoding)


# ---------------------------------------------------------------- the receiving side
def _ints(value, what: str, minimum: int = 0) -> tuple[int, ...]:
    if not (isinstance(value, list) and all(type(n) is int and n >= minimum for n in value)):
        raise ValueError(f"{what}: expected a list of integers >= {minimum}, got {value!r}"[:200])
    return tuple(value)


def _int(value, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what}: expected an integer >= 0, got {value!r}"[:200])
    return value


def _entry(i: int, e) -> TensorRef:
    if not isinstance(e, dict):
        raise ValueError(f"tensors[{i}]: expected an object")
    where = f"tensors[{i}]"
    unknown = set(e) - {"name", "dtype", "shape", "stride", "storage_offset", "shm", "cuda"}
    if unknown:
        raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    name = e.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: expected a parameter name")
    if e.get("dtype") not in _DTYPES:
        raise ValueError(f"{where}.dtype: {e.get('dtype')!r}: expected one of {sorted(_DTYPES)}"[:200])
    shape, stride = _ints(e.get("shape"), f"{where}.shape"), _ints(e.get("stride"), f"{where}.stride")
    if len(shape) != len(stride):
        raise ValueError(f"{where}.stride: {len(stride)} strides for {len(shape)} dimensions")
    ref = dict(
        name=name,
        dtype=_DTYPES[e["dtype"]],
        shape=shape,
        stride=stride,
        storage_offset=_int(e.get("storage_offset"), f"{where}.storage_offset"),
    )
    if ("shm" in e) == ("cuda" in e):
        raise ValueError(f"{where}: expected one storage, shm or cuda")
    if "shm" in e:
        shm = e["shm"]
        if not isinstance(shm, dict) or set(shm) != {"segment", "offset"}:
            raise ValueError(f"{where}.shm: expected {{segment, offset}}")
        if not isinstance(shm["segment"], str) or not _SEGMENT.fullmatch(shm["segment"]):
            raise ValueError(f"{where}.shm.segment: {shm['segment']!r} is not a rollmesh weight segment"[:200])
        return TensorRef(**ref, shm=(shm["segment"], _int(shm["offset"], f"{where}.shm.offset")))
    cuda = e["cuda"]
    if not isinstance(cuda, dict) or set(cuda) != set(_CUDA_FIELDS):
        raise ValueError(f"{where}.cuda: expected the fields {list(_CUDA_FIELDS)}")
    fields = []
    for k in _CUDA_FIELDS:
        v = cuda[k]
        if k in _BYTES_FIELDS:
            try:
                v = base64.b64decode(v, validate=True) if isinstance(v, str) else None
            except binascii.Error:
                v = None
            if v is None:
                raise ValueError(f"{where}.cuda.{k}: expected base64")
        elif k == "event_sync":
            if not isinstance(v, bool):
                raise ValueError(f"{where}.cuda.event_sync: expected true or false")
        else:
            _int(v, f"{where}.cuda.{k}")
        fields.append(v)
    device, handle, _, _, counter, counter_offset, event, _ = fields
    if not _cuda_handle_ok(handle):
        raise ValueError(
            f"{where}.cuda.handle: neither a {_CUDA_IPC_HANDLE_SIZE}-byte CUDA IPC handle nor torch's framed one "
            f"(a version byte, then c and {_CUDA_IPC_HANDLE_SIZE} bytes, or e and at most {_MAX_CUDA_HANDLE} bytes)"
        )
    if len(event) != _CUDA_IPC_HANDLE_SIZE:
        raise ValueError(f"{where}.cuda.event: a CUDA IPC event handle is {_CUDA_IPC_HANDLE_SIZE} bytes")
    if not _REF_COUNTER.fullmatch(counter):
        raise ValueError(f"{where}.cuda.ref_counter: not a torch reference-counter name")
    if counter_offset >= _CUDA_REF_COUNTER_SLOTS:
        raise ValueError(f"{where}.cuda.ref_counter_offset: at most {_CUDA_REF_COUNTER_SLOTS - 1}")
    if device >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        raise ValueError(f"{where}.cuda.device: no CUDA device {device} here")
    return TensorRef(**ref, cuda=tuple(fields))


def _cuda_handle_ok(handle: bytes) -> bool:
    if len(handle) == _CUDA_IPC_HANDLE_SIZE:  # torch before 2.3: the raw handle
        return True
    version, kind = handle[:1], handle[1:2]
    if version != _HANDLE_VERSION:
        return False
    if kind == b"c":
        return len(handle) == 2 + _CUDA_IPC_HANDLE_SIZE
    return kind == b"e" and 2 + _CUDA_IPC_HANDLE_SIZE <= len(handle) <= _MAX_CUDA_HANDLE


def describe(payload: str | bytes) -> list[TensorRef]:
    """The entries of a ``rollmesh`` payload, every field checked; nothing is mapped yet."""
    try:
        doc = json.loads(base64.b64decode(payload, validate=True))
    except (ValueError, binascii.Error) as e:
        raise ValueError(f"not a tensor-handle payload: {e}"[:300]) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), list):
        raise ValueError(f"not a tensor-handle payload: expected {{format: {FORMAT!r}, tensors: [...]}}")
    refs = [_entry(i, e) for i, e in enumerate(doc["tensors"])]
    names = [r.name for r in refs]
    if len(set(names)) != len(names):
        raise ValueError("tensors: a name is given twice")
    return refs


def _open_shm(ref: TensorRef) -> torch.Tensor:
    """The tensor ``ref`` names in its segment, mapped copy-on-write (the sender's bytes never change)."""
    segment, offset = ref.shm
    need = ref.nbytes_spanned()
    try:  # the segment itself, not where a link of that name might point
        fd = os.open(f"/dev/shm/{segment}", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"tensor {ref.name!r}: shared memory {segment}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError(f"tensor {ref.name!r}: {segment} is not a segment of this user's")
        size = st.st_size
        if offset + need > size:
            raise ValueError(
                f"tensor {ref.name!r}: bytes {offset}..{offset}+{need} lie outside {segment} ({size} bytes)"
            )
        if need == 0:
            return torch.empty(ref.shape, dtype=ref.dtype)
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=need, offset=offset).view(ref.dtype)
    return flat.as_strided(ref.shape, ref.stride, ref.storage_offset)


def _open_cuda(ref: TensorRef) -> torch.Tensor:
    """The sender's CUDA memory ``ref`` names, mapped (torch's own IPC; the same calls its pickled
    reduction makes, here with fields that were checked first)."""
    storage = torch.UntypedStorage._new_shared_cuda(*ref.cuda)
    if ref.nbytes_spanned() > storage.nbytes():
        raise ValueError(f"tensor {ref.name!r}: its elements reach past its storage ({storage.nbytes()} bytes)")
    out = torch.empty(0, dtype=ref.dtype, device=storage.device)
    return out.set_(storage, ref.storage_offset, ref.shape, ref.stride)


def loads(
    payload: str | bytes, check: Callable[[dict[str, torch.Tensor]], None] | None = None
) -> dict[str, torch.Tensor]:
    """The (name, tensor) pairs of one ``rollmesh`` payload; ``ValueError`` for anything else.
    ``check`` sees them first as tensors on the meta device (names, dtypes, shapes: the receiver's
    parameters), before any memory is mapped."""
    refs = describe(payload)
    try:
        if check is not None:
            check({r.name: torch.empty(r.shape, dtype=r.dtype, device="meta") for r in refs})
        return {r.name: _open_cuda(r) if r.cuda else _open_shm(r) for r in refs}
    except RuntimeError as e:  # a shape torch refuses; CUDA: a handle that maps nothing here
        raise ValueError(f"tensor handle: {e}"[:300]) from None
