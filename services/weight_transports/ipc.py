"""``ipc``: the same restore directory, and buckets of handles to the trainer's memory (CUDA IPC, or
shared memory on CPU) that engines on the same machine load from (``/update_weights_from_tensor``).

Engine side: ``rollout/engines/tensor_handles.py`` (the handles, both ends) and, in
``add_engine_routes``, the embedded engine's ``/update_weights_from_tensor`` (SGLang's), which copies
the tensors out of the sender's memory, stages them, and commits with the last bucket.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from services.llm_proxy.client import ProxyClient
from services.weight_transports.common import AdapterFields, EngineSide
from services.weight_transports.http_buckets import BucketPublisher


class IpcPublisher(BucketPublisher):
    """``ipc``: buckets of handles, SGLang's ``/update_weights_from_tensor``: on a GPU CUDA IPC handles
    to the trainer's own memory (an engine on the same machine copies the weights straight from the
    trainer's GPU); on CPU references into shared-memory segments the weights were copied into. No
    byte of them crosses a socket."""

    format = "tensor_handles"
    adapter_format = "tensor_handles_adapter"

    def __init__(self, *args, encoding: str = "rollmesh", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.encoding = encoding  # of the handles: rollmesh's own (the embedded engine) or SGLang's
        self._shared: dict | None = None  # CUDA: the memory the handles point into, alive until the update ends
        self._handles: list = []  # CPU: the shared-memory segments the weights were copied into

    def _gather(self, engine) -> dict:
        # On the GPU, where CUDA IPC hands it over. Without offload every rank gets the full
        # weights: only rank 0 keeps them. On a GPU in one process they are the parameters
        # themselves, copied per update so that the engine reads a version no optimizer step
        # touches (FSDP2's gather makes fresh tensors already); on CPU the handles copy them.
        state = engine.full_weights(on_device=True)
        if getattr(engine, "rank", 0) != 0:
            return {}
        on_gpu = any(v.is_cuda for v in state.values())
        self._shared = (
            {k: v.clone() for k, v in state.items()} if on_gpu and getattr(engine, "world", 1) == 1 else state
        )
        return self._shared

    def _serialize(self, bucket: dict) -> bytes:
        from rollout.engines.tensor_handles import dumps

        handles = dumps(list(bucket.items()), self.encoding)
        self._handles.append(handles)
        return handles.payload.encode("ascii")

    async def load(self, version: int, timeout_s: float) -> None:
        try:
            await super().load(version, timeout_s)
        finally:
            self._free()

    def _free(self) -> None:
        handles, self._handles, self._shared = self._handles, [], None
        for h in handles:
            h.close()

    def export(self, engine, version: int) -> str:
        self._free()  # an export whose update never loaded leaves nothing behind
        return super().export(engine, version)


class IpcPublisherConfig(BaseModel):
    """``ipc``: weights handed over by memory handle to engines on the trainer's machine (CUDA IPC
    on a GPU: colocated engines; shared memory on CPU)."""

    model_config = ConfigDict(extra="forbid")
    sends_tensors: ClassVar[bool] = True  # more than a directory: the trainer must hold real weights
    colocates: ClassVar[bool] = True  # works with the trainer and an engine on one GPU
    type: Literal["ipc"] = Field("ipc", description="Engines on this machine map the trainer's weights directly.")
    bucket_mb: int = Field(1024, ge=1, description="Weights handed over per LLMProxy call, in MiB.")
    encoding: Literal["rollmesh", "sglang"] = Field(
        "rollmesh",
        description="How the handles are written: rollmesh's own format, read by code (the embedded engine), "
        "or SGLang's pickled one, which SGLang reads itself; set from the engine (services/engine/backends.py).",
    )
    adapter: bool = Field(
        False,
        description="A LoRA policy (trainer.lora): hand over only each adapted layer's factors; the engines "
        "compute the layer's weight from their base as the trainer merges it, checked against the whole state's "
        "checksum; any failure hands over every weight. Embedded engines only.",
    )
    # The engines' dtype, the checksum's: engine.dtype's, set when the run config loads.
    _engine_dtype: str = PrivateAttr("float32")

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int) -> IpcPublisher:
        adapter_dtype = self._engine_dtype if self.adapter else None
        return IpcPublisher(
            proxy, run_dir, keep_versions, self.bucket_mb, adapter_dtype=adapter_dtype, encoding=self.encoding
        )


class TensorUpdateReq(AdapterFields):
    model_config = ConfigDict(extra="forbid")
    serialized_named_tensors: list[str] = Field(min_length=1, description="One payload per tensor-parallel rank.")
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = Field(None, description="Given on an update's last bucket: apply them all.")


def add_engine_routes(app, side: EngineSide) -> None:
    import asyncio

    from rollout.engines import tensor_handles
    from rollout.engines.contract import EngineError

    engine = side.engine

    def own_copy(tensors):
        return {n: t.to(engine.device, copy=True) for n, t in tensors.items()}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: TensorUpdateReq):
        version = side.parse_version(req.weight_version)
        req.check_adapter(engine, version)
        check = engine.check_adapter if req.adapter else engine.check_tensors
        try:  # one rank here: the first payload is this engine's; its shapes checked before it is mapped
            payload = req.serialized_named_tensors[0]
            shared = await asyncio.to_thread(tensor_handles.loads, payload, check)
        except EngineError:  # the model's check: its own field
            raise
        except ValueError as e:
            raise EngineError("serialized_named_tensors", str(e)) from None
        # Copied out of the sender's memory now: it may reuse that memory once this call returns.
        mine = await asyncio.to_thread(own_copy, shared)
        del shared
        stage = engine.stage_adapter if req.adapter else engine.stage_tensors
        staged = await asyncio.to_thread(stage, mine, ("tensor",))
        if version is None:
            return {"success": True, "message": f"staged {staged} tensors"}
        if req.adapter:
            res = await asyncio.wrap_future(engine.commit_adapter(version, req.checksum, ("tensor",)))
            return {"success": True, "message": "updated from adapters", **res}
        res = await asyncio.wrap_future(engine.commit_staged(version, ("tensor",)))
        return {"success": True, "message": "updated", **res}
