"""`rollmesh bench weights --delta`: what a weight update costs whole and as a delta, over real
training steps of a real model.

The trainer takes a run config's model and trainer section (default examples/smollm2-math.yaml:
SmolLM2-135M, lr 5e-6, decoupled PPO) and makes optimizer steps on batches of that task: each
prompt of its dataset with the right answer and wrong ones (rewards 1 and 0, so GRPO advantages
of both signs), behaviour log-probs from the policy itself (on-policy, as fresh samples are).
Two bfloat16 engine processes, each behind its own LLMProxy, follow the trainer version by
version: one gets every weight (``http_buckets``), the other only what changed in bfloat16
(``http_buckets`` with ``delta: true``). After each step both updates are timed in the training
loop's two phases (export before generation is suspended, load while it is) and their bytes
counted; the delta engine must hold exactly the whole one's weights (checksums) at the end.

The JSON line also says which encoding wins: the bytes had every changed tensor gone whole
(``changed_tensors``) or as indices + values (``sparse``), against the per-tensor choice sent.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from launch.bench import BadOption
from services.processes import start_engine_process, start_service_process, stop_process

DEFAULT_CONFIG = "examples/smollm2-math.yaml"


def _batches(trainer, dataset: str, steps: int, prompts: int, group_size: int, seed: int):
    """``steps`` batches of ``prompts`` groups: the prompt, then " <answer>." right or wrong."""
    import torch
    from transformers import AutoTokenizer

    from trainer.batch import batch_from_sequences

    tok = AutoTokenizer.from_pretrained(trainer.config.model_path, local_files_only=True)
    rows = [json.loads(line) for line in Path(dataset).read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    for _ in range(steps):
        seqs, masks, rewards, gids = [], [], [], []
        for g, row in enumerate(rng.sample(rows, prompts)):
            prompt = tok(row["prompt"])["input_ids"]
            for k in range(group_size):
                right = k % 2 == 0
                answer = row["answer"] if right else str(int(row["answer"]) + rng.choice([-2, -1, 1, 2]))
                response = tok(f" The final answer is {answer}.")["input_ids"]
                seqs.append(prompt + response)
                masks.append([0.0] * len(prompt) + [1.0] * len(response))
                rewards.append(float(right))
                gids.append(g)
        width = max(map(len, seqs))
        mask = torch.tensor([m + [0.0] * (width - len(m)) for m in masks])
        batch = batch_from_sequences(seqs, mask, torch.zeros_like(mask), torch.tensor(rewards), torch.tensor(gids))
        batch.behavior_logprobs = trainer.logprobs(batch).cpu() * mask  # on-policy
        yield batch


async def _update(publisher, trainer, version: int, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    publisher.export(trainer, version)
    t1 = time.perf_counter()
    await publisher.load(version, timeout_s)
    t2 = time.perf_counter()
    publisher.committed(version)
    return {"export_s": t1 - t0, "load_s": t2 - t1, "bytes": publisher.stats["weight_update_bytes"]}


async def _checksum(url: str) -> tuple[str, str]:
    import httpx

    from services.auth import AuthConfig, http_headers

    auth = AuthConfig()
    async with httpx.AsyncClient(headers=http_headers(auth), verify=auth.client_ssl() or True, timeout=60) as http:
        body = (await http.get(f"{url}/get_weight_version")).json()
    return body["weight_version"], body["checksum"]


def run(
    config_path: str = DEFAULT_CONFIG,
    steps: int = 10,
    prompts: int = 4,
    bucket_mb: int = 256,
    progress=print,
    lora_rank: int = 0,
) -> dict:
    """``steps`` training steps, each published whole to one engine and as a delta to another;
    ``lora_rank``: train LoRA adapters of that rank instead, publish their factors alone to a
    third engine too (``adapter``), and over disk: whole to a fourth (``disk``), the adapter's
    directory to a fifth that serves it by name (``served``: disk with ``adapter: true``). The
    first and third engines also take each version over ``ipc`` and ``collective``, whole and as
    factors (an update is absolute: the same version again replaces the same weights)."""
    from launch.config import load_config
    from services.llm_proxy.client import ProxyClient
    from trainer.engine import TrainEngine

    for name, value, low in (("steps", steps, 2), ("prompts", prompts, 1), ("bucket-mb", bucket_mb, 1)):
        if value < low:
            raise BadOption(f"--{name}: must be >= {low}, got {value}")
    if lora_rank < 0:
        raise BadOption(f"--lora-rank: must be >= 0, got {lora_rank}")
    cfg = load_config(config_path, [f"trainer.lora={{rank: {lora_rank}}}"] if lora_rank else [])
    if not Path(cfg.model_path, "config.json").is_file():
        raise BadOption(f"--config: {cfg.model_path} has no model (make {cfg.model_path}/config.json builds it)")
    trainer = TrainEngine(cfg.trainer)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    kinds = ("full", "delta", "adapter", "disk", "served") if lora_rank else ("full", "delta")  # an engine each
    # ... and over ipc and collective, to the full and adapter engines: whole, then the factors alone
    others = ("ipc", "ipc_adapter", "collective", "collective_adapter") if lora_rank else ()
    progress(
        f"model: {cfg.model_path} ({n_params / 1e6:.0f} M parameters), lr {cfg.trainer.lr:g}; {len(kinds)} engines"
    )
    batches = _batches(trainer, cfg.env_manager.dataset_path, steps, prompts, cfg.env_manager.group_size, seed=0)
    procs, out = [], {k: [] for k in (*kinds, *others)}
    shares, stats = [], []
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-delta-") as tmp:
        try:
            addresses, urls = [], []
            for kind in kinds:
                roots = f"load_roots=[{Path(tmp) / kind / 'weights'}]"
                proc, url = start_engine_process(cfg.model_path, extra=[roots, "dtype=bfloat16"], timeout_s=600)
                procs.append(proc)
                urls.append(url)
                proxy, address = start_service_process(
                    "llm-proxy", "proxy", [f"engine_urls=[{url}]", "metrics_port=0", "update_weights_timeout_s=600"]
                )
                procs.append(proxy)
                addresses.append(address)

            async def main() -> list[tuple[str, str]]:
                clients = [ProxyClient(a) for a in addresses]
                try:
                    publishers = _publishers(clients, Path(tmp), bucket_mb, bool(lora_rank), others)
                    delta = publishers["delta"]
                    for i, batch in enumerate(batches):
                        t0 = time.perf_counter()
                        metrics = trainer.train_step(batch)
                        train_s = time.perf_counter() - t0
                        for kind, publisher in publishers.items():
                            out[kind].append(await _update(publisher, trainer, trainer.version, 600.0))
                        if i:  # the first update has no base: whole on both
                            shares.append(delta.delta_stats.changed_share)
                            stats.append(delta.delta_stats)
                        progress(_step_line(i, steps, metrics, train_s, out, bool(lora_rank), shares))
                    for kind, publisher in publishers.items():
                        if getattr(publisher, "delta_fallbacks", 0):
                            raise RuntimeError(f"{publisher.delta_fallbacks} {kind} update(s) fell back to whole ones")
                    return [await _checksum(u) for u in urls[:3]]  # (served: the base weights, unchanged)
                finally:
                    for c in clients:
                        await c.close()

            states = asyncio.run(main())
        finally:
            for p in procs:
                stop_process(p)
    return _result(cfg, n_params, steps, out, shares, stats, states, lora_rank)


def _publishers(clients: list, tmp: Path, bucket_mb: int, lora: bool, others: tuple) -> dict:
    """A publisher per engine: whole and delta buckets; with LoRA, the factors alone, disk whole,
    the adapter's directory served by name, and ipc and collective whole and as factors."""
    from services.weight_transports.collective import CollectivePublisher
    from services.weight_transports.disk import DiskPublisher
    from services.weight_transports.http_buckets import BucketPublisher
    from services.weight_transports.ipc import IpcPublisher

    publishers = {
        "full": BucketPublisher(clients[0], tmp / "full", bucket_mb=bucket_mb),
        "delta": BucketPublisher(clients[1], tmp / "delta", bucket_mb=bucket_mb, delta_dtype="bfloat16"),
    }
    if lora:
        publishers["adapter"] = BucketPublisher(
            clients[2], tmp / "adapter", bucket_mb=bucket_mb, adapter_dtype="bfloat16"
        )
        publishers["disk"] = DiskPublisher(clients[3], tmp / "disk")
        publishers["served"] = DiskPublisher(clients[4], tmp / "served", adapter=True)
        for kind in others:
            client, where = clients[2 if "adapter" in kind else 0], tmp / kind
            factors = {"adapter_dtype": "bfloat16"} if "adapter" in kind else {}
            publishers[kind] = (
                IpcPublisher(client, where, bucket_mb=bucket_mb, **factors)
                if kind.startswith("ipc")
                else CollectivePublisher(client, where, bucket_mb=bucket_mb, **factors)
            )
    return publishers


