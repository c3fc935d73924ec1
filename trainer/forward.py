"""The training engine's forward passes: per-token log-probs (and entropies) of packed, padded or
tree-packed micro-batches, each token at its sampling temperature, with MoE routing replay, a
vision-language model's images, and a constrained token's logits masked to what its grammar
allowed (replayed once per batch, ``replay_grammars``). What the engines reported as μ, π is
scored the same way."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import NamedTuple

import torch
import torch.distributed as dist

from trainer.batch import TrainBatch
from trainer.collectives import all_reduce
from trainer.grammar_masks import GrammarReplay, ReplayError, RowMasks, mask_logits
from trainer.losses import entropy_from_logits
from trainer.packing import padded_inputs, plan_micro_batches, scale_by_temperature, scaled_logprobs
from trainer.prefix_tree import build_layout, tree_tokens
from trainer.routing import RoutingReplay, replay_ids
from trainer.varlen import KWARG, plan_attention

log = logging.getLogger(__name__)


def row_inputs(batch: TrainBatch, rows: list[int]) -> tuple:
    """What a forward of ``rows`` takes beyond their tokens: temperatures, experts, images, grammar
    masks and grammar tags (each None where no row of the batch has any)."""
    return (
        _temperatures(batch, rows),
        _experts(batch, rows),
        _images(batch, rows),
        _grammar_masks(batch, rows),
        _grammar_tags(batch, rows),
    )


def _temperatures(batch: TrainBatch, rows: list[int]) -> torch.Tensor | None:
    """The sampling temperatures of ``rows`` (None: all sampled at 1)."""
    return None if batch.temperatures is None else batch.temperatures[rows]


def _experts(batch: TrainBatch, rows: list[int]) -> list | None:
    """Each of ``rows``' recorded experts (None: no trajectory has any)."""
    return None if batch.routed_experts is None else [batch.routed_experts[r] for r in rows]


def _images(batch: TrainBatch, rows: list[int]) -> list | None:
    """Each of ``rows``' images (None: no trajectory has any)."""
    return None if batch.images is None else [batch.images[r] for r in rows]


def _grammar_masks(batch: TrainBatch, rows: list[int]) -> list | None:
    """The constrained tokens' masks of ``rows`` (None: no row was decoded under a grammar)."""
    return None if batch.grammar_masks is None else [batch.grammar_masks[r] for r in rows]


def _grammar_tags(batch: TrainBatch, rows: list[int]) -> torch.Tensor | None:
    return None if batch.grammar_tags is None else batch.grammar_tags[rows]


