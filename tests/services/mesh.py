"""The mesh's services in one event loop (the engine runs as its own process), for tests."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from rollout.proxy import ProxyConfig
from sample_buffer.config import BufferConfig
from services.controller.client import ControllerClient
from services.controller.config import ControllerConfig
from services.controller.server import start_controller
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import start_proxy
from services.sample_buffer.client import BufferClient
from services.sample_buffer.server import start_buffer_service


@contextlib.asynccontextmanager
async def local_mesh(engine_url: str | list[str], model_path: str, buffer: dict | None = None, **controller):
    urls = [engine_url] if isinstance(engine_url, str) else engine_url
    proxy_server, proxy = await start_proxy(ProxyConfig(engine_urls=urls, port=0, metrics_port=0))
    buf_server, buf, refresh = await start_buffer_service(BufferConfig(port=0, metrics_port=0, **(buffer or {})))
    ctl_cfg = ControllerConfig(port=0, metrics_port=0, initial_model_path=model_path, **controller)
    ctl_server, ctl, ctl_clients = await start_controller(
        ctl_cfg, f"127.0.0.1:{proxy_server.bound_port}", buffer_address=f"127.0.0.1:{buf_server.bound_port}"
    )
    mesh = SimpleNamespace(
        proxy=proxy,
        controller=ctl,
        proxy_client=ProxyClient(f"127.0.0.1:{proxy_server.bound_port}"),
        buffer_client=BufferClient(f"127.0.0.1:{buf_server.bound_port}"),
        controller_client=ControllerClient(f"127.0.0.1:{ctl_server.bound_port}"),
    )
    try:
        yield mesh
    finally:
        await ctl.close()  # its loops first: they call the proxy and the buffer through ctl_clients
        for client in (mesh.controller_client, mesh.proxy_client, mesh.buffer_client, ctl_clients):
            await client.close()
        refresh.cancel()
        for server in (ctl_server, buf_server, proxy_server):
            await server.stop(0)
        await buf.close()
        await proxy.close()


def disk_train_loop(mesh, cfg, engine, groups_per_step: int, max_staleness: int, observer=None):
    """The training loop on the mesh (``cfg``: a ``TrainLoopConfig``), weights published from disk."""
    from services.weight_transports.disk import DiskPublisher
    from trainer.loop import TrainLoop

    return TrainLoop(
        cfg,
        engine,
        source=mesh.buffer_client,
        control=mesh.controller_client,
        publisher=DiskPublisher(mesh.proxy_client, cfg.run_dir, cfg.keep_weight_versions),
        groups_per_step=groups_per_step,
        max_staleness=max_staleness,
        observer=observer,
    )


def short_run(run_dir, steps: int):
    """A ``TrainLoopConfig`` of ``steps`` steps in ``run_dir``, no checkpoints."""
    from trainer.config import TrainLoopConfig

    return TrainLoopConfig(steps=steps, run_dir=str(run_dir), checkpoint_every=0, get_timeout_s=60)


def digit_rollout(mesh, tokenizer_path: str):
    """An EnvManager rollout loop on the mesh: groups of 4 two-token answers to digit prompts."""
    from services.env_manager.config import EnvManagerConfig
    from services.env_manager.server import build_loop

    config = EnvManagerConfig(
        tokenizer_path=tokenizer_path,
        group_size=4,
        num_workers=3,
        reward="digit_answer",
        episode={"sampling": {"max_new_tokens": 2}},
    )
    return build_loop(config, mesh.proxy_client, mesh.buffer_client, mesh.controller_client)
