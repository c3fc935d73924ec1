"""The training engine: log-probs in packed micro-batches; a step is one policy version, made of
``ppo_epochs`` x ``mini_batches`` optimizer steps.

Runs single-process, or under ``torchrun`` with FSDP2 (``fully_shard`` per decoder layer and at
the root). Under FSDP2 each rank trains on its own whole groups; the loss normalisers (token and
sequence counts) are all-reduced first and each rank's loss is scaled by the world size, so the
averaged gradients equal the single-process gradient of the whole batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sample_buffer.vision import is_vision_model, model_class
from trainer import lora
from trainer.advantages import compute_advantages, masked_mean
from trainer.batch import TrainBatch
from trainer.collectives import all_reduce, all_reduce_all, all_reduce_dict, world
from trainer.config import TrainerConfig
from trainer.distillation import distillation_sums, distilled_advantages, top_k_forward_kl
from trainer.forward import Forwards, row_inputs
from trainer.grammar_masks import GrammarReplay
from trainer.loss_config import PolicyLossConfig
from trainer.losses import (
    RATIO_METRICS,
    aggregate,
    kl_penalty,
    mismatch_stats,
    mismatch_weights,
    policy_loss,
    value_loss,
)
from trainer.routing import RoutingReplay, usable
from trainer.varlen import use_varlen
from trainer.vision_inputs import VisionInputs, split_vision_parameters

log = logging.getLogger(__name__)


def _decoder_layers(model):
    """The decoder's layers (a vision-language model's are its language model's)."""
    if hasattr(model, "get_base_model"):  # a PEFT wrapper (LoRA): the model it wraps
        model = model.get_base_model()
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.language_model.layers


MAX_STEP_HALVINGS = 6  # the trust region pulls a step back to 1/64 of itself at most


@dataclass
class _Step:
    """What one training step computes once, before its first update, and every update reads."""

    mask: torch.Tensor
    behav: torch.Tensor
    prox: torch.Tensor
    ref: torch.Tensor | None
    adv: torch.Tensor
    stale: torch.Tensor
    weights: torch.Tensor | None
    loss: PolicyLossConfig  # the configured loss, its norm_len filled in
    # π_prox (and the mismatch weights made from it) still to be filled in by each micro-batch's own
    # forward: the step's one update runs at the proximal weights (TrainEngine._prox_from_update).
    prox_pending: bool = False
    # The top-k forward KL's tokens (generated, on rows the teacher sent its top-k for) and the teacher's
    # top-k ids and log-probs there; None: no row has them, or trainer.distill.top_k_coef is 0.
    top_mask: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def lr_lambda(config: TrainerConfig, total_steps: int | None):
    """Warm-up, then constant or cosine to 0 at ``total_steps`` (the run's length: train_loop.steps)."""
    if config.lr_schedule == "cosine" and total_steps is None:
        raise ValueError("lr_schedule: 'cosine' needs the run's length (TrainEngine(..., total_steps=...))")

    def f(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_schedule == "cosine":
            span = max(1, total_steps - config.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - config.warmup_steps) / span)))
        return 1.0

    return f


