"""What every LLMProxy RPC handler shares: whose lane a call acts on (told by its token, never by a
field of the request), the owner-only calls, and how the proxy's refusals become gRPC statuses."""

from __future__ import annotations

import contextlib

import grpc

from rollout.proxy import LLMProxy, NoEngineAvailable, RequestInvalid
from rollout.proxy.scoring import ScoreTimeout
from services.auth import RunTokens
from services.llm_proxy.metrics import ProxyMetrics


@contextlib.asynccontextmanager
async def refusals(ctx):
    """Bad input: INVALID_ARGUMENT naming its field; no engine left to serve: UNAVAILABLE; a score
    not in time: DEADLINE_EXCEEDED."""
    try:
        yield
    except RequestInvalid as e:
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except NoEngineAvailable as e:
        await ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except ScoreTimeout as e:
        await ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))


class ProxyCalls:
    """``runs``: the tokens of the runs that share the engines (``proxy.runs``)."""

    def __init__(self, proxy: LLMProxy, metrics: ProxyMetrics, runs: RunTokens | None = None) -> None:
        self.proxy, self.metrics, self.runs = proxy, metrics, runs

    def run_of(self, ctx) -> str:
        return self.runs.of(ctx) if self.runs is not None else ""

    async def owner_only(self, ctx, what: str) -> None:
        """Refuse a call that changes the engines themselves to a run that shares them."""
        try:
            self.proxy.owns_weights(self.run_of(ctx), what)
        except RequestInvalid as e:
            await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
