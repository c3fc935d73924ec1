"""`rollmesh bench trainer`: GRPO optimizer steps on the tiny model, packed vs unpacked.

Each step trains on 256 trajectories (32 prompts × 8) of 32–96 tokens (~64 on average), the
second half of each generated. Unpacked micro-batches pad every row to its longest member;
packed ones concatenate trajectories into short rows with block-diagonal attention.
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


def _run(model_path: str, pack: bool, steps: int, trajectories: int) -> tuple[float, int]:
    engine = TrainEngine(TrainerConfig(model_path=model_path, lr=1e-5, pack_sequences=pack, micro_batch_tokens=4096))
    vocab = engine.model.config.vocab_size
    batches = [make_batch(trajectories // 8, 8, vocab, seed) for seed in range(steps + 1)]
    engine.train_step(batches[-1])  # warm-up
    tokens = 0
    t0 = time.perf_counter()
    for b in batches[:steps]:
        engine.train_step(b)
        tokens += b.num_tokens
    return time.perf_counter() - t0, tokens


def run(model_path: str, steps: int = 20, trajectories: int = 256) -> dict:
    unpacked_s, tokens = _run(model_path, False, steps, trajectories)
    packed_s, _ = _run(model_path, True, steps, trajectories)
    return {
        "steps": steps,
        "trajectories_per_step": trajectories,
        "tokens_per_step": tokens // steps,
        "packed_s_per_step": round(packed_s / steps, 3),
        "unpacked_s_per_step": round(unpacked_s / steps, 3),
        "train_tokens_per_s": round(tokens / packed_s, 1),
        "unpacked_tokens_per_s": round(tokens / unpacked_s, 1),
        "packing_speedup": round(unpacked_s / packed_s, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
