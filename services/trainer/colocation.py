"""The training loop's ``EngineMemory`` port over the LLMProxy, for ``devices.placement: colocated``:
the engines give the GPUs back while a step trains (``ReleaseMemory``, which suspends generation
first) and take them again before the new weights load (``ResumeMemory``)."""

from __future__ import annotations

import grpc

from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from services.weight_transports.common import engine_failures


class ProxyMemory:
    def __init__(self, proxy: ProxyClient, lease_s: float, timeout_s: float = 60.0) -> None:
        self.proxy, self.lease_s, self.timeout_s = proxy, lease_s, timeout_s

    async def release(self) -> None:
        await self._call("release", self.proxy.release_memory(self.lease_s, timeout_s=self.timeout_s))

    async def restore(self) -> None:
        await self._call("restore", self.proxy.resume_memory(timeout_s=self.timeout_s))

    @staticmethod
    async def _call(what: str, call) -> None:
        try:
            res = await call
        except grpc.aio.AioRpcError as e:
            raise RuntimeError(f"LLMProxy, {what}: {project_error(e)}") from None
        if not res.success:
            raise RuntimeError(f"{what}: {engine_failures(res)}")
