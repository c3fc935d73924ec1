"""From groups of trajectories to the tensors the trainer's math works on.

The decoded numpy arrays go straight into tensors: token ids are one flat tensor with row
offsets (no Python list per trajectory), the per-token tensors are [B, T], right-padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from sample_buffer.trajectory import FinishReason, Group
from trainer.grammar_masks import constrained_spans


@dataclass
class TrainBatch:
    """``B`` trajectories. Per-token tensors are [B, T], right-padded, aligned to the token ids:
    position t holds what belongs to token t (its behaviour log-prob if the policy generated it)."""

    token_ids: torch.Tensor  # [N] long: every trajectory's tokens, one after the other
    offsets: list[int]  # [B + 1]: trajectory i is token_ids[offsets[i] : offsets[i + 1]]
    loss_mask: torch.Tensor  # [B, T] float
    behavior_logprobs: torch.Tensor  # [B, T] float, 0 where loss_mask is 0
    rewards: torch.Tensor  # [B] float
    group_ids: torch.Tensor  # [B] long: trajectories of one prompt share an id
    # [B, T] long: the policy version that sampled each generated token, -1 elsewhere (None: unknown)
    token_versions: torch.Tensor | None = None
    # [B, T] float: the temperature each token was sampled at (μ is at it; so must π be): a turn's
    # over its tokens (and the environment's after it, masked), 1 before the first turn and for
    # greedy turns (the engines report those at 1). None: all 1.
    temperatures: torch.Tensor | None = None
    # Per trajectory: the engine's experts per position (MoE routing replay, ``trainer/routing.py``);
    # None: no trajectory has any.
    routed_experts: list[np.ndarray | None] | None = None
    # Per trajectory: its images' encoded bytes, in the order of their placeholders in its tokens
    # (a vision-language model's; the trainer's ``Vision`` makes pixels of them). None: no images.
    images: list[tuple[bytes, ...]] | None = None
    # Per trajectory: its turns decoded under a grammar, ``(start, end, field, text)`` (the generated
    # tokens in [start, end) were sampled from a masked distribution; ``trainer/grammar_masks.py``).
    # None: no trajectory has any.
    grammar_spans: list[list[tuple[int, int, str, str]]] | None = None
    # [B, T] long: which grammar (1 + its index among the batch's) sampled each constrained token, 0
    # elsewhere: tree packing shares a token only where its mask is shared too.
    grammar_tags: torch.Tensor | None = None
    # Per trajectory: its constrained tokens' masks (``RowMasks``), replayed by the trainer once per batch.
    grammar_masks: list | None = None
    # [B, T] float: a teacher's log-prob of each generated token, 0 elsewhere and on rows no teacher
    # scored (``taught`` [B] bool says which; on-policy distillation). None: no row has any.
    teacher_logprobs: torch.Tensor | None = None
    taught: torch.Tensor | None = None
    # [B, T, k] long and float: the teacher's k most likely tokens at each generated token's position and
    # their log-probs (−inf pads a row of a smaller k; 0s where none: ``topped`` [B] bool says which rows
    # have them). None: no row has any.
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None
    topped: torch.Tensor | None = None

    @cached_property
    def sequences(self) -> list[torch.Tensor]:
        """Each trajectory's token ids (views into ``token_ids``)."""
        o = self.offsets
        return [self.token_ids[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1] - self.offsets[0]

    def select(self, rows: list[int]) -> TrainBatch:
        seqs = self.sequences
        width = max(len(seqs[r]) for r in rows)
        ids, offsets = _flat([seqs[r] for r in rows])
        versions = None if self.token_versions is None else self.token_versions[rows, :width]
        temps = None if self.temperatures is None else self.temperatures[rows, :width]
        experts = None if self.routed_experts is None else [self.routed_experts[r] for r in rows]
        images = None if self.images is None else [self.images[r] for r in rows]
        spans = None if self.grammar_spans is None else [self.grammar_spans[r] for r in rows]
        tags = None if self.grammar_tags is None else self.grammar_tags[rows, :width]
        masks = None if self.grammar_masks is None else [self.grammar_masks[r] for r in rows]
        teacher = None if self.teacher_logprobs is None else self.teacher_logprobs[rows, :width]
        taught = None if self.taught is None else self.taught[rows]
        top = [None if x is None else x[rows, :width] for x in (self.teacher_top_ids, self.teacher_top_logprobs)]
        return TrainBatch(
            ids,
            offsets,
            self.loss_mask[rows, :width],
            self.behavior_logprobs[rows, :width],
            self.rewards[rows],
            self.group_ids[rows],
            versions,
            temps,
            experts,
            images,
            spans,
            tags,
            masks,
            teacher,
            taught,
            *top,
            None if self.topped is None else self.topped[rows],
        )


def _offsets(lengths: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()


def _flat(seqs: list) -> tuple[torch.Tensor, list[int]]:
    offsets = _offsets([len(s) for s in seqs])
    ids = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long)
    return ids, offsets


def batch_from_groups(groups: list[Group]) -> TrainBatch:
    trajs = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories]
    if not trajs:
        raise ValueError("groups: no trajectories to train on")
    lengths = [len(t.token_ids) for _, t in trajs]
    width = max(lengths)
    mask = torch.zeros(len(trajs), width)
    behav = torch.zeros(len(trajs), width)
    versions = torch.full((len(trajs), width), -1, dtype=torch.long)
    temps = torch.ones(len(trajs), width)
    spans = [constrained_spans(t.metadata, t.loss_mask, len(t.token_ids)) for _, t in trajs]
    tags = torch.zeros(len(trajs), width, dtype=torch.long)
    taught = torch.tensor([t.teacher_logprobs is not None for _, t in trajs])
    teacher = torch.zeros(len(trajs), width) if bool(taught.any()) else None
    topped = torch.tensor([t.teacher_top_ids is not None for _, t in trajs])
    k = max((t.teacher_top_ids.shape[1] for _, t in trajs if t.teacher_top_ids is not None), default=0)
    top_ids = torch.zeros(len(trajs), width, k, dtype=torch.long) if k else None
    top_lps = torch.zeros(len(trajs), width, k) if k else None
    grammar_ids: dict[tuple[str, str], int] = {}
    for i, (_, t) in enumerate(trajs):
        m = torch.from_numpy(t.loss_mask.astype(np.float32))
        mask[i, : len(m)] = m
        behav[i, : len(m)][m > 0] = torch.from_numpy(t.behavior_logprobs.astype(np.float32))
        versions[i, : len(m)][m > 0] = torch.from_numpy(t.token_versions.astype(np.int64))
        _fill_temperatures(temps[i, : len(m)], t.metadata)
        if teacher is not None and t.teacher_logprobs is not None:
            teacher[i, : len(m)][m > 0] = torch.from_numpy(t.teacher_logprobs.astype(np.float32))
        if top_ids is not None and t.teacher_top_ids is not None:
            k = t.teacher_top_ids.shape[1]
            top_ids[i, : len(m)][m > 0, :k] = torch.from_numpy(t.teacher_top_ids.astype(np.int64))
            top_lps[i, : len(m)][m > 0] = float("-inf")
            top_lps[i, : len(m)][m > 0, :k] = torch.from_numpy(t.teacher_top_logprobs.astype(np.float32))
        for start, end, field, text in spans[i]:
            tag = grammar_ids.setdefault((field, text), len(grammar_ids) + 1)
            tags[i, start:end] = m[start:end].long() * tag
    return TrainBatch(
        token_ids=torch.from_numpy(np.concatenate([t.token_ids for _, t in trajs]).astype(np.int64)),
        offsets=_offsets(lengths),
        loss_mask=mask,
        behavior_logprobs=behav,
        rewards=torch.tensor([t.reward for _, t in trajs], dtype=torch.float32),
        group_ids=torch.tensor([gi for gi, _ in trajs], dtype=torch.long),
        token_versions=versions,
        temperatures=None if bool((temps == 1).all()) else temps,
        routed_experts=None
        if all(t.routed_experts is None for _, t in trajs)
        else [t.routed_experts for _, t in trajs],
        images=None
        if not any(t.images for _, t in trajs)
        else [tuple(groups[gi].images[h] for h in t.images) for gi, t in trajs],
        grammar_spans=spans if grammar_ids else None,
        grammar_tags=tags if grammar_ids else None,
        teacher_logprobs=teacher,
        taught=taught if teacher is not None else None,
        teacher_top_ids=top_ids,
        teacher_top_logprobs=top_lps,
        topped=topped if k else None,
    )


