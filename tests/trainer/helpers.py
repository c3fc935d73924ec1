import torch

from trainer.batch import TrainBatch, batch_from_sequences


def toy_batch(num_groups: int = 4, group_size: int = 4, seed: int = 0, vocab: int = 250) -> TrainBatch:
    """Prompt + response sequences of varied lengths with 0/1 rewards (never all equal in a group)."""
    g = torch.Generator().manual_seed(seed)
    seqs, masks, behav, rewards, gids = [], [], [], [], []
    for gi in range(num_groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
        for k in range(group_size):
            resp = torch.randint(3, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            seqs.append(prompt + resp)
            masks.append([0.0] * len(prompt) + [1.0] * len(resp))
            behav.append([0.0] * len(prompt) + (-torch.rand(len(resp), generator=g) * 5 - 0.5).tolist())
            rewards.append(float(k == 0 or (k == 2 and gi % 2)))
            gids.append(gi)
    width = max(map(len, seqs))
    pad = lambda rows: torch.tensor([r + [0.0] * (width - len(r)) for r in rows])  # noqa: E731
    return batch_from_sequences(seqs, pad(masks), pad(behav), torch.tensor(rewards), torch.tensor(gids))


def random_routing(batch: TrainBatch, shape, seed: int = 0) -> TrainBatch:
    """``batch`` with made-up routing for every trajectory (each position's ``top_k`` distinct experts
    per MoE layer, SGLang's layout: 0 in dense layers), as an engine with other numerics might route."""
    import numpy as np

    rng = np.random.default_rng(seed)
    experts = []
    for seq in batch.sequences:
        ids = np.zeros((len(seq) - 1, shape.layers, shape.top_k), dtype=np.uint8)
        for layer in shape.moe_layers:
            ids[:, layer] = rng.random((len(seq) - 1, shape.num_experts)).argsort(-1)[:, : shape.top_k]
        experts.append(ids.reshape(len(seq) - 1, -1))
    batch.routed_experts = experts
    return batch
