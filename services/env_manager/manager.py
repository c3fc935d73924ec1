"""The EnvManager: workers that admit a prompt, run its group, and put the group in the buffer.

Queue scheduling (default): each worker owns one prompt at a time; its ``group_size`` episodes
are independent requests (prompt replication) and each is scored the moment it ends. The group
goes to the buffer as soon as its last member is scored, and the worker asks for the next
prompt; nothing waits for a batch.

Batch scheduling is the synchronous baseline ``rollmesh bench async`` measures against: one
loop admits as many groups as it may, generates every response, then scores them all (a
``TurnBarrier`` per turn), then puts them all.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from rollout.admission import group_is_stale
from rollout.envs import load_jsonl, make_env
from rollout.episode import Generation, run_episode
from rollout.rewards import resolve_reward
from rollout.turn_barrier import TurnBarrier
from sample_buffer.trajectory import Group
from services.env_manager.config import EnvManagerConfig
from services.env_manager.metrics import EnvMetrics
from services.pb.rollmesh.v1 import common_pb2
from services.pb.rollmesh.v1 import controller_pb2 as cpb

log = logging.getLogger(__name__)
_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TIMEOUT: "timeout",
}


# The proxy had no engine in rotation, or the call never reached it (connection lost, server busy):
# worth another try within the generation's deadline rather than failing the whole group.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED})


def proxy_generate(client, replicate: bool = True, on_retry: Callable[[grpc.StatusCode], None] | None = None):
    """A ``GenerateFn`` over the LLMProxy gRPC client. The request id is the trajectory id (one
    request at a time per trajectory); without prompt replication the routing key is the group,
    so all n samples of a prompt land on one engine. Transient failures are retried with backoff
    until the generation's deadline (``on_retry`` counts them); the last one is raised."""

    async def generate(ids: list[int], sampling: dict, trajectory_id: str, timeout_s: float) -> Generation:
        route = trajectory_id if replicate else trajectory_id.rsplit("/", 1)[0]
        deadline, delay = time.monotonic() + timeout_s, 0.1
        while True:
            remaining = deadline - time.monotonic()
            try:
                res = await client.generate(
                    ids, request_id=trajectory_id, trajectory_id=route, timeout_s=remaining, **sampling
                )  # fmt: skip
                break
            except grpc.aio.AioRpcError as e:  # our own cancellation arrives as CancelledError instead
                if e.code() not in RETRYABLE or remaining - delay <= 0:
                    raise
                if on_retry is not None:
                    on_retry(e.code())
                await asyncio.sleep(delay)
                delay = min(5.0, 2 * delay)
        return Generation(
            list(res.output_ids), list(res.output_logprobs), list(res.token_versions), _FINISH[res.finish_reason]
        )

    return generate


@dataclass
class _GroupState:
    """A group being rolled out, as far as staleness is concerned."""

    running: set[str]  # trajectory (= request) ids still generating
    finished_starts: list[int] = field(default_factory=list)  # start versions of finished members
    stale: bool = False