def _mask_places(masks: list[RowMasks | None], place, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of a forward's [N, V] logits that predict constrained tokens (``place(i, positions)``
    says where sequence i's tokens are predicted) and each one's bitmask; None: nothing to mask."""
    index, bits = [], []
    for i, m in enumerate(masks or ()):
        if m is None or not len(m.positions):
            continue
        keep = m.positions < lengths[i]  # a sequence cut at the model's positions: its tail is not computed
        index.append(place(i, m.positions[keep]))
        bits.append(m.bits[keep])
    if not index:
        return None
    return torch.cat(index), torch.cat(bits)


class Forward(NamedTuple):
    """A forward's [b, width] log-probs of the tokens; their entropies when asked; the log-probs of
    each position's candidate tokens when given ([b, width, k]: a teacher's top-k)."""

    lp: torch.Tensor
    ent: torch.Tensor | None = None
    top: torch.Tensor | None = None


class Forwards:
    """Mixin of ``TrainEngine`` (its model, device, config, routing replay and grammar replay)."""

    def _forward(
        self,
        model,
        seqs: list[list[int]],
        width: int,
        entropy: bool = False,
        temps=None,
        experts=None,
        images=None,
        masks=None,
        tags=None,
        top_ids=None,
    ) -> Forward:
        """Per-token log-probs (and entropies) of ``seqs``: [b, width], aligned to the tokens, each
        at its sampling temperature (``temps`` [b, width]; None: 1), as the engines report μ; with
        routing replay, each sequence's MoE layers use its ``experts`` (a list aligned to ``seqs``);
        a vision-language policy sees each sequence's ``images`` (a list aligned to ``seqs``);
        a constrained token's distribution is masked to what its grammar allowed (``masks``, a list
        of ``RowMasks`` aligned to ``seqs``; ``tags``: their grammar tags, for tree packing); with
        ``top_ids`` ([b, width, k] token ids), also the log-probs of each position's k candidates. An
        empty ``seqs`` (a rank's filler micro-batch) runs one dummy token and returns [0, width]
        tensors still attached to the graph, so its backward joins the collectives."""
        replay = self.replay.get(id(model))
        if replay is not None:
            replay.set(None)  # until this forward's ids are laid out below
        if not seqs:
            with self._compute_precision():
                dummy = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device)).logits
            zero = dummy.sum() * 0.0
            lp = torch.zeros(0, width, device=self.device) + zero
            ent = torch.zeros(0, width, device=self.device) + zero if entropy else None
            top = None if top_ids is None else torch.zeros(0, width, top_ids.shape[-1], device=self.device) + zero
            return Forward(lp, ent, top)
        if (limit := self._max_positions(model)) is not None:  # past it, positions the model never saw:
            seqs = [s[:limit] for s in seqs]  # not computed (train_step does not train on such a trajectory)
        if self.config.pack_sequences:
            return self._packed_forward(
                model, seqs, width, entropy, temps, experts, images, replay, masks, tags, top_ids
            )
        ids, attn = padded_inputs(seqs, self.device)
        if replay is not None and experts is not None:
            replay.set(self._replay_ids(experts, {i: (i, 0) for i in range(len(seqs))}, ids.shape, replay))
        extra = self._vision_inputs(model, seqs, images, {i: (i, 0) for i in range(len(seqs))}, ids.shape)
        with self._compute_precision():
            logits = model(input_ids=ids, attention_mask=attn, **extra).logits
        temps = None if temps is None else temps[:, : ids.shape[1]]
        scaled = scale_by_temperature(logits, temps)
        b, n, v = scaled.shape
        # token p of sequence i is predicted at flat row i·n + p − 1
        if (masked := _mask_places(masks, lambda i, p: i * n + p - 1, [len(x) for x in seqs])) is not None:
            scaled = mask_logits(scaled.reshape(b * n, v), *(t.to(self.device) for t in masked)).view(b, n, v)
        candidates = None if top_ids is None else top_ids[:, :n].to(self.device)
        lp, top = scaled_logprobs(scaled, ids, candidates)
        lp = lp * attn
        ent = torch.nn.functional.pad(entropy_from_logits(scaled[:, :-1]), (1, 0)) * attn if entropy else None
        pad = width - lp.shape[1]
        if pad:
            lp = torch.nn.functional.pad(lp, (0, pad))
            ent = torch.nn.functional.pad(ent, (0, pad)) if entropy else None
        if top is not None:
            top = torch.nn.functional.pad(top * attn[..., None], (0, 0, 0, pad))
        return Forward(lp, ent, top)

    def _packed_forward(
        self, model, seqs, width: int, entropy: bool, temps, experts, images, replay, masks, tags, top_ids
    ) -> Forward:
        """``_forward`` over one packed row (``trainer/prefix_tree.py``): with tree packing each
        run of tokens that sequences share is computed once, and each token's log-prob is read
        from the logits of the token before it in its own sequence."""
        seqs = [s.tolist() if torch.is_tensor(s) else list(s) for s in seqs]
        layout = build_layout(seqs, width, temps, share=self.config.tree_packing, tags=tags)
        ids, positions = layout.ids[None].to(self.device), layout.positions[None].to(self.device)
        extra = {}
        if not self.config.tree_packing:  # sequences lie whole in the row: these inputs place them
            places = layout.starts()
            if replay is not None and experts is not None:
                replay.set(self._replay_ids(experts, places, ids.shape, replay))
            extra = self._vision_inputs(model, seqs, images, places, ids.shape)
        positions = extra.pop("position_ids", positions)
        extra[KWARG] = plan_attention(layout, self.device)
        with self._compute_precision():
            logits = model(input_ids=ids, position_ids=positions, **extra).logits[0]
        before = logits.index_select(0, layout.prev_index.to(self.device))  # [T, V]: what predicts each token
        row_temps = None if layout.temps is None else layout.temps.to(self.device)
        scaled = before.float() if row_temps is None else before.float() / row_temps[:, None]
        # token p of sequence i is predicted at the packed row of token_index[i, p] (a shared token once)
        if (masked := _mask_places(masks, lambda i, p: layout.token_index[i, p], [len(x) for x in seqs])) is not None:
            scaled = mask_logits(scaled, *(t.to(self.device) for t in masked))
        first = layout.first.to(self.device)
        logp = torch.log_softmax(scaled, -1)
        packed_lp = logp.gather(-1, ids[0, :, None])[:, 0].masked_fill(first, 0.0)
        index = layout.token_index.to(self.device)
        beyond = torch.arange(width, device=self.device)[None] >= torch.tensor([len(s) for s in seqs])[:, None].to(
            self.device
        )
        lp = packed_lp.index_select(0, index.flatten()).view(index.shape).masked_fill(beyond, 0.0)
        top = None
        if top_ids is not None:  # each sequence's own candidates, read at its token's packed row
            candidates = top_ids[:, : index.shape[1]].to(self.device)
            top = logp[index[..., None], candidates]  # [b, width, k]: a shared row, each its own ids
            top = top.masked_fill((first[index] | beyond)[..., None], 0.0)
        if not entropy:
            return Forward(lp, None, top)
        packed_ent = entropy_from_logits(scaled).masked_fill(first, 0.0)
        ent = packed_ent.index_select(0, index.flatten()).view(index.shape).masked_fill(beyond, 0.0)
        return Forward(lp, ent, top)

    def _vision_inputs(self, model, seqs, images, places: dict, shape) -> dict:
        if self.vision is None or images is None:
            return {}
        dtype = getattr(torch, self.config.dtype)
        return self.vision.inputs(model, seqs, images, places, tuple(shape), self.device, dtype)

    def micro_batches(self, batch: TrainBatch, rows: list[int] | None = None) -> list[list[int]]:
        """Row indices (of ``rows``, default all) per micro-batch. Under FSDP2 every rank runs the
        same number of forward passes (each one all-gathers parameters), so ranks with fewer get
        empty micro-batches."""
        rows = list(range(len(batch.sequences))) if rows is None else rows
        lengths = [len(batch.sequences[r]) for r in rows]
        if self.config.tree_packing:  # whole groups, each costing its tree's tokens, so prompts are shared
            groups = defaultdict(list)
            for r in rows:
                groups[int(batch.group_ids[r])].append(r)
            units = [u for g in groups.values() for u in self._tree_units(batch, g)]
            cost = [tree_tokens([batch.sequences[r].tolist() for r in u]) for u in units]
            plan = plan_micro_batches(cost, self.config.micro_batch_tokens)
            bins = [sorted(r for u in b for r in units[u]) for b in plan]
        elif self.config.pack_sequences:
            bins = [[rows[i] for i in b] for b in plan_micro_batches(lengths, self.config.micro_batch_tokens)]
        else:  # unpacked rows are padded to the longest, so the budget counts padded tokens
            order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
            bins, cur = [], []
            for i in order:
                if cur and lengths[cur[0]] * (len(cur) + 1) > self.config.micro_batch_tokens:
                    bins.append(sorted(rows[j] for j in cur))
                    cur = []
                cur.append(i)
            bins += [sorted(rows[j] for j in cur)] if cur else []
        most = int(all_reduce(float(len(bins)), dist.ReduceOp.MAX))
        return bins + [[] for _ in range(most - len(bins))]

    def _tree_units(self, batch: TrainBatch, group: list[int]) -> list[list[int]]:
        """A group's rows, in runs whose trees fit ``micro_batch_tokens``: the whole group where it
        fits, else its members in sorted order (neighbours share the most), cut where a run's tree
        would outgrow the budget."""
        seqs = {r: batch.sequences[r].tolist() for r in group}
        if tree_tokens(list(seqs.values())) <= self.config.micro_batch_tokens:
            return [group]
        runs: list[list[int]] = []
        for r in sorted(group, key=seqs.__getitem__):
            if runs and tree_tokens([seqs[x] for x in runs[-1]] + [seqs[r]]) <= self.config.micro_batch_tokens:
                runs[-1].append(r)
            else:
                runs.append([r])
        return runs

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, model=None, entropy: bool = False):
        """[B, T] log-probs of every token under ``model`` (default: the policy), no gradient."""
        model = model or self.model
        self.replay_grammars(batch)
        width = batch.loss_mask.shape[1]
        out = torch.zeros(len(batch.sequences), width, device=self.device)
        ent = torch.zeros_like(out) if entropy else None
        for rows in self.micro_batches(batch):
            seqs = [batch.sequences[r] for r in rows]
            lp, e, _ = self._forward(model, seqs, width, entropy, *row_inputs(batch, rows))
            out[rows] = lp
            if entropy:
                ent[rows] = e
        self._free_routing()
        return (out, ent) if entropy else out

    def _replay_ids(self, experts: list, places: dict, shape, replay: RoutingReplay) -> torch.Tensor:
        """The ids of one forward over ``shape`` ([rows, columns]) tokens, sequence i's from ``places[i]``
        on (a sequence without routing goes to the filler experts: it is not trained on)."""
        kept = [i for i, e in enumerate(experts) if e is not None]
        return replay_ids([experts[i] for i in kept], [places[i] for i in kept], *shape, replay.shape, self.device)

    def _free_routing(self) -> None:
        """Routing replay's ids cleared once their forwards (and backwards) are done: a forward that is
        not the trainer's own (the audit's) routes freely, never with another batch's experts."""
        for replay in self.replay.values():
            replay.set(None)

    def values(self, batch: TrainBatch, grad: bool = False) -> torch.Tensor:
        ids, attn = padded_inputs(batch.sequences, self.device)
        with torch.set_grad_enabled(grad):
            v = self.critic(input_ids=ids, attention_mask=attn).logits[..., 0].float() * attn
        return torch.nn.functional.pad(v, (0, batch.loss_mask.shape[1] - v.shape[1]))

    def replay_grammars(self, batch: TrainBatch) -> dict[str, float]:
        """The masks of the batch's constrained tokens, replayed once (``trainer/grammar_masks.py``)
        into ``batch.grammar_masks``; a trajectory whose masks cannot be rebuilt has its constrained
        tokens left out of the loss. Returns the batch's counts (empty where nothing was constrained)."""
        if batch.grammar_spans is None:
            return {}
        if batch.grammar_masks is None:
            if self.grammars is None:
                vocab = int(self.model.config.get_text_config().vocab_size)
                self.grammars = GrammarReplay(self.config.model_path, vocab)
            batch.grammar_masks = [self._row_masks(batch, r, spans) for r, spans in enumerate(batch.grammar_spans)]
        rows = [m for m in batch.grammar_masks if m is not None]
        return {
            "grammar_tokens": float(sum(len(m.positions) for m in rows)),
            "grammar_tokens_excluded": float(sum(m.excluded for m in rows)),
            "grammar_replay_s": sum(m.replay_s for m in rows),
        }

    def _row_masks(self, batch: TrainBatch, row: int, spans: list) -> RowMasks | None:
        if not spans:
            return None
        started, mask = time.perf_counter(), batch.loss_mask[row]
        try:
            got = self.grammars.row_masks(batch.sequences[row], mask, spans)
            got.replay_s = time.perf_counter() - started
            return got
        except ReplayError as e:  # trained on an unmasked π against a masked μ: biased, so not at all
            excluded = 0
            for start, end, *_ in spans:
                excluded += int(mask[start:end].sum())
                mask[start:end] = 0
            log.warning("constrained tokens of trajectory %d left out of the loss: %s", row, e)
            return RowMasks.none(excluded, time.perf_counter() - started)