def _step_line(i: int, steps: int, metrics: dict, train_s: float, out: dict, lora: bool, shares: list) -> str:
    """One step's progress line: the loss, and each engine's bytes and load time."""
    return (
        f"step {i + 1}/{steps}: loss {metrics['loss']:.4f}, trained in {train_s:.1f} s; "
        f"whole {out['full'][-1]['bytes'] / 1e6:.0f} MB in {out['full'][-1]['load_s']:.2f} s, "
        f"delta {out['delta'][-1]['bytes'] / 1e6:.1f} MB in {out['delta'][-1]['load_s']:.2f} s"
        + (
            f", adapter {out['adapter'][-1]['bytes'] / 1e6:.2f} MB in "
            f"{out['adapter'][-1]['load_s']:.2f} s; disk whole {out['disk'][-1]['load_s']:.2f} s, "
            f"served adapter {out['served'][-1]['bytes'] / 1e6:.2f} MB in "
            f"{out['served'][-1]['load_s']:.2f} s; ipc whole {out['ipc'][-1]['load_s']:.2f} s, "
            f"factors {out['ipc_adapter'][-1]['load_s']:.2f} s; collective whole "
            f"{out['collective'][-1]['load_s']:.2f} s, factors "
            f"{out['collective_adapter'][-1]['load_s']:.2f} s"
            if lora
            else ""
        )
        + (f" ({shares[-1]:.2%} of values changed)" if i else "")
    )


