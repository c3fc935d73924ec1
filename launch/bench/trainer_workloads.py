"""`rollmesh bench trainer --workload`: training steps unpacked, packed and tree-packed, side by side.

Three shapes of batch, random token ids on a random tiny-shaped model (or ``--model``):

- ``grpo``: groups of 16 answers of 256 tokens to one 1,024-token prompt;
- ``agent``: 4-turn agent sessions (a 256-token task, then turns of 64 generated and 128
  environment tokens) that fork in two at the second turn and again at the third: 4 trajectories
  per session, trained as one group;
- ``quickstart``: the quickstart's 16 groups of 8 one-token answers to 22–25-token prompts.

Each layout runs in its own process (its peak RSS is its own). Tokens/s counts every trajectory's
tokens, so the three are comparable; FLOPs count the work each layout must do at least: 6 ×
parameters per computed token plus attention's 12 × width × layers per visible key (a token at
position p sees p + 1 keys, in its sequence or its path of the tree), forward and backward.
"""

from __future__ import annotations

import multiprocessing
import resource
import time

import torch

from trainer.batch import TrainBatch, batch_from_sequences

WORKLOADS = ("grpo", "agent", "quickstart")
LAYOUTS = {
    "unpacked": {"pack_sequences": False},
    "packed": {"pack_sequences": True},
    "tree": {"pack_sequences": True, "tree_packing": True},
}


def _ids(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _batch(groups: list[list[tuple[list[int], list[float]]]]) -> TrainBatch:
    """A batch from groups of (tokens, loss mask) with made-up behaviour log-probs and 0/1 rewards."""
    seqs = [s for g in groups for s, _ in g]
    width = max(map(len, seqs))
    mask = torch.zeros(len(seqs), width)
    for i, (_, m) in enumerate(t for g in groups for t in g):
        mask[i, : len(m)] = torch.tensor(m)
    behav = -torch.rand(len(seqs), width) * mask
    rewards = torch.tensor([float(i % 2) for i in range(len(seqs))])
    gids = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
    return batch_from_sequences(seqs, mask, behav, rewards, gids)


def grpo_batch(seed: int, vocab: int, groups: int = 2, size: int = 16, prompt: int = 1024, answer: int = 256):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        p = _ids(g, prompt, vocab)
        out.append([(p + _ids(g, answer, vocab), [0.0] * prompt + [1.0] * answer) for _ in range(size)])
    return _batch(out)


def agent_batch(seed: int, vocab: int, sessions: int = 8, task: int = 256, said: int = 64, heard: int = 128):
    """Sessions as prefix trees: one path through turn 1, two from turn 2, four from turn 3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(sessions):
        paths = [(_ids(g, task, vocab), [0.0] * task)]
        for turn in range(4):
            if turn in (1, 2):  # the session forks: each path goes on two ways
                paths = [(list(s), list(m)) for s, m in paths for _ in range(2)]
            for s, m in paths:
                s += _ids(g, said + heard, vocab)
                m += [1.0] * said + [0.0] * heard
        out.append(paths)
    return _batch(out)


def quickstart_batch(seed: int, vocab: int, groups: int = 16, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        p = _ids(g, int(torch.randint(22, 26, (1,), generator=g)), vocab)
        out.append([(p + _ids(g, 1, vocab), [0.0] * len(p) + [1.0]) for _ in range(size)])
    return _batch(out)


BUILDERS = {"grpo": grpo_batch, "agent": agent_batch, "quickstart": quickstart_batch}
GROUP_SIZE = {"grpo": 16, "agent": 4, "quickstart": 8}  # trajectories per group (an agent session's four paths)


def build(workload: str, seed: int, vocab: int, groups: int | None = None) -> TrainBatch:
    """A step's batch of ``workload``: ``groups`` groups (sessions), or the workload's default."""
    return BUILDERS[workload](seed, vocab, *(() if groups is None else (groups,)))


def work(batch: TrainBatch, layout: str, params: int, layers: int, width: int) -> dict:
    """Tokens each layout computes and the FLOPs they take at least (see the module's docstring)."""
    from trainer.prefix_tree import build_layout

    seqs = [s.tolist() for s in batch.sequences]
    if layout == "tree":
        groups: dict[int, list] = {}
        for s, gid in zip(seqs, batch.group_ids.tolist()):
            groups.setdefault(gid, []).append(s)
        positions = torch.cat([build_layout(g, max(map(len, g))).positions for g in groups.values()])
    else:
        positions = torch.cat([torch.arange(len(s)) for s in seqs])
    tokens, keys = len(positions), int((positions + 1).sum())
    return {"tokens": tokens, "flops": 6 * params * tokens + 12 * layers * width * keys}


def _measure(model_path: str, workload: str, layout: str, steps: int, groups: int | None, micro: int, queue) -> None:
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    engine = TrainEngine(TrainerConfig(model_path=model_path, lr=1e-5, micro_batch_tokens=micro, **LAYOUTS[layout]))
    vocab = engine.model.config.vocab_size
    batches = [build(workload, seed, vocab, groups) for seed in range(steps + 1)]
    engine.train_step(batches[-1])  # warm-up
    tokens = 0
    t0 = time.perf_counter()
    for b in batches[:steps]:
        engine.train_step(b)
        tokens += b.num_tokens
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"seconds": seconds, "tokens": tokens, "peak_rss_mb": round(rss, 1)})


