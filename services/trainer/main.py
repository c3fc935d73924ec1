"""``rollmesh serve trainer``: the training loop wired to the mesh, single or one rank under torchrun.

Under torchrun (``WORLD_SIZE`` > 1) every rank joins one process group (NCCL on GPUs, gloo on
CPU) and trains with FSDP2; only rank 0 opens connections to the mesh and serves /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from pathlib import Path

from services.auth import AuthConfig
from services.mesh_config import MeshConfig
from services.trainer.config import TrainerProcessConfig

log = logging.getLogger(__name__)


def _init_distributed(trainer, loop: TrainerProcessConfig) -> tuple[int, int]:
    """Join torchrun's process group when there is one; returns (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    cuda = getattr(trainer, "device", "cpu") != "cpu" and torch.cuda.is_available()  # the sim has none
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Ranks > 0 wait in a broadcast while rank 0 waits for a batch and publishes weights: the
    # collective timeout must outlast both, or a slow rollout would kill the trainer.
    timeout = timedelta(seconds=max(1800.0, 2 * (loop.get_timeout_s + loop.publish_timeout_s) + 600))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def serve(
    lc: TrainerProcessConfig,
    trainer,
    auth: AuthConfig,
    mesh: MeshConfig,
    groups_per_step: int,
    async_ratio: int,
    colocated: bool = False,
) -> None:
    """Resume if a checkpoint exists, refuse a staleness bound other than the controller's, train
    until ``train_loop.steps``, exit 0. ``trainer``: the trainer section (a ``TrainerVariant``); what
    it shares with the controller: ``groups_per_step`` and ``async_ratio``; ``colocated``: the
    engines share the trainer's GPUs (``devices.placement``)."""
    from services.controller.client import ControllerClient
    from services.llm_proxy.client import ProxyClient
    from services.metrics import serve_metrics
    from services.metrics_log import LOST_STEPS, MetricsLog, continue_from
    from services.sample_buffer.client import BufferClient
    from services.trainer.metrics import TrainerMetrics, TrainerObserver
    from trainer.loop import TrainLoop
    from trainer.variants import build_trainer

    rank, world = _init_distributed(trainer, lc)

    async def main() -> None:
        proxy = buffer = controller = observer = None
        if rank == 0:
            proxy, buffer = ProxyClient(mesh.proxy, auth=auth), BufferClient(mesh.buffer, auth=auth)
            controller = ControllerClient(mesh.controller, auth=auth)
            run_dir = Path(lc.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            observer = TrainerObserver(
                MetricsLog(run_dir / "metrics.jsonl", lc.tracking, run_dir.name, run_dir), TrainerMetrics()
            )
        memory = None  # colocated engines give the GPUs back while a step trains
        if rank == 0 and colocated:
            from services.trainer.colocation import ProxyMemory

            memory = ProxyMemory(proxy, lc.colocated_lease_s)
        loop = TrainLoop(
            lc,
            build_trainer(trainer, lc.steps),
            source=buffer,
            control=controller,
            publisher=lc.publisher.build(proxy, lc.run_dir, lc.keep_weight_versions),
            observer=observer,
            groups_per_step=groups_per_step,
            max_staleness=async_ratio,
            rank=rank,
            world=world,
            memory=memory,
        )
        if loop.resume() and rank == 0:  # the curve goes on from the checkpoint
            moved = continue_from(observer.log.path, loop.engine.step)
            if moved:
                log.warning(
                    "%d step(s) after the checkpoint were lost with the previous trainer: moved to %s",
                    moved,
                    LOST_STEPS,
                )
        try:
            await loop.join()
            if rank == 0:
                observer.prom.version.set(loop.engine.version)
                serve_metrics(observer.prom.registry, lc.metrics_host, lc.metrics_port, "trainer")
                log.info(
                    "trainer: %d rank(s), from step %d, weights over %s", world, loop.engine.step, lc.publisher.type
                )
            while loop.engine.step < lc.steps:
                metrics = await loop.step()
                if metrics and rank == 0:
                    log.info("step %d reward %.3f loss %.4f", metrics["step"], metrics["reward_mean"], metrics["loss"])
        finally:
            if rank == 0:
                observer.log.close()
                await asyncio.gather(proxy.close(), buffer.close(), controller.close())

    try:
        asyncio.run(main())
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