def _result(cfg, n_params: int, steps: int, out: dict, shares: list, stats: list, states: list, lora_rank: int) -> dict:
    """The JSON line: medians over the steps after the first, per engine."""
    later = slice(1, None)  # step 1 sends everything on both: a delta needs a version the engine holds
    med = lambda rows, key: statistics.median(r[key] for r in rows[later])  # noqa: E731
    sent = sum(s.bytes for s in stats)
    return {
        "model": cfg.model_path,
        "params_m": round(n_params / 1e6, 1),
        "lr": cfg.trainer.lr,
        "engine_dtype": "bfloat16",
        "steps": steps,
        "full_bytes_mb": round(med(out["full"], "bytes") / 1e6, 1),
        "full_export_s": round(med(out["full"], "export_s"), 3),
        "full_load_s": round(med(out["full"], "load_s"), 3),
        "delta_bytes_mb": round(med(out["delta"], "bytes") / 1e6, 2),
        "delta_export_s": round(med(out["delta"], "export_s"), 3),
        "delta_load_s": round(med(out["delta"], "load_s"), 3),
        "changed_share_median": round(statistics.median(shares), 5),
        "changed_share_min": round(min(shares), 5),
        "changed_share_max": round(max(shares), 5),
        "bytes_ratio_full_vs_delta": round(med(out["full"], "bytes") / med(out["delta"], "bytes"), 1),
        "load_speedup": round(med(out["full"], "load_s") / med(out["delta"], "load_s"), 2),
        "encoding_bytes_mb_changed_tensors": round(sum(s.bytes_changed_tensors for s in stats) / len(stats) / 1e6, 2),
        "encoding_bytes_mb_sparse": round(sum(s.bytes_sparse for s in stats) / len(stats) / 1e6, 2),
        "encoding_bytes_mb_chosen": round(sent / len(stats) / 1e6, 2),
        "bf16_whole_mb": round(stats[0].bytes_full / 1e6, 1),
        "checksums_equal": all(s == states[0] for s in states),
        **(
            {
                "lora_rank": lora_rank,
                "adapter_bytes_mb": round(med(out["adapter"], "bytes") / 1e6, 3),
                "adapter_export_s": round(med(out["adapter"], "export_s"), 3),
                "adapter_load_s": round(med(out["adapter"], "load_s"), 3),
                "bytes_ratio_full_vs_adapter": round(med(out["full"], "bytes") / med(out["adapter"], "bytes"), 1),
                "load_speedup_adapter": round(med(out["full"], "load_s") / med(out["adapter"], "load_s"), 2),
                "disk_full_bytes_mb": round(med(out["disk"], "bytes") / 1e6, 1),
                "disk_full_export_s": round(med(out["disk"], "export_s"), 3),
                "disk_full_load_s": round(med(out["disk"], "load_s"), 3),
                "served_adapter_bytes_mb": round(med(out["served"], "bytes") / 1e6, 3),
                "served_adapter_export_s": round(med(out["served"], "export_s"), 3),
                "served_adapter_load_s": round(med(out["served"], "load_s"), 3),
                "bytes_ratio_disk_full_vs_served": round(med(out["disk"], "bytes") / med(out["served"], "bytes"), 1),
                "load_speedup_served": round(med(out["disk"], "load_s") / med(out["served"], "load_s"), 2),
                **_others(out, med),
            }
            if lora_rank
            else {}
        ),
    }


def _others(out: dict, med) -> dict:
    """ipc and collective, whole and as factors (ipc's bytes are its handles': not reported)."""
    row = {}
    for kind in ("ipc", "collective"):
        whole, factors = out[kind], out[f"{kind}_adapter"]
        row[f"{kind}_full_load_s"] = round(med(whole, "load_s"), 3)
        row[f"{kind}_adapter_load_s"] = round(med(factors, "load_s"), 3)
        row[f"load_speedup_{kind}_adapter"] = round(med(whole, "load_s") / med(factors, "load_s"), 2)
    row["collective_full_bytes_mb"] = round(med(out["collective"], "bytes") / 1e6, 1)
    row["collective_adapter_bytes_mb"] = round(med(out["collective_adapter"], "bytes") / 1e6, 3)
    return row
