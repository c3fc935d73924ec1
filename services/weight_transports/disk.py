"""``disk`` (the default): every rank joins the export, rank 0 writes a Hugging Face directory
under ``RUN_DIR/weights/v<version>``, and the LLMProxy has every engine load it
(``/update_weights_from_disk``). The directory is also the restore point the controller rolls
back to, what an engine that rejoins is brought up to, and what every other transport writes
first (before generation is suspended).

With ``adapter: true`` a LoRA policy's adapter alone is written (PEFT's directory, bytes in
proportion to the rank), and the engines serve it by name beside their unchanged base weights
(``rollout/proxy/lanes.py``): how a run that shares another's engines publishes.

Engine side (``add_engine_routes``): the embedded engine's ``/update_weights_from_disk``, which loads
only below the model's directory and ``engine.load_roots``; SGLang's and vLLM's own routes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import ClassVar, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from services.weight_transports.common import EngineSide, engine_failures
from trainer.ports import PublishError


class DiskPublisher:
    def __init__(
        self, proxy: ProxyClient | None, run_dir: str | Path, keep_versions: int = 2, adapter: bool = False
    ) -> None:
        self.proxy, self.weights_dir, self.keep = proxy, Path(run_dir) / "weights", keep_versions
        self.adapter = adapter
        self.path = ""  # the exported version's directory (rank 0)
        self.stats: dict[str, float] = {}

    def export(self, engine, version: int, state: dict | None = None) -> str:
        out_dir = self.weights_dir / f"v{version}"
        # every rank gathers, rank 0 writes
        out = engine.export_adapter(out_dir) if self.adapter else engine.export(out_dir, state)
        self.path = "" if out is None else str(out)
        if out is not None:
            self.stats = {"weight_update_bytes": sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())}
        return self.path

    async def load(self, version: int, timeout_s: float) -> None:
        try:
            res = await self.proxy.update_weights(self.path, version, timeout_s=timeout_s, adapter=self.adapter)
        except grpc.aio.AioRpcError as e:
            raise PublishError(f"LLMProxy: {project_error(e)}") from None
        if not res.success:
            raise PublishError(engine_failures(res))

    def committed(self, version: int) -> None:
        dirs = sorted(self.weights_dir.glob("v*"), key=lambda p: int(p.name[1:].split(".")[0]))
        for old in dirs[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


class DiskPublisherConfig(BaseModel):
    """``disk``: every engine loads the exported directory."""

    model_config = ConfigDict(extra="forbid")
    sends_tensors: ClassVar[bool] = False  # more than a directory: the trainer must hold real weights
    colocates: ClassVar[bool] = True  # works with the trainer and an engine on one GPU
    type: Literal["disk"] = Field("disk", description="Every engine loads the exported directory.")
    adapter: bool = Field(
        False,
        description="A LoRA policy (trainer.lora): write its adapter alone (PEFT's directory, bytes in proportion "
        "to the rank), which the engines serve by name beside their unchanged base weights. A run that shares "
        "another's engines (proxy.runs) publishes this way.",
    )

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int) -> DiskPublisher:
        return DiskPublisher(proxy, run_dir, keep_versions, self.adapter)


class UpdateFromDiskReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    weight_version: str | int | None = None
    abort_all_requests: bool = False


def loadable(path: str, roots: list[str]) -> Path:
    """``path`` resolved, if it lies in one of ``roots`` (symbolic links followed first); else the
    refusal naming the field. A caller's path is never handed to ``from_pretrained`` as it came: a
    name that is not a local directory would be fetched from a hub, any other directory loaded."""
    from rollout.engines.contract import EngineError

    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(Path(r).resolve()) for r in roots):
        raise EngineError(
            "model_path", f"{path} is outside the directories this engine loads from ({', '.join(roots)})"
        )
    if not resolved.is_dir():
        raise EngineError("model_path", f"{path} is not a directory")
    return resolved


def add_engine_routes(app, side: EngineSide) -> None:
    import asyncio
    import time

    from rollout.engines.contract import EngineError

    engine = side.engine

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateFromDiskReq):
        version = side.parse_version(req.weight_version)
        if req.abort_all_requests:
            await asyncio.wrap_future(engine.abort(abort_all=True))
        t0 = time.perf_counter()
        try:
            path = str(loadable(req.model_path, side.load_roots))
            fut = await asyncio.to_thread(engine.load_weights_from_disk, path, version)
        except EngineError:
            raise
        except Exception as e:  # transformers and safetensors raise several types for what they cannot load
            raise EngineError("model_path", f"cannot load {req.model_path}: {e}") from None
        res = await asyncio.wrap_future(fut)
        return {"success": True, "message": f"loaded in {time.perf_counter() - t0:.3f}s", **res}
