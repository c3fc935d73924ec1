"""`rollmesh bench trainer`: GRPO optimizer steps, packed vs unpacked, in tokens/s and MFU.

Each step trains on 256 trajectories (32 prompts × 8) of 32–96 tokens (~64 on average), the
second half of each generated. Unpacked micro-batches pad every row to its longest member;
packed ones concatenate trajectories into short rows with block-diagonal attention.

``--shape qwen2-0.5b`` builds a randomly initialised model of Qwen2-0.5B's shape (nothing is
downloaded) for a GPU (``--device cuda --mixed-precision``). Model FLOPs utilisation counts
6 × parameters per trained token (forward and backward; the step's extra no-grad forward for
π_prox is not counted) against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import resource
import time

import torch

from trainer.batch import TrainBatch, batch_from_sequences
from trainer.config import TrainerConfig
from trainer.engine import TrainEngine


def make_batch(num_groups: int, group_size: int, vocab: int, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    seqs, masks, behav, rewards, gids = [], [], [], [], []
    for gi in range(num_groups):
        prompt_len = int(torch.randint(16, 48, (1,), generator=g))
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for k in range(group_size):
            n = int(torch.randint(16, 48, (1,), generator=g))
            seqs.append(prompt + torch.randint(3, vocab, (n,), generator=g).tolist())
            masks.append([0.0] * prompt_len + [1.0] * n)
            behav.append([0.0] * prompt_len + (-torch.rand(n, generator=g) * 4).tolist())
            rewards.append(float(k % 2))
            gids.append(gi)
    width = max(map(len, seqs))
    pad = lambda rows: torch.tensor([r + [0.0] * (width - len(r)) for r in rows])  # noqa: E731
    return batch_from_sequences(seqs, pad(masks), pad(behav), torch.tensor(rewards), torch.tensor(gids))


# Dense bf16 peak FLOP/s by GPU name (the vendors' data sheets; sparsity not counted).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def _run(model_path: str, pack: bool, steps: int, trajectories: int, **trainer) -> tuple[float, int, TrainEngine]:
    engine = TrainEngine(
        TrainerConfig(model_path=model_path, lr=1e-5, pack_sequences=pack, micro_batch_tokens=4096, **trainer)
    )
    vocab = engine.model.config.vocab_size
    batches = [make_batch(trajectories // 8, 8, vocab, seed) for seed in range(steps + 1)]
    engine.train_step(batches[-1])  # warm-up
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens = 0
    t0 = time.perf_counter()
    for b in batches[:steps]:
        engine.train_step(b)
        tokens += b.num_tokens
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens, engine


def run(
    model_path: str | None,
    steps: int = 20,
    trajectories: int = 256,
    shape: str = "tiny",
    device: str = "auto",
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    progress=print,
) -> dict:
    """Time ``steps`` steps unpacked and packed; ``model_path`` None builds a random model of ``shape``."""
    import tempfile

    from launch.bench import BadOption
    from trainer.tiny_model import SHAPES, build_tiny_model, count_parameters

    if shape not in SHAPES:
        raise BadOption(f"--shape: one of {sorted(SHAPES)}, got {shape!r}")
    for name, value in (("steps", steps), ("trajectories", trajectories)):
        if value < 1:
            raise BadOption(f"--{name}: must be >= 1, got {value}")
    trainer = {
        "device": device,
        "mixed_precision": {} if mixed_precision else None,
        "activation_checkpointing": activation_checkpointing,
    }
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-trainer-") as tmp:
        if model_path is None:
            progress(f"building a random {shape}-shaped model")
            model_path = str(build_tiny_model(tmp, SHAPES[shape]))
        progress(f"unpacked: {steps} step(s) of {trajectories} trajectories")
        unpacked_s, tokens, engine = _run(model_path, False, steps, trajectories, **trainer)
        del engine
        progress(f"packed: {steps} step(s)")
        packed_s, _, engine = _run(model_path, True, steps, trajectories, **trainer)
    params = count_parameters(engine.model)
    best = min(packed_s, unpacked_s)
    peak = peak_flops(engine.device)
    return {
        "shape": shape,
        "params_m": round(params / 1e6, 1),
        "device": str(engine.device)
        + (f" ({torch.cuda.get_device_name(engine.device)})" if engine.device.type == "cuda" else ""),
        "mixed_precision": mixed_precision,
        "activation_checkpointing": activation_checkpointing,
        "steps": steps,
        "trajectories_per_step": trajectories,
        "tokens_per_step": tokens // steps,
        "packed_s_per_step": round(packed_s / steps, 3),
        "unpacked_s_per_step": round(unpacked_s / steps, 3),
        "train_tokens_per_s": round(tokens / packed_s, 1),
        "unpacked_tokens_per_s": round(tokens / unpacked_s, 1),
        "packing_speedup": round(unpacked_s / packed_s, 3),
        "mfu": None if peak is None else round(6 * params * tokens / best / peak, 4),
        "peak_gpu_mem_gb": round(torch.cuda.max_memory_allocated(engine.device) / 1e9, 2)
        if engine.device.type == "cuda"
        else None,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
