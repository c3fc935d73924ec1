"""The engine's control and information routes, SGLang's: abort, pause and continue, memory
release for colocation, model and server info, health, cache flush."""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from rollout.engines.contract import EngineError
from rollout.sampling import SamplingParams
from sample_buffer.deadlines import wait_for

if TYPE_CHECKING:
    from rollout.engines.embedded.engine import EmbeddedEngine


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False


class PauseReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = "abort"


class MemoryReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = Field(None, description="weights and/or kv_cache; default both.")


def control_router(engine: EmbeddedEngine) -> APIRouter:
    router = APIRouter()
    health_checks = itertools.count()

    @router.post("/abort_request")
    async def abort_request(req: AbortReq):
        if not req.rid and not req.abort_all:
            raise EngineError("rid", "give a rid or abort_all=true")
        n = await asyncio.wrap_future(engine.abort(req.rid or None, req.abort_all))
        return {"success": True, "num_aborted": n}

    @router.post("/pause_generation")
    async def pause_generation(req: PauseReq):
        n = await asyncio.wrap_future(engine.pause(req.mode))  # type: ignore[arg-type]
        return {"success": True, "message": f"paused ({req.mode})", "num_affected": n}

    @router.post("/continue_generation")
    async def continue_generation():
        await asyncio.wrap_future(engine.resume())
        return {"success": True, "message": "continued"}

    @router.post("/release_memory_occupation")
    async def release_memory_occupation(req: MemoryReq | None = None):
        res = await asyncio.wrap_future(engine.release_memory(req.tags if req else None))
        return {"success": True, "message": "released", **res}

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation(req: MemoryReq | None = None):
        res = await asyncio.wrap_future(engine.resume_memory(req.tags if req else None))
        return {"success": True, "message": "resumed", **res}

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info():
        return engine.info()

    @router.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(engine.weight_version), "checksum": engine.checksum}

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info():
        # tp_size: the ranks this engine takes in a weight-update group (SGLang reports its own).
        return {**engine.info(), **engine.load(), "tp_size": 1, "counters": dict(engine.counters)}

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/health_generate")
    async def health_generate():
        """As SGLang's: healthy when one token can be generated, within 20 s."""
        rid = f"HEALTH_CHECK_{next(health_checks)}"
        try:
            fut = engine.submit(rid, [0], SamplingParams(max_new_tokens=1, temperature=0.0))
            await wait_for(asyncio.wrap_future(fut), 20.0)
        except (TimeoutError, EngineError):
            engine.abort(rid, False)
            return Response(status_code=503)
        return Response(status_code=200)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # No prefix cache to flush: the engine keeps no KV past a request. SGLang answers in text.
        return Response("Cache flushed.\n", status_code=200)

    return router
