"""The embedded engine's RL endpoints beyond generation, as SGLang names them.

The collective weight update: ``/init_weights_update_group`` joins the trainer's group (the
trainer is rank 0 and hosts it), ``/update_weights_from_distributed`` receives the named tensors
rank 0 then broadcasts, and ``/destroy_weights_update_group`` leaves. The fields are SGLang's. Its
requests carry ``weight_version`` only on an update's last bucket: the embedded engine stages the
earlier ones and applies every bucket at once there (SGLang loads each as it arrives; generation
is suspended either way, and a failure is rolled back from the restore directory). The answer
adds ``received_checksum`` (a rollmesh extension: the received bytes' ``bucket_checksum``), which
the LLMProxy compares with the trainer's.

A bucket that cannot be received, or that names a tensor the model has no slot for, closes the
group (the trainer's broadcast then fails at once instead of at its timeout); the next update
joins a new one.

``/update_weights_from_tensor`` is SGLang's same-machine transport: tensors passed by handle (CUDA
IPC, or shared memory on CPU; ``rollout/engines/tensor_handles.py``), with the same staging.
``/release_memory_occupation`` and ``/resume_memory_occupation`` (SGLang's too) give a colocated
trainer the GPU while it trains.
"""

from __future__ import annotations

import asyncio
import itertools

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rollout.engines import tensor_handles
from rollout.engines import weight_group as wg
from rollout.engines.contract import EngineError
from rollout.engines.embedded.engine import EmbeddedEngine

# How long joining a group, and one broadcast within it, may wait for the other ranks.
GROUP_TIMEOUT_S = 120.0


class InitGroupReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str = Field(min_length=1, description="Where rank 0 (the trainer) hosts the group.")
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="This engine's rank (rank 0 is the trainer's).")
    world_size: int = Field(ge=2, description="The trainer's rank plus every engine's.")
    group_name: str = Field(wg.DEFAULT_GROUP, min_length=1)
    backend: str = Field("nccl", description="gloo (CPU) or nccl (CUDA); SGLang's default is nccl.")


class DistributedUpdateReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = wg.DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = Field(None, description="Given on an update's last bucket: apply them all.")
    load_format: str | None = None


class TensorUpdateReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    serialized_named_tensors: list[str] = Field(min_length=1, description="One payload per tensor-parallel rank.")
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = Field(None, description="Given on an update's last bucket: apply them all.")


class MemoryReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = Field(None, description="weights and/or kv_cache; default both.")


class DestroyGroupReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = wg.DEFAULT_GROUP


def _own_copy(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {n: t.to(device, copy=True) for n, t in tensors.items()}


def _failed(message: str) -> JSONResponse:
    return JSONResponse(status_code=500, content={"success": False, "message": message})


def add_rl_routes(app: FastAPI, engine: EmbeddedEngine, parse_version) -> None:
    groups: dict[str, tuple[wg.WeightGroup, int]] = {}  # name -> (group, the join's number: its staging key)
    joins = itertools.count(1)

    def leave(name: str) -> None:
        old = groups.pop(name, None)
        if old is not None:
            old[0].close()

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitGroupReq):
        if req.backend not in wg.BACKENDS:
            raise EngineError("backend", f"must be one of {list(wg.BACKENDS)}, got {req.backend!r}")
        if req.backend == "nccl" and engine.device.type != "cuda":
            raise EngineError("backend", f"nccl needs a CUDA engine; this one runs on {engine.device} (use gloo)")
        if req.rank_offset >= req.world_size:
            raise EngineError("rank_offset", f"{req.rank_offset} is outside a group of {req.world_size}")
        leave(req.group_name)  # a new group replaces the old one of that name
        try:
            group = await asyncio.to_thread(
                wg.join,
                req.group_name,
                req.backend,
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                GROUP_TIMEOUT_S,
            )
        except Exception as e:  # torch raises DistStoreError, DistNetworkError or RuntimeError for a failed join
            return _failed(f"cannot join group {req.group_name!r} at {req.master_address}:{req.master_port}: {e}")
        groups[req.group_name] = (group, next(joins))
        return {"success": True, "message": f"rank {req.rank_offset} of {req.world_size} in {req.group_name!r}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: DistributedUpdateReq):
        version = parse_version(req.weight_version)
        if req.group_name not in groups:
            raise EngineError("group_name", f"no group {req.group_name!r}: call /init_weights_update_group first")
        group, join = groups[req.group_name]
        try:  # checked before receiving: a refusal closes the group, so the trainer stops at once
            if not len(req.names) == len(req.dtypes) == len(req.shapes):
                raise EngineError(
                    "dtypes",
                    f"names, dtypes and shapes have {len(req.names)}, {len(req.dtypes)} and "
                    f"{len(req.shapes)} entries; each tensor needs one of each",
                )
            try:
                meta = {
                    n: torch.empty(s, dtype=wg.parse_dtype(d), device="meta")
                    for n, d, s in zip(req.names, req.dtypes, req.shapes, strict=True)
                }
            except (ValueError, RuntimeError) as e:
                raise EngineError("shapes" if "dtype" not in str(e) else "dtypes", str(e)) from None
            engine.check_tensors(meta)
        except EngineError:
            leave(req.group_name)
            raise
        key = ("group", req.group_name, join)
        try:
            tensors = await asyncio.to_thread(wg.receive, group, req.names, req.dtypes, req.shapes)
            checksum = await asyncio.to_thread(wg.bucket_checksum, tensors)
            staged = await asyncio.to_thread(engine.stage_tensors, tensors, key)
        except Exception as e:  # a rank that died or timed out: this group is over
            leave(req.group_name)
            return _failed(f"receiving {len(req.names)} tensors from group {req.group_name!r} failed: {e}")
        if version is None:
            return {"success": True, "message": f"staged {staged} tensors", "received_checksum": checksum}
        res = await asyncio.wrap_future(engine.commit_staged(version, key))
        return {"success": True, "message": "updated", **res, "received_checksum": checksum}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: TensorUpdateReq):
        version = parse_version(req.weight_version)
        try:  # one rank here: the first payload is this engine's
            shared = await asyncio.to_thread(tensor_handles.loads, req.serialized_named_tensors[0])
        except ValueError as e:
            raise EngineError("serialized_named_tensors", str(e)) from None
        engine.check_tensors(shared)
        # Copied out of the sender's memory now: it may reuse that memory once this call returns.
        mine = await asyncio.to_thread(_own_copy, shared, engine.device)
        del shared
        staged = await asyncio.to_thread(engine.stage_tensors, mine, ("tensor",))
        if version is None:
            return {"success": True, "message": f"staged {staged} tensors"}
        res = await asyncio.wrap_future(engine.commit_staged(version, ("tensor",)))
        return {"success": True, "message": "updated", **res}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(req: MemoryReq | None = None):
        res = await asyncio.wrap_future(engine.release_memory(req.tags if req else None))
        return {"success": True, "message": "released", **res}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(req: MemoryReq | None = None):
        res = await asyncio.wrap_future(engine.resume_memory(req.tags if req else None))
        return {"success": True, "message": "resumed", **res}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyGroupReq):
        if req.group_name not in groups:
            raise EngineError("group_name", f"no group {req.group_name!r}")
        leave(req.group_name)
        return {"success": True, "message": f"left {req.group_name!r}"}
