"""gRPC EnvManager service: Start / Stop / Stats over a ``RolloutLoop`` wired to the mesh."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import socket
import uuid

import grpc

from rollout.domains import Domain
from rollout.envs.remote import RemoteEnv
from rollout.loop import DROP_CAUSES, RolloutLoop
from sample_buffer.vision import vision_of
from services.auth import AuthConfig
from services.controller.client import ControllerClient
from services.env_manager.config import EnvManagerConfig
from services.env_manager.metrics import EnvMetrics
from services.env_provider.clients import build_pool
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.llm_proxy.client import ProxyClient, ProxyGenerate, ProxyTeacher
from services.mesh_config import MeshConfig
from services.metrics import serve_metrics
from services.pb.rollmesh.v1 import env_manager_pb2 as pb
from services.reward.metrics import SummedRewards
from services.reward.ports import reward_ports
from services.sample_buffer.client import BufferClient, PutBatcher

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.EnvManager"
# One coroutine per worker, all created at once: 2**31 - 1 of them ate the service's memory and never started.
MAX_WORKERS = 10_000
_FAILURES = (
    "groups_failed",
    "groups_filtered",
    "groups_stale",
    "groups_too_few_members",
    "groups_teacher_error",
    "finish_timeout",
    "finish_abort",
    "release_failures",
    *(f"members_dropped_{c}" for c in DROP_CAUSES),
)


def build_handler(loop: RolloutLoop) -> grpc.GenericRpcHandler:
    async def start(req: pb.StartRequest, ctx) -> pb.StartResponse:
        if not 0 <= req.num_workers <= MAX_WORKERS:
            why = f"num_workers: must be in [0, {MAX_WORKERS}] (0 = as configured), got {req.num_workers}"
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        await loop.start(req.num_workers)
        return pb.StartResponse(started=True)

    async def stop(req: pb.StopRequest, ctx) -> pb.StopResponse:
        if not 0 <= req.timeout_s < math.inf:  # NaN made the drain raise (uvloop): UNKNOWN, workers not cancelled
            why = f"timeout_s: must be a finite number >= 0 (0 = until the groups end), got {req.timeout_s}"
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        return pb.StopResponse(episodes_abandoned=await loop.stop(req.drain, req.timeout_s))

    async def stats(req: pb.EnvStatsRequest, ctx) -> pb.EnvStats:
        c = loop.counters
        return pb.EnvStats(
            running=loop.running,
            workers=loop.workers,
            episodes_running=loop.running_episodes,
            episodes_finished=c["trajectories"],
            trajectories_put=c["trajectories_put"],
            groups_put=c["groups_put"],
            failures_by_reason={k: c[k] for k in _FAILURES if c[k]},
        )

    return unary_service(
        SERVICE,
        {"Start": (pb.StartRequest, start), "Stop": (pb.StopRequest, stop), "Stats": (pb.EnvStatsRequest, stats)},
    )


def build_loop(
    config: EnvManagerConfig,
    proxy: ProxyClient,
    buffer: BufferClient,
    controller: ControllerClient,
    auth: AuthConfig | None = None,
    reward_address: str | None = None,
    teachers: dict[str, ProxyClient] | None = None,
) -> RolloutLoop:
    """The rollout loop over the mesh's clients, reporting to Prometheus. A remote environment's
    episodes go to its providers through one pool of connections; ``reward_address``: the mesh's
    reward service (``reward: {type: service}`` naming none); ``teachers``: the teachers' LLMProxies
    by name (on-policy distillation: a task's ``teacher``)."""
    teachers = teachers or {}
    for d in config.task_domains():
        if d.teacher is not None and d.teacher not in teachers:
            where = f"domains[{d.name}].teacher" if d.name else "teacher"
            raise ValueError(f"{where}: no teacher {d.teacher!r} in the mesh (mesh.teachers: {sorted(teachers)})")
    from transformers import AutoTokenizer

    pools, domains = [], []
    for d in config.task_domains():
        if d.env.type == "remote":
            pool = build_pool(d.env, auth or AuthConfig())
            pools.append(pool)
            rows, reward_fn = [{} for _ in range(d.env.num_seeds)], None
            name = d.env.env_name or "remote"
            make_env = functools.partial(RemoteEnv, pool, name=name)
        else:
            # A custom environment's constructor fails here, not mid-run.
            ports = reward_ports(auth, reward_address=reward_address, proxy=proxy, tokenizer_path=config.tokenizer_path)
            rows, reward_fn, build = d.env_factory(**ports)
            name, make_env = getattr(build(), "name", d.env.type), None
        domains.append((d, rows, reward_fn, name, make_env))
    metrics = EnvMetrics(domains[0][3], pools=tuple(pools), domains=tuple(d.name for d, *_ in domains if d.name))
    # Rewards that count their faults (reward workers, the sandbox, the judge, the service), by domain.
    counted = {d.name: fn for d, _, fn, *_ in domains if hasattr(fn, "failures")}
    if counted:
        only = len(counted) == 1 and "" in counted
        metrics.reward_source = counted[""] if only else SummedRewards(list(counted.values()))
        metrics.domain_rewards = {name: fn for name, fn in counted.items() if name}
    built = []
    for d, rows, reward_fn, _, make_env in domains:
        if reward_fn is not None:
            reward_fn = metrics.timed_reward(reward_fn)
        if make_env is None:
            make_env = functools.partial(_local_env, d.env, rows, reward_fn)
        teacher = ProxyTeacher(teachers[d.teacher]) if d.teacher is not None else None
        built.append(
            Domain(d.name, d.weight, rows, make_env, config.episode_of(d), config.group_size_of(d), reward_fn, teacher)
        )
    loop = RolloutLoop(
        config,
        tokenizer=AutoTokenizer.from_pretrained(config.tokenizer_path),
        admission=controller,
        engine=ProxyGenerate(proxy),
        sink=PutBatcher(buffer, config.put_batch_max_groups, config.put_batch_delay_s),
        observer=metrics,
        id_prefix=f"{uuid.uuid4().hex[:8]}-",  # group ids unique across restarts
        first_prompt=random.randrange(1 << 30),  # a restart goes on somewhere else, not at the same prompts
        domains=built,
        vision=vision_of(config.tokenizer_path),
    )
    metrics.stats = lambda: {"running_episodes": loop.running_episodes, "workers": loop.workers}
    return loop


def _local_env(env, rows: list[dict], reward_fn, _episode_id: str):
    return env.build(rows, reward_fn)


def serve(config: EnvManagerConfig, auth: AuthConfig, mesh: MeshConfig, put_timeout_s: float) -> None:
    """The EnvManager's section, the mesh's addresses and the SampleBuffer's put deadline."""

    async def start():
        proxy = ProxyClient(mesh.proxy, auth=auth)
        buffer = BufferClient(mesh.buffer, auth=auth, put_timeout_s=put_timeout_s)
        # Named by where it serves, which a restart keeps: its successor's first report frees the slots
        # of the groups this process had in flight when it died.
        holder = f"{socket.gethostname()}:{config.port}"
        controller = ControllerClient(mesh.controller, auth=auth, holder=holder)
        teachers = {name: ProxyClient(address, auth=auth) for name, address in mesh.teachers.items()}
        loop = build_loop(config, proxy, buffer, controller, auth, mesh.reward, teachers)
        server = await start_server(build_handler(loop), SERVICE, config.host, config.port, auth=auth)
        serve_metrics(loop.observer.registry, config.host, config.metrics_port, "EnvManager")
        lease = asyncio.create_task(controller.keep_lease(config.heartbeat_s))
        if config.autostart:
            await loop.start()
        log.info("EnvManager serving on %s:%d", config.host, server.bound_port)

        async def cleanup() -> None:
            lease.cancel()
            await loop.stop()
            await asyncio.gather(proxy.close(), buffer.close(), controller.close())
            await asyncio.gather(*(pool.aclose() for pool in loop.observer.pools))

        return server, cleanup

    serve_until_signal(start)
