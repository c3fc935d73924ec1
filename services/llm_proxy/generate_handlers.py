"""The LLMProxy's generation RPCs: ``Generate``, ``GenerateGroup``, ``GenerateStream`` (chunks of new
tokens, then the result), ``ScoreTokens`` (a teacher's log-probs of given tokens) and ``Abort``, with
their messages converted to the proxy's types."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc

from rollout.proxy import ProxyRequest
from sample_buffer.deadlines import wait_for
from services.convert import finish_to_pb, routed_experts_to_pb, sampling_from_pb
from services.llm_proxy.calls import ProxyCalls, refusals
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.streams import until_done


def _request(req: pb.GenerateRequest) -> ProxyRequest:
    return ProxyRequest(
        input_ids=list(req.input_ids),
        sampling_params=sampling_from_pb(req.sampling_params),
        request_id=req.request_id,
        route=req.route,
        timeout_s=req.timeout_s,
        top_logprobs=req.top_logprobs,
        return_routed_experts=req.return_routed_experts,
        images=tuple(req.images),
    )


def _response(res) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=res.request_id,
        output_ids=res.output_ids,
        behavior_logprobs=res.behavior_logprobs,
        token_versions=res.token_versions,
        finish_reason=finish_to_pb(res.finish_reason),
        weight_version=res.weight_version,
        engine=res.engine,
        prompt_tokens=res.prompt_tokens,
        e2e_latency_s=res.e2e_latency_s,
        num_segments=res.num_segments,
        top_logprobs=[
            pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top]) for top in res.top_logprobs
        ],
        routed_experts=None if res.routed_experts is None else routed_experts_to_pb(res.routed_experts),
    )


class GenerateHandlers(ProxyCalls):
    async def generate(self, req: pb.GenerateRequest, ctx) -> pb.GenerateResponse:
        async with refusals(ctx):
            res = await self.proxy.generate(_request(req), run=self.run_of(ctx))
        self.metrics.observe(res)
        return _response(res)

    async def generate_group(self, req: pb.GenerateGroupRequest, ctx) -> pb.GenerateGroupResponse:
        async with refusals(ctx):
            results = await self.proxy.generate_group(
                _request(req.request), list(req.request_ids), run=self.run_of(ctx)
            )
        for res in results:
            self.metrics.observe(res)
        return pb.GenerateGroupResponse(samples=[_response(res) for res in results])

    async def generate_stream(self, req: pb.GenerateRequest, ctx):
        """Chunks of new tokens as the engines make them, then the result. A caller that goes away
        aborts the generation."""
        preq = _request(req)
        preq.request_id = preq.request_id or uuid.uuid4().hex  # known here: the abort below needs it
        pieces: asyncio.Queue[list[int]] = asyncio.Queue()
        task = asyncio.ensure_future(self.proxy.generate(preq, on_tokens=pieces.put_nowait, run=self.run_of(ctx)))
        try:
            async for ids in until_done(pieces, task):
                yield pb.GenerateChunk(output_ids=ids)
            async with refusals(ctx):
                res = task.result()
            self.metrics.observe(res)
            yield pb.GenerateChunk(result=_response(res))
        finally:
            if not task.done():  # the caller went away mid-stream
                await self.proxy.abort(preq.request_id, run=self.run_of(ctx))
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await wait_for(task, self.proxy.config.abort_grace_s)

    async def score_tokens(self, req: pb.ScoreTokensRequest, ctx) -> pb.ScoreTokensResponse:
        async with refusals(ctx):
            out = await self.proxy.score(list(req.input_ids), req.start, req.timeout_s, req.route, req.top_k)
        return pb.ScoreTokensResponse(
            logprobs=out.logprobs,
            weight_version=out.weight_version,
            top_ids=[t for row in out.top_logprobs for t, _ in row],
            top_logprobs=[lp for row in out.top_logprobs for _, lp in row],
        )

    async def abort(self, req: pb.AbortRequest, ctx) -> pb.AbortResponse:
        if not req.request_id and not req.abort_all:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: give one or set abort_all")
        return pb.AbortResponse(num_aborted=await self.proxy.abort(req.request_id, req.abort_all, self.run_of(ctx)))
