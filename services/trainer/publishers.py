"""Weight transports: implementations of the training loop's ``WeightPublisher`` port.

``disk`` (the default): every rank joins the export, rank 0 writes a Hugging Face directory
under ``RUN_DIR/weights/v<version>``, and the LLMProxy has every engine load it
(``/update_weights_from_disk``). The directory is also the restore point the controller rolls
back to and what an engine that rejoins is brought up to.

``http_buckets``: the directory is still written (before generation is suspended) as the restore
point, but the engines get the weights from memory: safetensors buckets of at most ``bucket_mb``,
sent one at a time through the LLMProxy, which forwards each to every engine as it arrives
(``/update_weights_from_safetensors``). While generation is suspended no engine reads a file,
which matters where the run directory is a slow shared filesystem.

``collective`` (``collective_publisher.py``): the same restore directory, and the weights
broadcast over a process group the engines join (SGLang's collective contract; NCCL or gloo).

``ipc``: the same restore directory, and buckets of handles to the trainer's memory (CUDA IPC, or
shared memory on CPU) that engines on the same machine load from (``/update_weights_from_tensor``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from sample_buffer.registry import tagged_union
from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import MAX_WEIGHT_BUCKET_MB
from trainer.ports import PublishError


def engine_failures(res) -> str:
    return "; ".join(f"{e.engine or 'proxy'}: {e.message}" for e in res.engines if not e.success)


class DiskPublisher:
    def __init__(self, proxy: ProxyClient | None, run_dir: str | Path, keep_versions: int = 2) -> None:
        self.proxy, self.weights_dir, self.keep = proxy, Path(run_dir) / "weights", keep_versions
        self.path = ""  # the exported version's directory (rank 0)

    def export(self, engine, version: int, state: dict | None = None) -> str:
        out = engine.export(self.weights_dir / f"v{version}", state)  # every rank gathers, rank 0 writes
        self.path = "" if out is None else str(out)
        return self.path

    async def load(self, version: int, timeout_s: float) -> None:
        try:
            res = await self.proxy.update_weights(self.path, version, timeout_s=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PublishError(f"LLMProxy: {project_error(e)}") from None
        if not res.success:
            raise PublishError(engine_failures(res))

    def committed(self, version: int) -> None:
        dirs = sorted(self.weights_dir.glob("v*"), key=lambda p: int(p.name[1:].split(".")[0]))
        for old in dirs[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


class BucketPublisher:
    format = "safetensors"  # what each bucket's bytes hold (WeightBucket.format)

    def __init__(self, proxy: ProxyClient | None, run_dir: str | Path, keep_versions: int = 2,
                 bucket_mb: int = 256) -> None:  # fmt: skip
        self.proxy, self.max_bytes = proxy, bucket_mb << 20
        self.restore = DiskPublisher(proxy, run_dir, keep_versions)
        self._buckets: list[bytes] = []

    def export(self, engine, version: int) -> str:
        from trainer.export import weight_buckets

        state = self._gather(engine)  # every rank gathers; rank 0 gets the weights
        path = self.restore.export(engine, version, state)
        # Serialized now, before generation is suspended: the suspension only waits for the transfer.
        self._buckets = [self._serialize(b) for b in weight_buckets(state, self.max_bytes)] if path else []
        return path

    def _gather(self, engine) -> dict:
        return engine.full_weights()

    def _serialize(self, bucket: dict) -> bytes:
        from safetensors.torch import save

        return save(bucket)

    async def load(self, version: int, timeout_s: float) -> None:
        buckets, self._buckets = self._buckets, []
        if not buckets:
            raise PublishError(f"no weights exported for version {version}")
        deadline = time.monotonic() + timeout_s
        for i, data in enumerate(buckets):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PublishError(f"bucket {i} of {len(buckets)}: the {timeout_s:g} s deadline passed")
            final = i == len(buckets) - 1
            try:
                res = await self.proxy.update_weights_bucket(version, i, data, final, self.restore.path, left,
                                                             self.format)  # fmt: skip
            except grpc.aio.AioRpcError as e:
                raise PublishError(f"LLMProxy, bucket {i} of {len(buckets)}: {project_error(e)}") from None
            if not res.success:
                raise PublishError(f"bucket {i} of {len(buckets)}: {engine_failures(res)}")

    def committed(self, version: int) -> None:
        self.restore.committed(version)


class IpcPublisher(BucketPublisher):
    """``ipc``: buckets of handles, SGLang's ``/update_weights_from_tensor``: on a GPU CUDA IPC handles
    to the trainer's own memory (an engine on the same machine copies the weights straight from the
    trainer's GPU); on CPU references into shared-memory segments the weights were copied into. No
    byte of them crosses a socket."""

    format = "tensor_handles"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
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

        handles = dumps(list(bucket.items()))
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


class DiskPublisherConfig(BaseModel):
    """``disk``: every engine loads the exported directory."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["disk"] = Field("disk", description="Every engine loads the exported directory.")

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int) -> DiskPublisher:
        return DiskPublisher(proxy, run_dir, keep_versions)


