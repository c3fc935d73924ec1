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
