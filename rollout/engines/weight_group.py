"""A weight-update process group: the trainer (rank 0) broadcasts tensors to every engine.

This is SGLang's collective contract (``/init_weights_update_group``, then
``/update_weights_from_distributed`` with the names, dtypes and shapes of the tensors that rank 0
then broadcasts one by one, in that order). The group stands apart from any default process group:
an engine has none, and a trainer under torchrun already has its own for FSDP. Rank 0 hosts the
rendezvous store at ``master_address:master_port``; the engines connect to it.

Both sides live here, as plain functions over torch, so the trainer's publisher and the embedded
engine cannot disagree on the order or on the checksum.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group name


@dataclass
class WeightGroup:
    """One side's membership: the process group and, on rank 0, the store it hosts."""

    name: str
    backend: str
    rank: int
    world_size: int
    pg: object
    store: object

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Drop the group's connections: a peer blocked in a broadcast then fails at once, not at
        its timeout."""
        for stop in ("abort", "shutdown"):
            try:
                getattr(self.pg, stop)()
                break
            except (AttributeError, RuntimeError):
                continue


def _group(name: str, backend: str, store, rank: int, world_size: int, timeout_s: float) -> WeightGroup:
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend: 'nccl' needs a CUDA device, and this process has none (use 'gloo')")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank_offset: rank {rank} is outside a group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"{name}/", store)  # a re-made group never meets the old one's keys
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return WeightGroup(name, backend, rank, world_size, pg, store)


def join(
    name: str, backend: str, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> WeightGroup:
    """An engine joins the group hosted at ``master_address:master_port``; returns once every rank
    has joined, raises after ``timeout_s``."""
    if rank == 0:
        raise ValueError("rank_offset: rank 0 is the trainer's; an engine's rank starts at 1")
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return _group(name, backend, store, rank, world_size, timeout_s)


def host_store(master_address: str, master_port: int, world_size: int, timeout_s: float):
    """Rank 0's rendezvous store, opened before the engines are told where it is (port 0 picks a
    free one: read ``.port``)."""
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_hosted(name: str, backend: str, store, world_size: int, timeout_s: float) -> WeightGroup:
    """Rank 0 joins over the store it hosts (``host_store``); blocks until every engine has joined."""
    return _group(name, backend, store, 0, world_size, timeout_s)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtypes: {name!r} is not a floating point torch dtype")
    return dtype


def _broadcast(group: WeightGroup, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.pg.broadcast([t], opts).wait()


def send(group: WeightGroup, tensors: dict[str, torch.Tensor]) -> None:
    """Rank 0: broadcast every tensor, in the dict's order (the order of the names sent)."""
    for t in tensors.values():
        _broadcast(group, t.detach().to(group.device).contiguous())


def receive(group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict:
    """An engine: receive the tensors rank 0 broadcasts, in order; returns them on CPU by name."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes, shapes: {len(names)}, {len(dtypes)} and {len(shapes)} entries; "
            "each tensor needs one of each"
        )
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=group.device)
        _broadcast(group, t)
        out[name] = t
    return out


def bucket_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of one bucket, in order: what rank 0 sent
    and what an engine received must agree byte for byte."""
    h = hashlib.sha256()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim: a scale
    return h.hexdigest()[:16]
