"""Numbers summed or maximised over the trainer's ranks under ``torchrun`` (a no-op in one process):
loss normalisers, micro-batch counts, mismatch statistics."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(x: float, op=None) -> float:
    if world()[1] == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return float(t.item())


def all_reduce_all(xs: list[float]) -> list[float]:
    """Sums over the ranks of several numbers in one collective."""
    if world()[1] == 1:
        return xs
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_dict(stats: dict[str, float]) -> dict[str, float]:
    """Per-rank mismatch statistics made global: token-weighted means, maxima, token counts."""
    if world()[1] == 1:
        return stats
    out = {}
    for name in ("fresh", "stale"):  # every rank takes part in every collective, with or without tokens
        n = stats.get(f"mismatch_{name}_tokens", 0.0)
        total = all_reduce(n)
        mean_sum, kl_sum = all_reduce_all(
            [stats.get(f"mismatch_{name}_mean", 0.0) * n, stats.get(f"kl_behavior_{name}", 0.0) * n]
        )
        top = all_reduce(stats.get(f"mismatch_{name}_max", 0.0), dist.ReduceOp.MAX)
        if total:
            out |= {
                f"mismatch_{name}_mean": mean_sum / total,
                f"mismatch_{name}_max": top,
                f"mismatch_{name}_tokens": total,
                f"kl_behavior_{name}": kl_sum / total,
            }
    return out