GREEDY_BELOW = 1e-6  # as the engines: a temperature below it is greedy, its log-probs reported at 1


def _fill_temperatures(row: torch.Tensor, metadata: dict) -> None:
    """Each turn's sampling temperature over its tokens, from ``turn_starts`` and
    ``turn_temperatures`` (a trajectory without them was sampled at 1; the buffer checked both
    when the group was put: ``Trajectory.validate``)."""
    starts, temps = metadata.get("turn_starts"), metadata.get("turn_temperatures")
    if not starts or not temps:
        return
    for k, (start, temp) in enumerate(zip(starts, temps, strict=True)):
        end = starts[k + 1] if k + 1 < len(starts) else len(row)
        row[start:end] = temp if temp >= GREEDY_BELOW else 1.0


def batch_from_sequences(seqs: list, loss_mask, behavior_logprobs, rewards, group_ids) -> TrainBatch:
    """A batch from token-id sequences (lists or tensors) and ready [B, T] / [B] tensors."""
    ids, offsets = _flat(seqs)
    return TrainBatch(ids, offsets, loss_mask, behavior_logprobs, rewards, group_ids)


def episode_stats(groups: list[Group]) -> dict[str, float]:
    """What the batch's episodes looked like, for the step's metrics: turns per episode, generated
    tokens per turn and, where
    the episodes ran under a latency penalty (``turns_over_target`` in their metadata), the share
    of their turns that took longer than its target (the number a latency-aware policy lowers)."""
    trajs = [t for g in groups for t in g.trajectories]
    turns = [len(t.metadata.get("turn_starts", ())) for t in trajs]
    out = {"turns_mean": sum(turns) / len(turns)} if trajs else {}
    if sum(turns):  # how long the policy talks per turn: what a latency-aware policy shortens
        out["tokens_per_turn"] = float(sum(int(np.sum(t.loss_mask)) for t in trajs)) / sum(turns)
    timed = [
        (t.metadata["turns_over_target"], n)
        for t, n in zip(trajs, turns, strict=True)
        if "turns_over_target" in t.metadata
    ]
    if timed and sum(n for _, n in timed):
        out["turns_over_target_share"] = sum(o for o, _ in timed) / sum(n for _, n in timed)
    return out


