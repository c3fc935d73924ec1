"""Async gRPC client of the LLMProxy, and the rollout loop's ``Generate`` port over it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import numpy as np

from rollout.ports import Generation, TeacherScores, TransientError
from rollout.sampling import SamplingParams
from sample_buffer.routing import RoutingError
from services.auth import AuthConfig
from services.convert import finish_from_pb, project_error, routed_experts_from_pb, sampling_to_pb
from services.grpc_util import channel
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.pb.rollmesh.v1 import llm_proxy_pb2_grpc
from services.wire_limits import PROXY_MAX_RESPONSE_BYTES, WEIGHT_CHUNK_BYTES

log = logging.getLogger(__name__)


def generate_request(
    input_ids: list[int],
    sampling: SamplingParams,
    request_id: str,
    route: str,
    timeout_s: float,
    top_logprobs: int = 0,
    return_routed_experts: bool = False,
    images: tuple[bytes, ...] = (),
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        route=route,
        input_ids=input_ids,
        sampling_params=sampling_to_pb(sampling),
        timeout_s=timeout_s,
        top_logprobs=top_logprobs,
        return_routed_experts=return_routed_experts,
        images=images,
    )


class ProxyClient:
    def __init__(self, address: str, timeout_s: float = 300.0, auth: AuthConfig | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address, [("grpc.max_receive_message_length", PROXY_MAX_RESPONSE_BYTES)], auth)
        self.stub = llm_proxy_pb2_grpc.LLMProxyStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        *,
        request_id: str = "",
        route: str = "",
        timeout_s: float = 0.0,
        return_routed_experts: bool = False,
        images: tuple[bytes, ...] = (),
        **sampling,
    ) -> pb.GenerateResponse:
        sp = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        req = generate_request(input_ids, sp, request_id, route, timeout_s, 0, return_routed_experts, images)
        return await self.stub.Generate(req, timeout=(timeout_s or self.timeout_s) + 5.0)

    async def suspend(self, mode: int = pb.SUSPEND_MODE_CONTINUE, timeout_s: float = 30.0) -> pb.SuspendResponse:
        return await self.stub.Suspend(pb.SuspendRequest(mode=mode, timeout_s=timeout_s), timeout=timeout_s + 5)

    async def resume(self, timeout_s: float = 30.0) -> pb.ResumeResponse:
        return await self.stub.Resume(pb.ResumeRequest(timeout_s=timeout_s), timeout=timeout_s + 5)

    async def abort(self, request_id: str = "", abort_all: bool = False) -> pb.AbortResponse:
        return await self.stub.Abort(pb.AbortRequest(request_id=request_id, abort_all=abort_all), timeout=30)

    async def update_weights(
        self, model_path: str, weight_version: int, timeout_s: float = 120.0, adapter: bool = False
    ) -> pb.UpdateWeightsResponse:
        """``adapter``: ``model_path`` is a LoRA adapter served to this caller's run by name."""
        req = pb.UpdateWeightsRequest(
            model_path=model_path, weight_version=weight_version, timeout_s=timeout_s, adapter=adapter
        )
        return await self.stub.UpdateWeights(req, timeout=timeout_s + 10)

    async def update_weights_bucket(
        self,
        weight_version: int,
        index: int,
        data: bytes,
        final: bool,
        restore_path: str = "",
        timeout_s: float = 120.0,
        fmt: str = "",
        base_version: int = 0,
        checksum: str = "",
    ) -> pb.UpdateWeightsResponse:
        """One bucket of an in-memory update (``fmt``: see the proxy's ``update_weights_bucket``)."""
        first = dict(
            weight_version=weight_version,
            index=index,
            final=final,
            restore_path=restore_path,
            timeout_s=timeout_s,
            base_version=base_version,
            checksum=checksum,
        )

        async def pieces():  # the first carries every field, the later ones only more bytes
            view = memoryview(data)
            yield pb.WeightBucket(**first, format=fmt, safetensors=bytes(view[:WEIGHT_CHUNK_BYTES]))
            for start in range(WEIGHT_CHUNK_BYTES, len(data), WEIGHT_CHUNK_BYTES):
                yield pb.WeightBucket(safetensors=bytes(view[start : start + WEIGHT_CHUNK_BYTES]))

        return await self.stub.UpdateWeightsBucket(pieces(), timeout=timeout_s + 10)

    async def init_weights_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, timeout_s: float = 120.0
    ) -> pb.InitWeightsGroupResponse:
        req = pb.InitWeightsGroupRequest(
            master_address=master_address,
            master_port=master_port,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )
        return await self.stub.InitWeightsGroup(req, timeout=timeout_s + 10)

    async def update_weights_distributed(
        self,
        weight_version: int,
        index: int,
        tensors: list[tuple[str, str, list[int]]],
        final: bool,
        restore_path: str = "",
        checksum: str = "",
        timeout_s: float = 120.0,
        adapter: bool = False,
        result_checksum: str = "",
    ) -> pb.UpdateWeightsResponse:
        """``tensors``: (name, dtype, shape) of each tensor, in the order they are broadcast;
        ``adapter``: a LoRA policy's factors, the final bucket's result has ``result_checksum``."""
        metas = [pb.TensorMeta(name=n, dtype=d, shape=s) for n, d, s in tensors]
        req = pb.DistributedBucket(
            weight_version=weight_version,
            index=index,
            tensors=metas,
            final=final,
            restore_path=restore_path,
            checksum=checksum,
            timeout_s=timeout_s,
            adapter=adapter,
            result_checksum=result_checksum,
        )
        return await self.stub.UpdateWeightsDistributed(req, timeout=timeout_s + 10)

    async def release_memory(
        self, lease_s: float, tags: list[str] | None = None, timeout_s: float = 60.0
    ) -> pb.MemoryResponse:
        req = pb.MemoryRequest(tags=tags or [], lease_s=lease_s, timeout_s=timeout_s)
        return await self.stub.ReleaseMemory(req, timeout=2 * timeout_s + 10)  # a suspend, then the release

    async def resume_memory(self, tags: list[str] | None = None, timeout_s: float = 60.0) -> pb.MemoryResponse:
        req = pb.MemoryRequest(tags=tags or [], timeout_s=timeout_s)
        return await self.stub.ResumeMemory(req, timeout=timeout_s + 10)

    async def stats(self) -> pb.ProxyStats:
        return await self.stub.Stats(pb.StatsRequest(), timeout=10)


