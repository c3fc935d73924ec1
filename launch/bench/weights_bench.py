"""`rollmesh bench weights`: one weight update through each transport, in seconds and GB/s.

Engine processes serve a randomly initialised model of the chosen shape behind an LLMProxy
process, as deployed; the trainer side (a ``TrainEngine`` on the same weights and the
``WeightPublisher``s of ``services/weight_transports/``) runs in this process. Each
transport's update is timed in its two phases, as the training loop runs them:

- ``export``: before generation is suspended (gather the weights, write the restore directory,
  and for ``http_buckets`` serialize the buckets);
- ``load``: what generation waits for while suspended (every engine confirms the version).

``collective_gloo`` is the ``collective`` transport on CPU; its first update also makes the group
(the median hides that once). ``ipc_shm`` is the ``ipc`` transport on CPU (shared memory instead
of CUDA IPC handles). ``ipc_cuda`` and ``collective_nccl`` are the same transports on a GPU; the
GPU check (``launch/bench/gpu_check.py``) times them.

Each number is the median of ``repeats`` updates, each to a new version whose weights differ. After
the last update of each transport every engine's ``/get_weight_version`` checksum must equal the
trainer's over the weights it exported (``<transport>_checksums_equal``).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from launch.bench import BadOption
from services.processes import start_engine_process, start_service_process, stop_process


def _model(out: Path, hidden_size: int, layers: int) -> Path:
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    heads = max(1, hidden_size // 64)
    kv_heads = heads // 2 if heads % 2 == 0 else heads
    cfg = TinyModelConfig(
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return build_tiny_model(out, cfg)


CPU_TRANSPORTS = ("disk", "http_buckets", "ipc_shm", "collective_gloo")


def _publisher(name: str, client, run_dir: Path, bucket_mb: int):
    from services.weight_transports.collective import CollectivePublisher
    from services.weight_transports.disk import DiskPublisher
    from services.weight_transports.http_buckets import BucketPublisher
    from services.weight_transports.ipc import IpcPublisher

    builders = {
        "disk": lambda: DiskPublisher(client, run_dir),
        "http_buckets": lambda: BucketPublisher(client, run_dir, bucket_mb=bucket_mb),
        "ipc_shm": lambda: IpcPublisher(client, run_dir, bucket_mb=bucket_mb),
        "ipc_cuda": lambda: IpcPublisher(client, run_dir, bucket_mb=bucket_mb),
        "collective_gloo": lambda: CollectivePublisher(client, run_dir, bucket_mb=bucket_mb, backend="gloo"),
        "collective_nccl": lambda: CollectivePublisher(client, run_dir, bucket_mb=bucket_mb, backend="nccl"),
    }
    if name not in builders:
        raise BadOption(f"transport: one of {sorted(builders)}, got {name!r}")
    return builders[name]()


async def _checksums_equal(trainer, engine_urls: list[str]) -> bool:
    """Every engine reports the checksum of the trainer's current weights (what it exported)."""
    import httpx

    from rollout.engines.embedded.weights import weights_checksum
    from services.auth import AuthConfig, http_headers

    want = weights_checksum(trainer.model.state_dict())  # one process: the engine's own names (tied once)
    auth = AuthConfig()
    async with httpx.AsyncClient(headers=http_headers(auth), verify=auth.client_ssl() or True, timeout=60) as http:
        got = [(await http.get(f"{url}/get_weight_version")).json()["checksum"] for url in engine_urls]
    return all(g == want for g in got)


