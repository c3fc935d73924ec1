"""The ``collective`` weight transport: the trainer broadcasts the weights over a process group
the engines joined (NCCL between GPUs, gloo on CPU), following SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed`` contract through the LLMProxy.

The directory is still written before generation is suspended (the restore point and what an
engine that rejoins loads). While suspended, each bucket goes out as one LLMProxy call (the
engines start receiving) during which rank 0 broadcasts the bucket's tensors; every engine reports
the checksum of what it received, which must equal the trainer's. The group is made on the first
update and kept; any failure closes it (an engine blocked in a broadcast then fails at once) and
the next update makes a new one over the engines then in rotation.

Engine side: ``rollout/engines/weight_group.py`` (joining the group, receiving, checksums) and
``services/engine/rl_routes.py``; vLLM's in ``services/engine/vllm_plugin``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from services.weight_transports.common import engine_failures
from services.weight_transports.disk import DiskPublisher
from trainer.ports import PublishError

if TYPE_CHECKING:
    from rollout.engines.weight_group import WeightGroup


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
    ) -> None:
        self.proxy, self.max_bytes = proxy, bucket_mb << 20
        self.backend, self.address, self.port, self.group_name = backend, master_address, master_port, group_name
        self.restore = DiskPublisher(proxy, run_dir, keep_versions)
        self.group: WeightGroup | None = None
        self._buckets: list[tuple[dict, str]] = []  # (tensors, checksum) of the exported version
        self.groups_made = 0

    def export(self, engine, version: int) -> str:
        from trainer.export import weight_buckets

        state = engine.full_weights()  # every rank gathers; rank 0 gets the weights
        path = self.restore.export(engine, version, state)
        # Checksummed now, before generation is suspended: the suspension only waits for the transfer.
        self._buckets = [(b, _wg().bucket_checksum(b)) for b in weight_buckets(state, self.max_bytes)] if path else []
        return path

    async def load(self, version: int, timeout_s: float) -> None:
        buckets, self._buckets = self._buckets, []
        if not buckets:
            raise PublishError(f"no weights exported for version {version}")
        deadline = time.monotonic() + timeout_s
        try:
            if self.group is None:
                await self._make_group(deadline, timeout_s)
            for i, (tensors, checksum) in enumerate(buckets):
                await self._bucket(version, i, tensors, checksum, i == len(buckets) - 1, deadline, len(buckets))
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
        self, version: int, i: int, tensors: dict, checksum: str, final: bool, deadline: float, n: int
    ) -> None:
        left = self._left(deadline, f"bucket {i} of {n}")
        metas = [(name, _wg().dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()]
        call = asyncio.ensure_future(
            self.proxy.update_weights_distributed(
                version, i, metas, final, self.restore.path if final else "", checksum, left
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
                await asyncio.wait_for(call, 10)
            raise PublishError(f"bucket {i} of {n}: broadcast failed: {send.exception()}")
        try:
            res = await asyncio.wait_for(call, self._left(deadline, f"bucket {i} of {n}"))
        except grpc.aio.AioRpcError as e:
            raise PublishError(f"LLMProxy, bucket {i} of {n}: {project_error(e)}") from None
        except TimeoutError:
            raise PublishError(f"bucket {i} of {n}: the update's deadline passed") from None
        if not res.success:
            raise PublishError(f"bucket {i} of {n}: {engine_failures(res)}")
        try:  # every engine received everything: the broadcast has ended or is about to
            await asyncio.wait_for(send, self._left(deadline, f"bucket {i} of {n}"))
        except (TimeoutError, RuntimeError) as e:
            raise PublishError(f"bucket {i} of {n}: broadcast failed: {e}") from None


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
        )