def _result(proc, queue) -> dict:
    """What the layout's process reports; its failure (a crash, no answer) is an error, not a hang."""
    import queue as queues

    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queues.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the measuring process ended with exit code {proc.exitcode}") from None
    proc.join(timeout=60)
    return result


def _groups(batch: TrainBatch) -> list[TrainBatch]:
    ids = batch.group_ids.tolist()
    return [batch.select([i for i, g in enumerate(ids) if g == gid]) for gid in sorted(set(ids))]


def run(
    workloads: list[str],
    steps: int = 2,
    progress=print,
    model_path: str | None = None,
    trajectories: int | None = None,
) -> dict:
    """Each workload's ``steps`` timed steps (after one warm-up) under each layout, in a fresh
    process, on ``model_path`` (default: a random tiny-shaped model) with ``trajectories`` per step
    (rounded down to whole groups; default: each workload's own)."""
    import tempfile
    from pathlib import Path

    from launch.bench import BadOption
    from trainer.tiny_model import SHAPES, build_tiny_model, count_parameters

    for w in workloads:
        if w not in WORKLOADS:
            raise BadOption(f"--workload: one of {', '.join(WORKLOADS)} or all, got {w!r}")
    if steps < 1:
        raise BadOption(f"--steps: must be >= 1, got {steps}")
    for w in workloads if trajectories is not None else ():
        if trajectories < GROUP_SIZE[w]:
            raise BadOption(f"--trajectories: {w} trains groups of {GROUP_SIZE[w]}, got {trajectories}")
    if model_path is not None and not Path(model_path, "config.json").is_file():
        raise BadOption(f"--model: {model_path} holds no model (config.json)")
    ctx = multiprocessing.get_context("spawn")
    out: dict = {"threads": torch.get_num_threads(), "steps": steps}
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-workloads-") as tmp:
        built = model_path is None
        if built:
            shape = SHAPES["tiny"].model_copy(update={"max_position_embeddings": 2048})
            progress("building a random tiny-shaped model (2,048 positions)")
            model_path = str(build_tiny_model(tmp, shape))
        out["model"] = model_path
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_path)
        params = count_parameters(AutoModelForCausalLM.from_config(config))
        for w in workloads:
            groups = None if trajectories is None else trajectories // GROUP_SIZE[w]
            sample = build(w, 0, config.vocab_size, groups)
            # 8,192 tokens per micro-batch on the tiny model; on a given one, a group's tree (whole,
            # or its prompt would be computed again) and no more: a 49k vocabulary's logits of 8k
            # tokens and their gradients did not fit 24 GiB beside SmolLM2's activations.
            micro = 8192 if built else max(work(g, "tree", 1, 1, 1)["tokens"] for g in _groups(sample))
            row: dict = {"trajectories_per_step": len(sample.sequences), "tokens_per_step": sample.num_tokens}
            for layout in LAYOUTS:
                progress(f"{w}: {layout}, {steps} step(s)")
                queue = ctx.Queue()
                proc = ctx.Process(target=_measure, args=(model_path, w, layout, steps, groups, micro, queue))
                proc.start()
                result = _result(proc, queue)
                done = work(sample, layout, params, config.num_hidden_layers, config.hidden_size)
                row["micro_batch_tokens"] = micro
                row[layout] = {
                    "tokens_per_s": round(result["tokens"] / result["seconds"], 1),
                    "s_per_step": round(result["seconds"] / steps, 3),
                    "computed_tokens_per_step": done["tokens"],
                    "gflops_per_step": round(done["flops"] / 1e9, 2),
                    "peak_rss_mb": result["peak_rss_mb"],
                }
                progress(f"  {row[layout]}")
            base = row["unpacked"]
            row["packed_speedup"] = round(row["packed"]["tokens_per_s"] / base["tokens_per_s"], 2)
            row["tree_speedup"] = round(row["tree"]["tokens_per_s"] / base["tokens_per_s"], 2)
            row["tree_flop_reduction"] = round(base["gflops_per_step"] / row["tree"]["gflops_per_step"], 2)
            out[w] = row
            out[f"{w}_tree_speedup"] = row["tree_speedup"]
            out[f"{w}_packed_speedup"] = row["packed_speedup"]
    return out
