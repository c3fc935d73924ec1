"""The embedded engine's LoRA adapter routes, SGLang's: ``/load_lora_adapter`` (a PEFT directory
below the directories this engine loads from, as ``/update_weights_from_disk``) and
``/unload_lora_adapter``; a ``/generate`` request names its adapter in ``lora_path``."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from services.weight_transports.common import INT64_MAX, INT64_MIN, EngineSide


class LoadLoraReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=256, description="The name requests use (lora_path).")
    lora_path: str = Field(..., min_length=1, max_length=4096, description="A PEFT adapter directory.")
    pinned: bool = Field(False, description="SGLang's: keep it in GPU memory (every adapter stays here).")
    weight_version: int | None = Field(
        None, ge=INT64_MIN, le=INT64_MAX, description="rollmesh: the version its tokens report (default 0)."
    )


class UnloadLoraReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=256)


def add_lora_routes(app, side: EngineSide) -> None:
    from rollout.engines.contract import EngineError
    from services.weight_transports.disk import loadable

    engine = side.engine

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraReq):
        if not hasattr(engine, "load_lora_adapter"):
            raise EngineError("lora_name", f"{type(engine).__name__} serves no LoRA adapters")
        try:
            path = str(loadable(req.lora_path, side.load_roots))  # never a directory the caller points anywhere
        except EngineError as e:
            raise EngineError("lora_path", e.message) from None
        fut = await asyncio.to_thread(engine.load_lora_adapter, req.lora_name, path, req.weight_version)
        res = await asyncio.wrap_future(fut)
        return {"success": True, "message": f"loaded {req.lora_name}", **res}

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraReq):
        if not hasattr(engine, "unload_lora_adapter"):
            raise EngineError("lora_name", f"{type(engine).__name__} serves no LoRA adapters")
        res = await asyncio.wrap_future(engine.unload_lora_adapter(req.lora_name))
        return {"success": True, "message": f"unloaded {req.lora_name}", **res}