class TrainEngine(Forwards):
    def __init__(self, config: TrainerConfig, total_steps: int | None = None) -> None:
        """``total_steps``: the run's length (``train_loop.steps``), the cosine schedule's span."""
        self.config = config
        self.rank, self.world = world()
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        log.info(
            "torch threads: %d (%s)",
            torch.get_num_threads(),
            "trainer.num_threads" if config.num_threads else "torch's default: every core",
        )
        torch.manual_seed(config.seed)
        dtype = getattr(torch, config.dtype)
        model = model_class(config.model_path).from_pretrained(config.model_path, dtype=dtype)
        if config.lora is not None:
            self._refuse_with_lora()
            model = lora.wrap(model, config.lora)
        self.model = self._prepare(model)
        self.ref = None
        # LoRA: a reference that is the base model is this one with its adapters off (no second copy)
        self.ref_is_base = (
            config.lora is not None
            and config.ref_model_path is not None
            and (Path(config.ref_model_path).resolve() == Path(config.model_path).resolve())
        )
        if config.ref_model_path and not self.ref_is_base:
            ref = model_class(config.ref_model_path).from_pretrained(config.ref_model_path, dtype=dtype)
            self.ref = ref.to(self.device).eval()
            self.ref.requires_grad_(False)
        if config.pack_sequences:
            for m in (self.model, self.ref):
                if m is not None:
                    use_varlen(m)
        # a vision-language policy: its trajectories' images become pixels for its vision tower
        self.vision = VisionInputs(self.model, config.model_path) if is_vision_model(config.model_path) else None
        self.grammars: GrammarReplay | None = None  # made at the first batch with a constrained turn
        if self.vision is not None and config.tree_packing:
            # its images and 3-D positions are laid out per sequence; a shared prefix has no single one
            raise ValueError("trainer.tree_packing: text policies only (this one is vision-language)")
        # routing replay: the models whose routers take the engine's experts (the policy, the reference)
        self.replay = {}
        if config.moe.routing == "replay":
            self.replay = {id(m): RoutingReplay(m) for m in (self.model, self.ref) if m is not None}
        self.critic = self.critic_optimizer = None
        if config.critic:
            if self.vision is not None:
                raise ValueError("trainer.critic: a value model for a vision-language policy is not built yet")
            from transformers import AutoModelForTokenClassification

            critic = AutoModelForTokenClassification.from_pretrained(config.model_path, num_labels=1, dtype=dtype)
            self.critic = self._prepare(critic)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=config.critic_lr)
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        if config.vision_lr is not None:
            if self.vision is None:
                raise ValueError("trainer.vision_lr: the policy has no vision tower")
            tower, language = split_vision_parameters(self.model)
            params = [{"params": language}, {"params": tower, "lr": config.vision_lr}]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config, total_steps))
        self.audit = None
        if config.audit_versions:
            if self.vision is not None:
                raise ValueError("trainer.audit_versions: the audit's forwards take no images (text policies only)")
            if self.world > 1:
                raise ValueError("trainer.audit_versions: a diagnostic of single-process trainers (not under torchrun)")
            from trainer.audit import PolicyAudit

            self.audit = PolicyAudit(self.model, config.audit_versions)
        if config.max_step_kl is not None and self.world > 1:
            # FSDP2 keeps the root's parameters gathered between a forward and the next backward: a
            # halving there would move the gathered copy, not the weights. Not built (nor tested) yet.
            raise ValueError("trainer.max_step_kl: single-process trainers only for now (not under torchrun)")
        self.step = 0  # optimizer steps taken
        self.version = 0  # policy version: bumped by every step, published to the engines

    def _refuse_with_lora(self) -> None:
        cfg = self.config
        for on, what in (
            (is_vision_model(cfg.model_path), "a vision-language policy"),
            (cfg.moe.routing == "replay", "moe.routing 'replay'"),
            (cfg.audit_versions > 0, "audit_versions"),
            (cfg.max_step_kl is not None, "max_step_kl"),
        ):
            if on:  # each keeps or copies whole weights by the plain model's names: not built for adapters yet
                raise ValueError(f"trainer.lora: not with {what} yet")

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.ref_is_base:
            with self.model.disable_adapter():
                return self.logprobs(batch)
        return self.logprobs(batch, self.ref) if self.ref is not None else None

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        model.config.use_cache = False
        model.to(self.device)
        if self.config.activation_checkpointing:  # before sharding: each layer is recomputed, then resharded
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.world > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = self.config.mixed_precision
            policy = (
                MixedPrecisionPolicy()
                if mp is None
                else MixedPrecisionPolicy(
                    param_dtype=getattr(torch, mp.param_dtype), reduce_dtype=getattr(torch, mp.reduce_dtype)
                )
            )
            for layer in _decoder_layers(model):
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        return model

    def _compute_precision(self):
        """Autocast to the mixed-precision dtype in a single process (FSDP2 casts on its own)."""
        mp = self.config.mixed_precision
        if mp is None or self.world > 1:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, mp.param_dtype))

    # ------------------------------------------------------------------ one training step
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy version: ``ppo_epochs`` passes over the batch, each ``mini_batches``
        optimizer steps over slices of whole groups. π_prox, the reference, the advantages and the
        mismatch weights are computed once, before the first update."""
        cfg = self.config
        self.model.train()
        constrained = self.replay_grammars(batch)  # before the loss mask is read: it may leave tokens out
        too_long = self._too_long(batch)
        dropped = self._unroutable(batch) if self.replay else 0
        mask = batch.loss_mask.to(self.device)
        behav = batch.behavior_logprobs.to(self.device)
        ref = self._reference_logprobs(batch)
        # The proximal policy: these weights, before this step. With one update per batch the update's
        # own forward runs at exactly these weights, so π_prox is its log-probs, detached (filled in by
        # _update): a separate forward would compute the same numbers again.
        from_update = self._prox_from_update(ref)
        prox = torch.zeros(mask.shape, device=self.device) if from_update else self.logprobs(batch)
        rewards = batch.rewards.to(self.device)
        if ref is not None and cfg.kl_in_reward:
            rewards = rewards - cfg.kl_coef * (kl_penalty(prox, ref, cfg.kl_estimator) * mask).sum(-1)
        values = self.values(batch) if self.critic is not None else None
        adv, returns = compute_advantages(cfg.advantages, rewards, mask, batch.group_ids.to(self.device), values)
        distilled = [0.0, 0.0]  # every rank joins the step's one collective, taught rows or not
        if batch.teacher_logprobs is not None:
            d, teacher, taught = cfg.distill, batch.teacher_logprobs.to(self.device), batch.taught.to(self.device)
            student = behav if d.student == "behavior" else prox
            groups = batch.group_ids.to(self.device) if d.baseline == "group" else None
            adv = distilled_advantages(
                adv, student, teacher, mask, taught, coef=d.coef, reward_coef=d.reward_coef, group_ids=groups
            )
            distilled = distillation_sums(student, teacher, mask, taught)
        # Sampled by older weights than these (the engines served an earlier version).
        stale = (
            torch.zeros_like(mask, dtype=torch.bool)
            if batch.token_versions is None
            else ((batch.token_versions.to(self.device) < self.version) & mask.bool())
        )
        weights = None if from_update else mismatch_weights(cfg.mismatch, prox, behav)
        norm_len = cfg.loss.norm_len or int(all_reduce(float(mask.shape[1]), dist.ReduceOp.MAX))
        loss = cfg.loss.model_copy(update={"norm_len": norm_len})  # the longest row of any rank
        step = _Step(
            mask=mask,
            behav=behav,
            prox=prox,
            ref=ref,
            adv=adv,
            stale=stale,
            weights=weights,
            loss=loss,
            prox_pending=from_update,
        )
        if batch.teacher_top_ids is not None and cfg.distill.top_k_coef > 0:
            step.top_mask = mask * batch.topped.to(self.device)[:, None]
            # A teacher id the student's vocabulary lacks (a padded teacher vocabulary) is no candidate.
            vocab = int(self.model.config.get_text_config().vocab_size)
            outside = batch.teacher_top_ids >= vocab
            step.top_ids = batch.teacher_top_ids.masked_fill(outside, 0)
            step.top_logprobs = batch.teacher_top_logprobs.masked_fill(outside, float("-inf")).to(self.device)
        audited, before = {}, None
        if self.audit is not None:  # these weights are π_v: measured against older ones, then kept
            audited = self.audit.measure(self.model, batch, self.version, mask, behav, self.device)
            before = self.audit.snapshot(self.model)

        sums: dict[str, float] = defaultdict(float)
        updates = 0
        start = None if cfg.max_step_kl is None else [p.detach().clone() for p in self.model.parameters()]
        for epoch in range(cfg.ppo_epochs):
            for rows in self._mini_batches(batch, epoch):
                if (got := self._update(batch, rows, step)) is not None:
                    for k, v in got.items():
                        sums[k] += v
                    updates += 1
        self._free_routing()
        weights = step.weights
        bounded = {} if start is None else self._bound_step(batch, start, prox, mask)
        self.scheduler.step()  # once per version: the schedule spans the run's steps
        if before is not None:
            self.audit.remember(self.version, before)
        self.step += 1
        self.version += 1
        out = {"loss": 0.0, "pg_loss": 0.0, "grad_norm": 0.0}  # what a step with no token to train on reports
        top_kl, top_tokens = sums.pop("top_kl_sum", 0.0), sums.pop("top_tokens", 0.0)
        out |= {k: v / max(updates, 1) for k, v in sums.items() if not k.endswith(("_stale", "stale_tokens"))}
        if top_tokens:  # per taught token, over every update of the step
            out["teacher_top_kl"] = top_kl / top_tokens
        if sums["stale_tokens"]:  # means over stale tokens, weighted by how many each update had
            out |= {k: v / sums["stale_tokens"] for k, v in sums.items() if k.endswith("_stale")}
        out |= all_reduce_dict(mismatch_stats(prox, behav, mask, stale)) | audited | bounded
        out |= {"lr": self.scheduler.get_last_lr()[0], "tokens": all_reduce(float(mask.sum())), "updates": updates}
        kl_sum, taught_tokens = all_reduce_all(distilled)
        if taught_tokens:  # the share of the step's tokens a teacher scored, and the student's gap to it
            out |= {"teacher_kl": kl_sum / taught_tokens, "taught_share": taught_tokens / max(out["tokens"], 1)}
        if self.replay:
            out["routing_dropped"] = all_reduce(float(dropped))
        out["too_long_dropped"] = all_reduce(float(too_long))
        out |= dict(zip(constrained, all_reduce_all(list(constrained.values())), strict=True))
        out["reward_mean"] = all_reduce(float(batch.rewards.sum())) / all_reduce(float(len(batch.rewards)))
        if (cap := getattr(cfg.loss, "behavior_weight_cap", None)) is not None:  # decoupled PPO's sg(π_prox/μ)
            capped = ((prox - behav).exp() > cap) & mask.bool()
            out["behavior_weight_capped_frac"] = all_reduce(float(capped.sum())) / max(out["tokens"], 1)
        if weights is not None:
            out["mismatch_weight_mean"] = all_reduce(float((weights * mask).sum())) / max(out["tokens"], 1)
        if self.critic is not None:
            out["value_loss"] = self._critic_step(batch, values, returns, mask)
        return out

    @staticmethod
    def _max_positions(model) -> int | None:
        """The longest sequence the model takes: ``max_position_embeddings``, times the factor of a
        rope scaling that extends it (YaRN, linear, dynamic, LongRoPE: Qwen2.5's 32k × 4)."""
        cfg = model.config.get_text_config()
        limit = getattr(cfg, "max_position_embeddings", None)
        rope = getattr(cfg, "rope_parameters", None) or {}  # transformers 5's home of rope scaling
        scaled = isinstance(rope, dict) and rope.get("rope_type", "default") != "default"
        return None if limit is None else int(limit * ((rope.get("factor") if scaled else None) or 1))

    def _too_long(self, batch: TrainBatch) -> int:
        """A trajectory longer than the model's ``max_position_embeddings`` is not trained on (its loss
        mask zeroed; its forward stops at the limit) rather than at positions the model never saw.
        Returns how many."""
        limit = self._max_positions(self.model)
        bad = [i for i, s in enumerate(batch.sequences) if limit is not None and len(s) > limit]
        for i in bad:
            batch.loss_mask[i] = 0
        if bad:
            longest = max(len(batch.sequences[i]) for i in bad)
            log.warning("%d trajectories (up to %d tokens) exceed the model's %d positions", len(bad), longest, limit)
        return len(bad)

    def _unroutable(self, batch: TrainBatch) -> int:
        """Routing replay: a trajectory whose routing is missing, partial or not this model's is not
        trained on (its loss mask zeroed; still forwarded, its positions go to experts 0..top_k-1)
        rather than trained with wrong experts. Returns how many."""
        shape = next(iter(self.replay.values())).shape
        experts = batch.routed_experts or [None] * len(batch.sequences)
        # Positions that must route as the engine did: every one before the last generated token (what
        # comes after it, an environment's last observation, is never trained on).
        generated = batch.loss_mask > 0
        needed = [int(row.nonzero().max()) if row.any() else 0 for row in generated]
        why = {i: usable(experts[i], needed[i], shape) for i in range(len(batch.sequences))}
        bad = {i: w for i, w in why.items() if w is not None}
        for i in bad:
            batch.loss_mask[i] = 0
            experts[i] = None
        if bad:
            log.warning("routing replay: %d trajectories not trained on (%s routing)", len(bad), Counter(bad.values()))
        batch.routed_experts = experts
        return len(bad)

    def _step_kl(self, batch: TrainBatch, prox: torch.Tensor, mask: torch.Tensor) -> float:
        """KL(π_prox ‖ π) estimated (k3) over the batch's generated tokens, all ranks': they were
        sampled by μ, not π_prox, so on stale tokens it is the movement where μ sampled."""
        log_r = (self.logprobs(batch) - prox) * mask  # 0 off the mask, where k3 is 0 too
        k3 = (log_r.exp() - 1 - log_r).sum()
        total, n = all_reduce_all([float(k3), float(mask.sum())])
        return total / max(n, 1.0)

    def _bound_step(self, batch: TrainBatch, start: list[torch.Tensor], prox, mask) -> dict[str, float]:
        """The step's trust region (``max_step_kl``): halve the step back towards π_prox while it
        moved the policy further than the bound. Adam's moments keep the whole step's gradients."""
        kl = first = self._step_kl(batch, prox, mask)
        halvings = 0
        while kl > self.config.max_step_kl and halvings < MAX_STEP_HALVINGS:
            with torch.no_grad():
                for p, p0 in zip(self.model.parameters(), start, strict=True):
                    p.lerp_(p0, 0.5)
            halvings += 1
            kl = self._step_kl(batch, prox, mask)
        if kl > self.config.max_step_kl:
            log.warning(
                "step %d: still %.3f nats after %d halvings (max_step_kl %g)",
                self.step,
                kl,
                halvings,
                self.config.max_step_kl,
            )
        return {"step_kl": kl, "step_kl_unbounded": first, "step_halvings": halvings}

    def _mini_batches(self, batch: TrainBatch, epoch: int) -> list[list[int]]:
        """This rank's rows in ``mini_batches`` slices of whole groups, in an order shuffled per
        epoch (every rank runs as many slices; a rank short of groups gets empty ones)."""
        groups: dict[int, list[int]] = defaultdict(list)
        for row, g in enumerate(batch.group_ids.tolist()):
            groups[g].append(row)
        order = list(groups)
        if epoch:  # the first pass keeps the batch's order; later ones shuffle it (seeded: reproducible)
            random.Random(self.config.seed * 1_000_003 + self.step * 101 + epoch).shuffle(order)
        n = self.config.mini_batches
        return [
            [r for g in order[i * len(order) // n : (i + 1) * len(order) // n] for r in groups[g]] for i in range(n)
        ]

    def _prox_from_update(self, ref: torch.Tensor | None) -> bool:
        """Whether π_prox can come from the step's update itself: one optimizer step over the whole
        batch (one epoch, one mini-batch), and nothing needs π_prox before that update runs (a KL in
        the reward or a distillation gap against π_prox, which shape the advantages) or after it at
        the old weights (the trust region)."""
        cfg = self.config
        kl_first = ref is not None and cfg.kl_in_reward
        # By the config, not the batch: every rank must take the same path (its forwards are collective).
        kl_first |= cfg.distill.student == "proximal"
        return cfg.ppo_epochs == 1 and cfg.mini_batches == 1 and cfg.max_step_kl is None and not kl_first

    def _update(self, batch: TrainBatch, rows: list[int], s: _Step) -> dict[str, float] | None:
        """One optimizer step on ``rows`` (micro-batched, gradients accumulated); its metrics, or
        None where no rank had a token to train on."""
        cfg = self.config
        mask = s.mask
        n_tok = all_reduce(float(mask[rows].sum()))
        if n_tok == 0:
            return None
        n_seq = all_reduce(float((mask[rows].sum(-1) > 0).sum()))
        token_mode = cfg.loss.agg_mode == "token-mean"
        sums: dict[str, float] = defaultdict(float)
        for micro in self.micro_batches(batch, rows):
            seqs = [batch.sequences[r] for r in micro]
            lp, ent, top = self._forward(
                self.model,
                seqs,
                mask.shape[1],
                cfg.entropy_coef > 0,
                *row_inputs(batch, micro),
                top_ids=None if s.top_ids is None else s.top_ids[micro],
            )
            if not micro:  # filler micro-batch: a zero loss that still runs the backward collectives
                (lp.sum() * 0.0).backward()
                continue
            m = mask[micro]
            if s.prox_pending:
                s.prox[micro] = lp.detach()
                if (w := mismatch_weights(cfg.mismatch, s.prox[micro], s.behav[micro])) is not None:
                    s.weights = torch.zeros_like(s.prox) if s.weights is None else s.weights
                    s.weights[micro] = w
            pg, metrics = policy_loss(
                lp,
                s.adv[micro],
                m,
                behavior_logprobs=s.behav[micro],
                proximal_logprobs=s.prox[micro],
                entropy=ent,
                token_weights=None if s.weights is None else s.weights[micro],
                stale=s.stale[micro],
                config=s.loss,
            )
            tok_w, seq_w = float(m.sum()) / max(n_tok, 1), float((m.sum(-1) > 0).sum()) / max(n_seq, 1)
            weight = tok_w if token_mode else seq_w
            total = pg * weight
            if ent is not None:
                total = total - cfg.entropy_coef * masked_mean(ent, m) * tok_w
            if s.ref is not None and not cfg.kl_in_reward and cfg.kl_coef > 0:
                kl = aggregate(kl_penalty(lp, s.ref[micro], cfg.kl_estimator), m, s.loss.agg_mode, s.loss.norm_len)
                total = total + cfg.kl_coef * kl * weight
                sums["kl"] += float(kl.detach()) * weight
            if top is not None:  # a token mean over the update's tokens, whichever micro-batch holds them
                fkl = (top_k_forward_kl(top, s.top_logprobs[micro]) * s.top_mask[micro]).sum()
                total = total + cfg.distill.top_k_coef * fkl / n_tok
                sums["top_kl_sum"] += float(fkl.detach())
                sums["top_tokens"] += float(s.top_mask[micro].sum())
            (total * self.world).backward()
            sums["loss"] += float(total.detach())
            sums["pg_loss"] += float(pg.detach()) * weight
            n_stale = metrics.pop("stale_tokens", 0.0)
            for k, v in metrics.items():  # stale-token means are summed per stale token (divided in train_step)
                sums[k] += v * n_stale if k.endswith("_stale") else v * tok_w
            sums["stale_tokens"] += n_stale
        grad_norm = self._clip(self.model)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # One collective over a fixed list of names: a rank whose slice was empty has none of its own.
        names = ["loss", "pg_loss", *RATIO_METRICS, *(f"{k}_stale" for k in RATIO_METRICS), "stale_tokens"]
        names += ["entropy"] if cfg.entropy_coef > 0 else []
        names += ["kl"] if s.ref is not None and not cfg.kl_in_reward and cfg.kl_coef > 0 else []
        names += ["top_kl_sum", "top_tokens"] if cfg.distill.top_k_coef > 0 else []  # every rank, taught or not
        return dict(zip(names, all_reduce_all([sums[k] for k in names]), strict=True)) | {"grad_norm": grad_norm}

    def full_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The policy's unsharded weights by HF name, on CPU (``on_device``: on the trainer's device):
        on rank 0; {} on the others (collective). LoRA: the adapters merged into their base weights."""
        from trainer.export import full_state_dict

        return full_state_dict(self.model, cpu_offload=not on_device)

    def adapter_factors(self) -> dict[str, torch.Tensor]:
        """LoRA: each adapted layer's factors and scaling (``trainer.lora.factors``); rank 0."""
        from trainer.export import adapter_factors

        if self.config.lora is None:
            raise ValueError("adapter_factors: the policy has no LoRA adapters (trainer.lora)")
        return adapter_factors(self.model)

    def export(self, out_dir, state: dict[str, torch.Tensor] | None = None):
        """Write the current policy (``state``: from ``full_weights``, else gathered here) as a HF
        directory; rank 0 writes, the others return None."""
        from trainer.export import export_hf

        return export_hf(self.model, self.config.model_path, out_dir, state)

    def export_adapter(self, out_dir):
        """Write the LoRA policy's adapter as PEFT does (``trainer.export.export_adapter``); rank 0
        writes, the others return None."""
        from trainer.export import export_adapter

        if self.config.lora is None:
            raise ValueError("export_adapter: the policy has no LoRA adapters (trainer.lora)")
        return export_adapter(self.model, out_dir)

    def _clip(self, model) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if self.config.grad_clip is None:
            norms = [p.grad.detach().norm() for p in params]
            total = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm()
            return float(total)
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _critic_step(self, batch: TrainBatch, old_values, returns, mask) -> float:
        v = self.values(batch, grad=True)
        loss = value_loss(v, old_values, returns, mask, self.config.value_clip)
        (loss * self.world).backward()
        self._clip(self.critic)
        self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        return all_reduce(float(loss.detach())) / self.world