class EnvManager:
    def __init__(self, config: EnvManagerConfig, proxy, buffer, controller_stub) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.rows = load_jsonl(config.dataset_path)
        self.reward_fn = resolve_reward(config.reward)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
        probe = make_env(config.env, self.rows, self.reward_fn, config.env_args)  # bad env or env_args fail here
        self.running_episodes = 0
        self.metrics = EnvMetrics(getattr(probe, "name", config.env), self.metric_stats)
        self.reward_fn = self.metrics.timed_reward(self.reward_fn)
        retried = self.metrics.generate_retries
        self.generate = proxy_generate(proxy, config.replicate_prompts, lambda code: retried.labels(code.name).inc())
        self.buffer, self.controller = buffer, controller_stub
        self.counters: Counter[str] = Counter()
        self._order = list(range(len(self.rows)))
        random.Random(config.seed).shuffle(self._order)
        self._next = 0
        self._workers: list[asyncio.Task] = []
        self._watcher: asyncio.Task | None = None
        self.running = False
        # Staleness: the controller's version (WatchVersion) and bound (Admit), and per group being
        # rolled out the start versions of its finished members and the ids of its running ones.
        self.proxy = proxy
        self.version, self.async_ratio = 0, None
        self._rolling: dict[str, _GroupState] = {}

    def _next_prompt(self) -> int:
        idx = self._order[self._next % len(self._order)]
        self._next += 1
        return idx

    async def start(self, num_workers: int = 0) -> None:
        if self.running:
            return
        self.running = True
        n = num_workers or self.config.num_workers
        if self.config.scheduling == "batch":
            self._workers = [asyncio.create_task(self._batch_loop(n))]
        else:
            self._workers = [asyncio.create_task(self._worker(i)) for i in range(n)]
        self._watcher = asyncio.create_task(self._watch_versions())

    async def stop(self) -> int:
        self.running = False
        if self._watcher is not None:
            self._watcher.cancel()
        for w in self._workers:
            w.cancel()
        results = await asyncio.gather(*self._workers, return_exceptions=True)
        if self._watcher is not None:
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        self._workers = []
        return sum(isinstance(r, asyncio.CancelledError) for r in results)

    async def _watch_versions(self) -> None:
        """Follow the controller's version; at each new one, stop rolling out groups that can no
        longer be trained on (their slots go back to admission, their engines to fresh work)."""
        while self.running:
            try:
                async for event in self.controller.WatchVersion(cpb.WatchVersionRequest()):
                    self.version = max(self.version, event.version)
                    await self._abort_stale_groups()
            except grpc.aio.AioRpcError as e:  # the controller restarted or is gone: retry, never stop
                log.warning("WatchVersion: %s; retrying in 1 s", e.code())
                await asyncio.sleep(1.0)

    async def _abort_stale_groups(self) -> None:
        if self.async_ratio is None:
            return
        for gid, state in list(self._rolling.items()):
            if not state.stale and group_is_stale(state.finished_starts, self.version, self.async_ratio):
                state.stale = True
                log.info("group %s is staler than the bound at v%d: aborting %d generations",
                         gid, self.version, len(state.running))  # fmt: skip
                await asyncio.gather(
                    *(self.proxy.abort(request_id=tid) for tid in state.running), return_exceptions=True
                )

    async def _worker(self, k: int) -> None:
        failures = 0  # in a row: back off so a broken dependency is not hammered with new groups
        while self.running:
            try:
                res = await self.controller.Admit(cpb.AdmitRequest(client_id=f"env-{k}", num_groups=1), timeout=30)
            except grpc.aio.AioRpcError as e:  # the controller restarts or is gone: wait, never let the worker die
                log.warning("Admit: %s; retrying", e.code())
                await asyncio.sleep(1.0)
                continue
            self.async_ratio = res.async_ratio
            if res.num_admitted == 0:
                await asyncio.sleep(self.config.admit_poll_s)
                continue
            try:
                accepted = await self._run_group(self._next_prompt())
            except asyncio.CancelledError:
                await self._release(unused=1)
                raise
            except Exception:  # one failed group must not stop the pool: logged, counted, released
                log.exception("group failed")
                self.counters["env_error"] += 1
                self.metrics.groups.labels("failed").inc()
                await self._release(unused=1)
                failures += 1
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
                continue
            failures = 0
            # A group the buffer filtered will never be trained on: its slot goes back to the pool,
            # or dynamic filtering would use up the staleness budget and starve the trainer.
            await self._release(finished=1) if accepted else await self._release(unused=1)

    async def _batch_loop(self, max_groups: int) -> None:
        """Synchronous rollout: admit a step's groups, generate all, score all, put all."""
        while self.running:
            res = await self.controller.Admit(
                cpb.AdmitRequest(client_id="env-batch", num_groups=max_groups), timeout=30
            )
            n = res.num_admitted
            self.async_ratio = res.async_ratio
            if n == 0:
                await asyncio.sleep(self.config.admit_poll_s)
                continue
            barrier = TurnBarrier(n * self.config.group_size)
            try:
                results = await asyncio.gather(
                    *(self._run_group(self._next_prompt(), barrier) for _ in range(n)), return_exceptions=True
                )
            except asyncio.CancelledError:
                await self._release(unused=n)
                raise
            for r in results:
                if isinstance(r, BaseException):
                    log.error("group failed: %r", r)
                    self.counters["env_error"] += 1
                    self.metrics.groups.labels("failed").inc()
            accepted = sum(r is True for r in results)
            await self._release(unused=n - accepted, finished=accepted)

    async def _release(self, unused: int = 0, finished: int = 0) -> None:
        req = cpb.ReleaseRequest(client_id="env", num_groups=unused, num_finished=finished)
        await self.controller.Release(req, timeout=30)

    async def _run_group(self, row: int, barrier: TurnBarrier | None = None) -> bool:
        gid = f"p{row}-{self.counters['groups_started']}"
        self.counters["groups_started"] += 1
        t0 = time.monotonic()
        envs = [make_env(self.config.env, self.rows, self.reward_fn, self.config.env_args)
                for _ in range(self.config.group_size)]  # fmt: skip
        self.running_episodes += len(envs)
        self._rolling[gid] = state = _GroupState(running={f"{gid}/{i}" for i in range(len(envs))})
        try:
            trajs = await self._run_episodes(envs, row, gid, barrier, state)
        finally:
            self.running_episodes -= len(envs)
            del self._rolling[gid]
        for t in trajs:
            self.counters[f"finish_{t.finish_reason}"] += 1
            self.counters["trajectories"] += 1
        if state.stale:  # never put: the buffer would only drop it; counted, and its slot goes back
            self.counters["groups_stale"] += 1
            self.metrics.groups.labels("stale").inc()
            # What the bound costs: these tokens were generated and will never be trained on.
            self.metrics.stale_tokens.labels(self.metrics.env).inc(sum(len(t.behavior_logprobs) for t in trajs))
            return False
        group = Group(gid, f"p{row}", list(trajs))
        res = await self.buffer.put(group, timeout_s=60)
        self.counters["groups_put" if res.accepted else f"groups_{res.reason}"] += 1
        try:  # the group is in the buffer: a metrics fault must not make it count as failed
            self.metrics.observe_group(group, time.monotonic() - t0)
            self.metrics.groups.labels("put" if res.accepted else "filtered").inc()
        except Exception:
            log.exception("recording metrics of group %s failed", gid)
        return res.accepted

    async def _run_episodes(self, envs: list, row: int, gid: str, barrier: TurnBarrier | None, state: _GroupState):
        async def one(i: int, env):
            tid = f"{gid}/{i}"
            t = await run_episode(env, row, self.generate, self.tokenizer, self.config.episode, trajectory_id=tid,
                                  group_id=gid, prompt_id=f"p{row}", barrier=barrier)  # fmt: skip
            state.running.discard(tid)
            if t.token_versions is not None and len(t.token_versions):
                state.finished_starts.append(int(t.start_version))
                await self._abort_stale_groups()  # a finished member may reveal the group is already too old
            return t

        return await asyncio.gather(*(one(i, env) for i, env in enumerate(envs)))

    def metric_stats(self) -> dict:
        return {"running_episodes": self.running_episodes, "workers": len(self._workers)}

    def stats(self) -> dict:
        return {"running": self.running, "workers": len(self._workers)} | dict(self.counters)
