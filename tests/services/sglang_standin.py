"""A stand-in for a stock SGLang server (no GPU here): the embedded engine generates, the answers
are shaped exactly as SGLang's ``http_server.py`` writes them.

Where SGLang differs from rollmesh's engine server, this follows SGLang: ``/health`` and
``/abort_request`` answer 200 with an empty body; ``/update_weights_from_disk`` answers
``{success, message, num_paused_requests}`` (400 on failure) and keeps the version in its server
args; the model info lives at ``/get_model_info`` only; ``meta_info`` has no rollmesh extensions
and ``weight_version`` is a string ("default" until an update names one).
"""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams
from services.processes import free_port


def create_standin(engine: EmbeddedEngine, weight_version: str = "default") -> FastAPI:
    app = FastAPI()
    state = {"weight_version": weight_version}
    calls: list[str] = []
    app.state.calls = calls

    @app.middleware("http")
    async def record(request: Request, call_next):
        calls.append(request.url.path)
        return await call_next(request)

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state["weight_version"],
        }

    @app.post("/generate")
    async def generate(req: dict):
        params = SamplingParams(**(req.get("sampling_params") or {}))
        out = await asyncio.wrap_future(engine.submit(req.get("rid") or f"r{time.time()}", req["input_ids"], params))
        meta = {
            "id": out.rid,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.output_ids),
            "cached_tokens": 0,
            "weight_version": state["weight_version"],
            "e2e_latency": out.e2e_latency_s,
        }
        if req.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.behavior_logprobs, out.output_ids)]
        return {"text": "", "output_ids": out.output_ids, "meta_info": meta}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():  # plain text, as SGLang's
        return Response("Cache flushed.\nPlease check backend logs for more details.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(req: dict):
        engine.abort(req.get("rid") or None, bool(req.get("abort_all")))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation():
        await asyncio.wrap_future(engine.pause("in_place"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        await asyncio.wrap_future(engine.resume())
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: dict):
        try:
            fut = await asyncio.to_thread(engine.load_weights_from_disk, req["model_path"], None)
            await asyncio.wrap_future(fut)
        except Exception as e:
            return JSONResponse(
                {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0},
                status_code=400,
            )
        message = "Succeeded to update model weights."
        if req.get("weight_version") is not None:
            state["weight_version"] = req["weight_version"]
            message += f" Weight version updated to {req['weight_version']}."
        return {"success": True, "message": message, "num_paused_requests": 0}

    return app


class StandIn:
    """The stand-in on a loopback port, in a thread; ``url``, ``calls`` (paths requested)."""

    def __init__(self, model_path: str) -> None:
        self.engine = EmbeddedEngine(EngineConfig(model_path=model_path, max_running_requests=8)).start()
        self.app = create_standin(self.engine)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def calls(self) -> list[str]:
        return self.app.state.calls

    def __enter__(self) -> StandIn:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the SGLang stand-in did not start in 30 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()