async def _updates(publisher, trainer, proxy_client, first_version: int, repeats: int, timeout_s: float) -> dict:
    import torch

    export_s, load_s = [], []
    for i in range(repeats):
        version = first_version + i
        with torch.no_grad():  # new weights each time, as after an optimizer step
            for p in trainer.model.parameters():
                p.add_(1e-3)
        t0 = time.perf_counter()
        publisher.export(trainer, version)
        t1 = time.perf_counter()
        await publisher.load(version, timeout_s)
        load_s.append(time.perf_counter() - t1)
        export_s.append(t1 - t0)
        publisher.committed(version)
        stats = await proxy_client.stats()
        if any(e.weight_version != version for e in stats.engines):
            raise RuntimeError(f"an engine did not confirm version {version}: {stats}")
    return {"export_s": statistics.median(export_s), "load_s": statistics.median(load_s)}


def run(
    hidden_size: int = 1024,
    layers: int = 8,
    engines: int = 2,
    repeats: int = 3,
    bucket_mb: int = 256,
    progress=print,
    model_path: str | None = None,
    transports: tuple[str, ...] = CPU_TRANSPORTS,
    engine_env: dict[str, str] | None = None,
) -> dict:
    """Time ``repeats`` updates through each of ``transports``; returns the medians. ``model_path``:
    serve and train that model instead of a random one of ``hidden_size`` x ``layers``;
    ``engine_env``: added to the engines' environment (``CUDA_VISIBLE_DEVICES``)."""
    for name, value, low in (
        ("hidden-size", hidden_size, 64),
        ("layers", layers, 1),
        ("engines", engines, 1),
        ("repeats", repeats, 1),
        ("bucket-mb", bucket_mb, 1),
    ):
        if value < low:
            raise BadOption(f"--{name}: must be >= {low}, got {value}")
    # imported once the options are checked: a refusal takes no torch import
    from services.llm_proxy.client import ProxyClient
    from services.weight_transports.collective import CollectivePublisher
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    procs = []
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-weights-") as tmp:
        model = Path(model_path) if model_path else _model(Path(tmp) / "model", hidden_size, layers)
        trainer = TrainEngine(TrainerConfig(model_path=str(model)))
        n_params = sum(p.numel() for p in trainer.model.parameters())
        gb = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 1e9
        progress(f"model: {n_params / 1e6:.0f} M parameters, {gb:.2f} GB; starting {engines} engine(s) and a proxy")
        try:
            urls = []
            for _ in range(engines):
                roots = [f"load_roots=[{Path(tmp) / 'run' / 'weights'}]"]  # where the disk transport exports
                proc, url = start_engine_process(str(model), extra=roots, timeout_s=600, env=engine_env)
                procs.append(proc)
                urls.append(url)
            proxy, address = start_service_process(
                "llm-proxy", "proxy", [f"engine_urls=[{','.join(urls)}]", "metrics_port=0"]
            )
            procs.append(proxy)

            async def both() -> dict:
                client = ProxyClient(address)
                try:
                    out = {}
                    for i, name in enumerate(transports):
                        publisher = _publisher(name, client, Path(tmp) / "run", bucket_mb)
                        progress(f"{name}: {repeats} update(s)")
                        out[name] = await _updates(publisher, trainer, client, 1 + i * repeats, repeats, 600.0)
                        out[name]["gb_per_s"] = gb / out[name]["load_s"]
                        out[name]["checksums_equal"] = await _checksums_equal(trainer, urls)
                        if isinstance(publisher, CollectivePublisher):  # the group is made by the first update
                            publisher.close()
                    return out
                finally:
                    await client.close()

            result = asyncio.run(both())
        finally:
            for p in procs:
                stop_process(p)
    rounded = {
        f"{name}_{m}": v if isinstance(v, bool) else round(v, 3) for name, r in result.items() for m, v in r.items()
    }
    speedups = {
        f"load_speedup_{name}_vs_disk": round(result["disk"]["load_s"] / r["load_s"], 2)
        for name, r in result.items()
        if name != "disk" and "disk" in result
    }
    return {
        "params_m": round(n_params / 1e6, 1),
        "model_gb": round(gb, 3),
        "engines": engines,
        "bucket_mb": bucket_mb,
        **rounded,
        **speedups,
    }
