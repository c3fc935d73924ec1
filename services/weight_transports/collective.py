"""The ``collective`` weight transport: the trainer broadcasts the weights over a process group
the engines joined (NCCL between GPUs, gloo on CPU), following SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed`` contract through the LLMProxy.

The directory is still written before generation is suspended (the restore point and what an
engine that rejoins loads). While suspended, each bucket goes out as one LLMProxy call (the
engines start receiving) during which rank 0 broadcasts the bucket's tensors; every engine reports
the checksum of what it received, which must equal the trainer's. The group is made on the first
update and kept; any failure closes it (an engine blocked in a broadcast then fails at once) and
the next update makes a new one over the engines then in rotation.

Engine side: ``rollout/engines/weight_group.py`` (joining the group, receiving, checksums) and, in
``add_engine_routes``, the embedded engine's routes with SGLang's fields: ``/init_weights_update_group``
joins the trainer's group (the trainer is rank 0 and hosts it), ``/update_weights_from_distributed``
receives what rank 0 broadcasts, ``/destroy_weights_update_group`` leaves. ``weight_version`` comes
only on an update's last bucket: the engine stages the earlier ones and applies every bucket at once
there (SGLang loads each as it arrives; generation is suspended either way). The answer adds
``received_checksum`` (a rollmesh extension), which the LLMProxy compares with the trainer's. A
bucket that cannot be received, or names a tensor the model has no slot for, closes the group (the
trainer's broadcast then fails at once instead of at its timeout). vLLM's side is in
``services/engine/vllm_plugin``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from sample_buffer.deadlines import wait_for
from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from services.weight_transports.common import AdapterFields, EngineSide, engine_failures, failed, held_checksum
from services.weight_transports.disk import DiskPublisher
from trainer.ports import PublishError

if TYPE_CHECKING:
    from rollout.engines.weight_group import WeightGroup

log = logging.getLogger(__name__)


def _wg():
    """rollout/engines/weight_group.py, imported when a group is used: it imports torch, and the
    run config (which reads this module's config) must load without it."""
    from rollout.engines import weight_group

    return weight_group


class CollectivePublisher:
    def __init__(
        self,
        proxy: ProxyClient | None,
        run_dir: str | Path,
        keep_versions: int = 2,
        bucket_mb: int = 256,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "weight_update_group",
        adapter_dtype: str | None = None,
    ) -> None:
        self.proxy, self.max_bytes = proxy, bucket_mb << 20
        self.backend, self.address, self.port, self.group_name = backend, master_address, master_port, group_name
        self.restore = DiskPublisher(proxy, run_dir, keep_versions)
        self.group: WeightGroup | None = None
        self._buckets: list[tuple[dict, str]] = []  # (tensors, checksum) of the exported version
        self.groups_made = 0
        # Adapter-only updates of a LoRA policy (``adapter_dtype``: the engines' dtype, the result's
        # checksum's): the factors are broadcast, the engines merge them (as ``http_buckets``').
        self.adapter_dtype = adapter_dtype
        self._result: str = ""  # an adapter update's: the checksum of the weights it makes
        self._state: dict = {}  # ... and the weights, broadcast whole only if it fails
        self.delta_fallbacks = 0
        self.stats: dict[str, float] = {}  # what the last load sent (the step's metrics)

    def export(self, engine, version: int) -> str:
        from trainer.export import weight_buckets

        state = engine.full_weights()  # every rank gathers; rank 0 gets the weights
        factors = engine.adapter_factors() if self.adapter_dtype else {}  # gathered by every rank too
        path = self.restore.export(engine, version, state)
        self._buckets, self._result, self._state = [], "", {}
        if not path:
            return path
        # Checksummed now, before generation is suspended: the suspension only waits for the transfer.
        if self.adapter_dtype is not None and factors:  # (none: nothing adapted, every weight goes)
            from services.weight_transports.http_buckets import by_layer

            self._result = held_checksum(state, self.adapter_dtype)
            self._state = state
            self._buckets = [(b, _wg().bucket_checksum(b)) for b in by_layer(factors, self.max_bytes)]
            return path
        self._buckets = [(b, _wg().bucket_checksum(b)) for b in weight_buckets(state, self.max_bytes)]
        return path

    async def load(self, version: int, timeout_s: float) -> None:
        buckets, self._buckets = self._buckets, []
        result, self._result = self._result, ""
        state, self._state = self._state, {}  # held only until this update is sent
        if not buckets:
            raise PublishError(f"no weights exported for version {version}")
        deadline = time.monotonic() + timeout_s
        self.stats = {}
        if result:
            try:
                await self._broadcast(version, buckets, deadline, timeout_s, result)
                self.stats = {"weight_update_bytes": _nbytes(buckets), "weight_delta_fallbacks": self.delta_fallbacks}
                return
            except PublishError as e:  # an engine refused or missed it: broadcast every weight
                self.delta_fallbacks += 1
                log.warning("version %d: the adapter update failed (%s); broadcasting every weight", version, e)
                from trainer.export import weight_buckets

                buckets = [(b, _wg().bucket_checksum(b)) for b in weight_buckets(state, self.max_bytes)]
                if not buckets:
                    raise PublishError(f"no weights exported for version {version}") from None
        await self._broadcast(version, buckets, deadline, timeout_s)
        self.stats = {"weight_update_bytes": _nbytes(buckets)}
        if self.adapter_dtype is not None:
            self.stats["weight_delta_fallbacks"] = self.delta_fallbacks

    async def _broadcast(
        self, version: int, buckets: list, deadline: float, timeout_s: float, result: str = ""
    ) -> None:
        """Send ``buckets`` in order over the group (made first if there is none); ``result``: they
        are a LoRA policy's factors and the weights they make have that checksum."""
        try:
            if self.group is None:
                await self._make_group(deadline, timeout_s)
            for i, (tensors, checksum) in enumerate(buckets):
                final = i == len(buckets) - 1
                await self._bucket(version, i, tensors, checksum, final, deadline, len(buckets), result)
        except BaseException:
            self.close()  # peers blocked in a broadcast fail now; the next update makes a new group
            raise

    def committed(self, version: int) -> None:
        self.restore.committed(version)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    @staticmethod
    def _left(deadline: float, what: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PublishError(f"{what}: the update's deadline passed")
        return left

    async def _make_group(self, deadline: float, op_timeout_s: float) -> None:
        """``op_timeout_s``: the group's timeout, for its join and every later broadcast (the
        update's, not what is left of the first update's deadline)."""
        left = self._left(deadline, "weight-update group")
        store = await asyncio.to_thread(_wg().host_store, self.address, self.port, None, op_timeout_s)
        try:
            plan = await self.proxy.init_weights_group(self.address, store.port, self.group_name, self.backend, left)
        except grpc.aio.AioRpcError as e:
            raise PublishError(f"LLMProxy, weight-update group: {project_error(e)}") from None
        try:  # completes once every engine has joined too
            self.group = await asyncio.to_thread(
                _wg().join_hosted, self.group_name, self.backend, store, plan.world_size, op_timeout_s
            )
        except Exception as e:  # torch's DistStoreError / RuntimeError: an engine never joined
            raise PublishError(
                f"weight-update group of {plan.world_size} ranks ({', '.join(plan.engines)}): {type(e).__name__}: {e}"
            ) from None
        self.groups_made += 1

    async def _bucket(
        self, version: int, i: int, tensors: dict, checksum: str, final: bool, deadline: float, n: int, result: str
    ) -> None:
        left = self._left(deadline, f"bucket {i} of {n}")
        metas = [(name, _wg().dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()]
        adapter = {"adapter": True, "result_checksum": result if final else ""} if result else {}
        call = asyncio.ensure_future(
            self.proxy.update_weights_distributed(
                version, i, metas, final, self.restore.path if final else "", checksum, left, **adapter
            )
        )
        send = asyncio.ensure_future(asyncio.to_thread(_wg().send, self.group, tensors))
        try:
            await self._both(call, send, i, n, left, deadline)
        finally:  # nothing of this bucket outlives it (a blocked send ends when load closes the group)
            call.cancel()
            send.cancel()

    async def _both(self, call, send, i: int, n: int, left: float, deadline: float) -> None:
        # The first to fail ends the bucket: a send that failed (an engine died) closes the group,
        # so the engines' receives, and with them the proxy's call, end at once; a call that failed
        # (an engine refused the bucket) leaves the send nobody to receive it, and closing ends it.
        done, _ = await asyncio.wait([call, send], timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if send in done and send.exception() is not None:
            self.close()
            with contextlib.suppress(BaseException):
                await wait_for(call, 10)
            raise PublishError(f"bucket {i} of {n}: broadcast failed: {send.exception()}")
        try:
            res = await wait_for(call, self._left(deadline, f"bucket {i} of {n}"))
        except grpc.aio.AioRpcError as e:
            raise PublishError(f"LLMProxy, bucket {i} of {n}: {project_error(e)}") from None
        except TimeoutError:
            raise PublishError(f"bucket {i} of {n}: the update's deadline passed") from None
        if not res.success:
            raise PublishError(f"bucket {i} of {n}: {engine_failures(res)}")
        try:  # every engine received everything: the broadcast has ended or is about to
            await wait_for(send, self._left(deadline, f"bucket {i} of {n}"))
        except (TimeoutError, RuntimeError) as e:
            raise PublishError(f"bucket {i} of {n}: broadcast failed: {e}") from None


def _nbytes(buckets: list[tuple[dict, str]]) -> int:
    return sum(t.numel() * t.element_size() for tensors, _ in buckets for t in tensors.values())


class CollectivePublisherConfig(BaseModel):
    """``collective``: the trainer broadcasts the weights over a group the engines join (SGLang's
    ``/init_weights_update_group`` contract): NCCL between GPUs, gloo on CPU."""

    model_config = ConfigDict(extra="forbid")
    sends_tensors: ClassVar[bool] = True  # more than a directory: the trainer must hold real weights
    colocates: ClassVar[bool] = False  # works with the trainer and an engine on one GPU
    type: Literal["collective"] = Field(
        "collective", description="Weights are broadcast from the trainer; the directory is only the restore point."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="The group's backend; auto: nccl where the trainer has a GPU, else gloo."
    )
    bucket_mb: int = Field(256, ge=1, description="Tensors broadcast per LLMProxy call, in MiB (a bigger one alone).")
    master_address: str = Field(
        "127.0.0.1",
        min_length=1,
        description="The trainer's address as the engines reach it; it hosts the "
        "group's store there. Set it to the trainer's pod or host address when engines run elsewhere: the store "
        "takes no token, so keep that network private.",
    )
    master_port: int = Field(0, ge=0, le=65535, description="The store's port; 0 picks a free one per group.")
    group_name: str = Field("weight_update_group", min_length=1, description="The group's name on the engines.")
    adapter: bool = Field(
        False,
        description="A LoRA policy (trainer.lora): broadcast only each adapted layer's factors; the engines "
        "compute the layer's weight from their base as the trainer merges it, checked against the whole state's "
        "checksum; any failure broadcasts every weight. Embedded engines only.",
    )
    # The engines' dtype, the checksum's: engine.dtype's, set when the run config loads.
    _engine_dtype: str = PrivateAttr("float32")

    def build(self, proxy: ProxyClient | None, run_dir: str, keep_versions: int):
        import torch

        backend = self.backend if self.backend != "auto" else "nccl" if torch.cuda.is_available() else "gloo"
        return CollectivePublisher(
            proxy,
            run_dir,
            keep_versions,
            self.bucket_mb,
            backend,
            self.master_address,
            self.master_port,
            self.group_name,
            self._engine_dtype if self.adapter else None,
        )


# How long joining a group, and one broadcast within it, may wait for the other ranks.
GROUP_TIMEOUT_S = 120.0


def _default_group() -> str:
    return _wg().DEFAULT_GROUP


class InitGroupReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str = Field(min_length=1, description="Where rank 0 (the trainer) hosts the group.")
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="This engine's rank (rank 0 is the trainer's).")
    world_size: int = Field(ge=2, description="The trainer's rank plus every engine's.")
    group_name: str = Field(default_factory=_default_group, min_length=1)
    backend: str = Field("nccl", description="gloo (CPU) or nccl (CUDA); SGLang's default is nccl.")


class DistributedUpdateReq(AdapterFields):
    model_config = ConfigDict(extra="forbid")
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(default_factory=_default_group)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = Field(None, description="Given on an update's last bucket: apply them all.")
    load_format: str | None = None


class DestroyGroupReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = Field(default_factory=_default_group)


def add_engine_routes(app, side: EngineSide) -> None:
    import itertools

    import torch

    from rollout.engines.contract import EngineError

    wg, engine = _wg(), side.engine
    groups: dict[str, tuple[WeightGroup, int]] = {}  # name -> (group, the join's number: its staging key)
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
            return failed(f"cannot join group {req.group_name!r} at {req.master_address}:{req.master_port}: {e}")
        groups[req.group_name] = (group, next(joins))
        return {"success": True, "message": f"rank {req.rank_offset} of {req.world_size} in {req.group_name!r}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: DistributedUpdateReq):
        version = side.parse_version(req.weight_version)
        if req.group_name not in groups:
            raise EngineError("group_name", f"no group {req.group_name!r}: call /init_weights_update_group first")
        group, join = groups[req.group_name]
        try:  # checked before receiving: a refusal closes the group, so the trainer stops at once
            req.check_adapter(engine, version)
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
            (engine.check_adapter if req.adapter else engine.check_tensors)(meta)
        except EngineError:
            leave(req.group_name)
            raise
        key = ("group", req.group_name, join)
        stage = engine.stage_adapter if req.adapter else engine.stage_tensors
        try:
            tensors = await asyncio.to_thread(wg.receive, group, req.names, req.dtypes, req.shapes)
            checksum = await asyncio.to_thread(wg.bucket_checksum, tensors)
            staged = await asyncio.to_thread(stage, tensors, key)
        except Exception as e:  # a rank that died or timed out: this group is over
            leave(req.group_name)
            return failed(f"receiving {len(req.names)} tensors from group {req.group_name!r} failed: {e}")
        if version is None:
            return {"success": True, "message": f"staged {staged} tensors", "received_checksum": checksum}
        if req.adapter:
            res = await asyncio.wrap_future(engine.commit_adapter(version, req.checksum, key))
            return {"success": True, "message": "updated from adapters", **res, "received_checksum": checksum}
        res = await asyncio.wrap_future(engine.commit_staged(version, key))
        return {"success": True, "message": "updated", **res, "received_checksum": checksum}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyGroupReq):
        if req.group_name not in groups:
            raise EngineError("group_name", f"no group {req.group_name!r}")
        leave(req.group_name)
        return {"success": True, "message": f"left {req.group_name!r}"}