# A step's numbers per task domain, in the step line as "domain/<name>/<key>" (trackers group them by
# the prefix): what each domain contributed and how it is doing.
DOMAIN_KEYS = ("groups", "reward_mean", "accuracy", "response_tokens", "truncated_share", "staleness_mean", "tokens")


def domain_stats(groups: list[Group], version: int) -> dict[str, float]:
    """Each named domain's share of the batch (``groups``, ``tokens`` trained), its mean reward,
    ``accuracy`` (share of answers with reward >= 1, the held-out rule), mean generated tokens per
    answer, share cut at max_new_tokens and staleness. A run of one task (domain '') has none."""
    out: dict[str, float] = {}
    for name in sorted({g.domain for g in groups if g.domain}):
        trajs = [t for g in groups if g.domain == name for t in g.trajectories]
        generated = [t.num_generated for t in trajs]
        values = {
            "groups": sum(g.domain == name for g in groups),
            "reward_mean": sum(t.reward for t in trajs) / len(trajs),
            "accuracy": sum(t.reward >= 1.0 for t in trajs) / len(trajs),
            "response_tokens": sum(generated) / len(trajs),
            "truncated_share": sum(t.finish_reason == FinishReason.LENGTH for t in trajs) / len(trajs),
            "staleness_mean": sum(version - t.start_version for t in trajs) / len(trajs),
            "tokens": sum(generated),
        }
        out |= {f"domain/{name}/{k}": float(values[k]) for k in DOMAIN_KEYS}
    return out
