"""``rollmesh serve trainer``: the trainer process (single process, or one rank under torchrun)."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


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

    async def main() -> None:
        proxy = ProxyClient(cfg.env_manager.proxy_address)
        buffer = BufferClient(cfg.env_manager.buffer_address)
        channel = grpc.aio.insecure_channel(cfg.env_manager.controller_address)
        engine = SimTrainEngine(cfg.trainer.sim) if cfg.trainer.sim is not None else TrainEngine(cfg.trainer)
        loop = TrainerLoop(
            cfg.train_loop, engine, buffer, controller_pb2_grpc.AsyncControllerStub(channel), proxy,
            groups_per_step=cfg.controller.groups_per_step, max_staleness=cfg.controller.async_ratio,
        )  # fmt: skip
        loop.resume()
        loop.prom.version.set(engine.version)
        serve_metrics(loop.prom.registry, cfg.train_loop.metrics_host, cfg.train_loop.metrics_port, "trainer")
        try:
            while engine.step < cfg.train_loop.steps:
                metrics = await loop.step()
                if metrics:
                    log.info("step %d reward %.3f loss %.4f", metrics["step"], metrics["reward_mean"], metrics["loss"])
        finally:
            loop.close()
            await asyncio.gather(proxy.close(), buffer.close(), channel.close())

    asyncio.run(main())
