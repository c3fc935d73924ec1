"""gRPC RewardService: ``Score`` over one hosted reward, for every client of the mesh.

The hosted reward is what an environment would call in-process (rollout/rewards.py,
rollout/verifiers): a function runs in reward worker processes (``RewardPool``: a hang or crash
costs one score and the worker is replaced), the code reward in its sandbox, the judge through
an LLMProxy. Each score runs in a thread of a bounded pool (``max_concurrent``) so the event loop
keeps answering; its wait for a thread and its run are bounded by the caller's timeout and the
service's own. A verifier that raises or does not finish in time scores 0, with the cause in
the reply and in ``rollmesh_reward_scores_total``; so does a fault the hosted reward contained
(a worker killed, a sandbox limit hit, a judge with no verdict), by its own cause.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from rollout.reward_pool import RewardPool
from rollout.rewards import build_reward
from sample_buffer.deadlines import wait_for
from services.auth import AuthConfig
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.metrics import serve_metrics
from services.pb.rollmesh.v1 import reward_pb2 as pb
from services.reward.config import RewardServiceConfig
from services.reward.metrics import SCORE_OUTCOMES, RewardMetrics

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.RewardService"
GRACE_S = 0.5  # past a score's limit, for the hosted reward's own bounded answer to come back


class RewardService:
    """The plain object behind the servicer: a hosted reward, a thread pool and the bounds."""

    def __init__(self, config: RewardServiceConfig, reward) -> None:
        self.config, self.reward = config, reward
        self.metrics = RewardMetrics(reward)
        # The pooled rewards say why a score is 0 (a worker's timeout, a sandbox's memory limit);
        # a plain function's only faults are the ones caught here.
        self._scored = getattr(reward, "scored", None) or (lambda r, a, timeout_s=None: (reward(r, a), ""))
        self._threads = ThreadPoolExecutor(config.max_concurrent, thread_name_prefix="score")
        self.outcomes: Counter[str] = Counter()

    async def score(
        self, response: str, answer: str, timeout_s: float, request_id: str = ""
    ) -> tuple[float, str, float]:
        """(reward, failure cause or "", seconds) within ``timeout_s`` (0: the service's own)."""
        limit = min(timeout_s or self.config.timeout_s, self.config.timeout_s)
        t0 = time.monotonic()
        self.metrics.in_flight.inc()
        try:
            # The hosted reward gets the time left and bounds its own run (a thread is never killed).
            work = asyncio.get_running_loop().run_in_executor(self._threads, self._run, response, answer, t0 + limit)
            reward, failure = await wait_for(work, limit + GRACE_S)
            reward = float(reward)
        except TimeoutError:
            reward, failure = 0.0, "timeout"
        except Exception as e:  # the verifier's fault costs this score, never the service
            log.warning("score %s: the reward raised %s: %s (scored 0)", request_id, type(e).__name__, e)
            reward, failure = 0.0, "raised"
        finally:
            self.metrics.in_flight.dec()
        seconds = time.monotonic() - t0
        outcome = "ok" if not failure else failure if failure in SCORE_OUTCOMES else "fault"
        self.outcomes[outcome] += 1
        self.metrics.scores.labels(outcome).inc()
        self.metrics.seconds.observe(seconds)
        return reward, failure, seconds

    def _run(self, response: str, answer: str, deadline: float) -> tuple[float, str]:
        left = deadline - time.monotonic()
        if left <= 0:  # it waited for a thread until its caller gave up: not worth scoring now
            return 0.0, "busy"
        return self._scored(response, answer, timeout_s=left)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if hasattr(self.reward, "close"):
            self.reward.close()


def build_handler(service: RewardService) -> grpc.GenericRpcHandler:
    c = service.config
    name = c.reward if isinstance(c.reward, str) else c.reward.type

    async def describe(req: pb.RewardDescribeRequest, ctx) -> pb.RewardDescribeResponse:
        return pb.RewardDescribeResponse(reward=name, max_concurrent=c.max_concurrent, timeout_s=c.timeout_s)

    async def score(req: pb.ScoreRequest, ctx) -> pb.ScoreResponse:
        if not (0 <= req.timeout_s < math.inf):
            why = f"timeout_s: must be a finite number >= 0 (0 = the service's {c.timeout_s:g} s), got {req.timeout_s}"
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        for field in ("response", "answer"):
            if len(getattr(req, field)) > c.max_chars:
                why = f"{field}: {len(getattr(req, field))} characters, more than max_chars {c.max_chars}"
                await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        reward, failure, seconds = await service.score(req.response, req.answer, req.timeout_s, req.request_id)
        return pb.ScoreResponse(reward=reward, failure=failure, seconds=seconds)

    return unary_service(SERVICE, {"Describe": (pb.RewardDescribeRequest, describe), "Score": (pb.ScoreRequest, score)})


def hosted_reward(config: RewardServiceConfig, ports: dict):
    """The reward the service scores with: a function in worker processes, or a variant."""
    if isinstance(config.reward, str):
        build_reward(config.reward)  # a function that cannot be imported fails here, not in a worker
        return RewardPool(config.reward, config.workers, config.timeout_s)
    return build_reward(config.reward, **ports)


def serve(config: RewardServiceConfig, auth: AuthConfig, proxy_address: str, model_path: str) -> None:
    """The reward service's section, the LLMProxy's address and the policy's ``model_path`` (a judge
    generates through them)."""
    from services.llm_proxy.client import ProxyClient
    from services.reward.ports import reward_ports

    async def start():
        proxy = ProxyClient(proxy_address, auth=auth)
        ports = reward_ports(auth, proxy=proxy, tokenizer_path=model_path)
        service = RewardService(config, hosted_reward(config, ports))
        # Requests up to max_chars of (up to 4-byte) characters in each field are refused by name, not by size.
        options = [("grpc.max_receive_message_length", 8 * config.max_chars + 65_536)]
        server = await start_server(build_handler(service), SERVICE, config.host, config.port, options, auth)
        serve_metrics(service.metrics.registry, config.host, config.metrics_port, "RewardService")
        log.info("RewardService (%s) serving on %s:%d", config.reward, config.host, server.bound_port)

        async def cleanup() -> None:
            log.info("scored %d answers (%s)", service.outcomes.total(), dict(service.outcomes))
            service.close()
            await proxy.close()

        return server, cleanup

    serve_until_signal(start)
