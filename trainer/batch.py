"""From groups of trajectories to the padded tensors the trainer's math works on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sample_buffer.trajectory import Group


@dataclass
class TrainBatch:
    """``B`` trajectories. Per-token tensors are [B, T], right-padded, aligned to ``token_ids``:
    position t holds what belongs to token t (its behaviour log-prob if the policy generated it)."""

    sequences: list[list[int]]  # token ids per trajectory, unpadded
    loss_mask: torch.Tensor  # [B, T] float
    behavior_logprobs: torch.Tensor  # [B, T] float, 0 where loss_mask is 0
    rewards: torch.Tensor  # [B] float
    group_ids: torch.Tensor  # [B] long: trajectories of one prompt share an id

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def select(self, rows: list[int]) -> TrainBatch:
        width = max(len(self.sequences[r]) for r in rows)
        return TrainBatch(
            [self.sequences[r] for r in rows],
            self.loss_mask[rows, :width],
            self.behavior_logprobs[rows, :width],
            self.rewards[rows],
            self.group_ids[rows],
        )


def batch_from_groups(groups: list[Group]) -> TrainBatch:
    trajs = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories]
    if not trajs:
        raise ValueError("groups: no trajectories to train on")
    width = max(len(t.token_ids) for _, t in trajs)
    mask = torch.zeros(len(trajs), width)
    behav = torch.zeros(len(trajs), width)
    for i, (_, t) in enumerate(trajs):
        n = len(t.token_ids)
        m = torch.from_numpy(t.loss_mask.astype(np.float32))
        mask[i, :n] = m
        behav[i, :n][m > 0] = torch.from_numpy(t.behavior_logprobs.astype(np.float32))
    return TrainBatch(
        sequences=[t.token_ids.tolist() for _, t in trajs],
        loss_mask=mask,
        behavior_logprobs=behav,
        rewards=torch.tensor([t.reward for _, t in trajs], dtype=torch.float32),
        group_ids=torch.tensor([gi for gi, _ in trajs], dtype=torch.long),
    )
