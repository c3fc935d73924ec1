"""``rollmesh serve trainer``: the trainer process, single or one rank under ``torchrun``.

Under torchrun (``WORLD_SIZE`` > 1) every rank joins one process group (NCCL on GPUs, gloo on
CPU) and trains with FSDP2; only rank 0 opens connections to the mesh and serves /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta

log = logging.getLogger(__name__)


def _init_distributed(cfg) -> tuple[int, int]:
    """Join torchrun's process group when there is one; returns (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Ranks > 0 wait in a broadcast while rank 0 waits for a batch and publishes weights: the
    # collective timeout must outlast both, or a slow rollout would kill the trainer.
    loop = cfg.train_loop
    timeout = timedelta(seconds=max(1800.0, 2 * (loop.get_timeout_s + loop.publish_timeout_s) + 600))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def serve(cfg) -> None:
    """Resume if a checkpoint exists, train until ``train_loop.steps``, exit 0."""
    import grpc

    from services.llm_proxy.client import ProxyClient
    from services.metrics import serve_metrics
    from services.pb.rollmesh.v1 import controller_pb2_grpc
    from services.sample_buffer.client import BufferClient
    from services.trainer_loop import TrainerLoop
    from trainer.engine import TrainEngine
    from trainer.sim import SimTrainEngine

    rank, world = _init_distributed(cfg)

    async def main() -> None:
        proxy = buffer = channel = controller = None
        if rank == 0:
            proxy = ProxyClient(cfg.env_manager.proxy_address)
            buffer = BufferClient(cfg.env_manager.buffer_address)
            channel = grpc.aio.insecure_channel(cfg.env_manager.controller_address)
            controller = controller_pb2_grpc.AsyncControllerStub(channel)
        engine = SimTrainEngine(cfg.trainer.sim) if cfg.trainer.sim is not None else TrainEngine(cfg.trainer)
        loop = TrainerLoop(
            cfg.train_loop, engine, buffer, controller, proxy, groups_per_step=cfg.controller.groups_per_step,
            max_staleness=cfg.controller.async_ratio, rank=rank, world=world,
        )  # fmt: skip
        loop.resume()
        if rank == 0:
            loop.prom.version.set(engine.version)
            serve_metrics(loop.prom.registry, cfg.train_loop.metrics_host, cfg.train_loop.metrics_port, "trainer")
            log.info("trainer: %d rank(s), from step %d", world, engine.step)
        try:
            while engine.step < cfg.train_loop.steps:
                metrics = await loop.step()
                if metrics and rank == 0:
                    log.info("step %d reward %.3f loss %.4f", metrics["step"], metrics["reward_mean"], metrics["loss"])
        finally:
            loop.close()
            if rank == 0:
                await asyncio.gather(proxy.close(), buffer.close(), channel.close())

    try:
        asyncio.run(main())
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