class BucketPublisherConfig(BaseModel):
    """``http_buckets``: the weights travel in memory through the LLMProxy."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["http_buckets"] = Field(
        "http_buckets", description="Weights travel in memory; the directory is only the restore point."
    )
    bucket_mb: int = Field(
        256, ge=1, le=MAX_WEIGHT_BUCKET_MB,
        description="Largest bucket in MiB (a bigger tensor travels alone); the proxy holds one at a time.",
    )  # fmt: skip

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int) -> BucketPublisher:
        return BucketPublisher(proxy, run_dir, keep_versions, self.bucket_mb)


class CollectivePublisherConfig(BaseModel):
    """``collective``: the trainer broadcasts the weights over a group the engines join (SGLang's
    ``/init_weights_update_group`` contract): NCCL between GPUs, gloo on CPU."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["collective"] = Field(
        "collective", description="Weights are broadcast from the trainer; the directory is only the restore point."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="The group's backend; auto: nccl where the trainer has a GPU, else gloo."
    )
    bucket_mb: int = Field(256, ge=1, description="Tensors broadcast per LLMProxy call, in MiB (a bigger one alone).")
    master_address: str = Field(
        "127.0.0.1", min_length=1, description="The trainer's address as the engines reach it; it hosts the "
        "group's store there. Set it to the trainer's pod or host address when engines run elsewhere: the store "
        "takes no token, so keep that network private.",
    )  # fmt: skip
    master_port: int = Field(0, ge=0, le=65535, description="The store's port; 0 picks a free one per group.")
    group_name: str = Field("weight_update_group", min_length=1, description="The group's name on the engines.")

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int):
        import torch

        from services.trainer.collective_publisher import CollectivePublisher

        backend = self.backend if self.backend != "auto" else "nccl" if torch.cuda.is_available() else "gloo"
        return CollectivePublisher(proxy, run_dir, keep_versions, self.bucket_mb, backend, self.master_address,
                                   self.master_port, self.group_name)  # fmt: skip


class IpcPublisherConfig(BaseModel):
    """``ipc``: weights handed over by memory handle to engines on the trainer's machine (CUDA IPC
    on a GPU: colocated engines; shared memory on CPU)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ipc"] = Field("ipc", description="Engines on this machine map the trainer's weights directly.")
    bucket_mb: int = Field(1024, ge=1, description="Weights handed over per LLMProxy call, in MiB.")

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int) -> IpcPublisher:
        return IpcPublisher(proxy, run_dir, keep_versions, self.bucket_mb)


PublisherConfig = tagged_union(DiskPublisherConfig, BucketPublisherConfig, CollectivePublisherConfig,
                               IpcPublisherConfig, default="disk")  # fmt: skip