class ProxyTeacher:
    """The rollout loop's ``Teacher`` port: a teacher's LLMProxy, scoring the tokens it is handed
    (``ScoreTokens``); a transient gRPC failure becomes ``TransientError``."""

    def __init__(self, client: ProxyClient) -> None:
        self.client = client

    async def score(
        self, token_ids: list[int], start: int, *, route: str, timeout_s: float, top_k: int = 0
    ) -> TeacherScores:
        req = pb.ScoreTokensRequest(input_ids=token_ids, start=start, timeout_s=timeout_s, route=route, top_k=top_k)
        try:
            res = await self.client.stub.ScoreTokens(req, timeout=timeout_s + 5.0)
        except grpc.aio.AioRpcError as e:
            raise project_error(e) from None
        n = len(res.logprobs)
        if len(res.top_ids) != n * top_k or len(res.top_logprobs) != n * top_k:
            raise ValueError(f"ScoreTokens: {len(res.top_ids)} top tokens for {n} positions of {top_k}")
        return TeacherScores(
            list(res.logprobs),
            np.asarray(res.top_ids, dtype=np.int32).reshape(n, top_k),
            np.asarray(res.top_logprobs, dtype=np.float32).reshape(n, top_k),
        )


class ProxyGenerate:
    """The rollout loop's ``Generate`` port: one LLMProxy call per generation, the response in
    the trajectory's names; a transient gRPC failure becomes ``TransientError``."""

    def __init__(self, client: ProxyClient) -> None:
        self.client = client

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        route: str,
        timeout_s: float,
        top_logprobs: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        return_routed_experts: bool = False,
        images: tuple[bytes, ...] = (),
    ) -> Generation:
        req = generate_request(
            input_ids, sampling, request_id, route, timeout_s, top_logprobs, return_routed_experts, images
        )
        try:
            if on_tokens is None:
                res = await self.client.stub.Generate(req, timeout=timeout_s + 5.0)
            else:
                res = None
                async for chunk in self.client.stub.GenerateStream(req, timeout=timeout_s + 5.0):
                    if chunk.HasField("result"):
                        res = chunk.result
                    elif chunk.output_ids:
                        on_tokens(list(chunk.output_ids))
                if res is None:
                    raise TransientError("the LLMProxy's stream ended without a result")
        except grpc.aio.AioRpcError as e:  # our own cancellation arrives as CancelledError instead
            raise project_error(e) from None
        return _generation(res, request_id)

    async def generate_group(
        self, input_ids: list[int], sampling: SamplingParams, *, request_ids: list[str], route: str, timeout_s: float
    ) -> list[Generation]:
        """``len(request_ids)`` samples of one prompt in one LLMProxy call (``GenerateGroup``)."""
        req = pb.GenerateGroupRequest(
            request=generate_request(input_ids, sampling, "", route, timeout_s), request_ids=request_ids
        )
        try:
            res = await self.client.stub.GenerateGroup(req, timeout=timeout_s + 5.0)
        except grpc.aio.AioRpcError as e:
            raise project_error(e) from None
        if len(res.samples) != len(request_ids):
            raise TransientError(f"the LLMProxy answered {len(res.samples)} samples of {len(request_ids)}")
        return [_generation(r, rid) for r, rid in zip(res.samples, request_ids, strict=True)]

    async def abort(self, request_id: str) -> None:
        try:
            await self.client.abort(request_id=request_id)
        except grpc.aio.AioRpcError as e:
            raise project_error(e) from None


def _generation(res: pb.GenerateResponse, request_id: str) -> Generation:
    """A GenerateResponse in the trajectory's names."""
    tops = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in res.top_logprobs]
    experts = None
    if res.HasField("routed_experts"):
        try:
            experts = routed_experts_from_pb(res.routed_experts)
        except RoutingError as e:  # the proxy's bug, not this episode's: its routing is dropped
            log.warning("request %s: %s", request_id, e)
    return Generation(
        list(res.output_ids),
        list(res.behavior_logprobs),
        list(res.token_versions),
        finish_from_pb(res.finish_reason),
        tops,
        experts,
    )
