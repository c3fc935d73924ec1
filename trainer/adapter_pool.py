"""Several LoRA adapters on one frozen base model, each trained by its own client.

This is the training side of the Tinker API (``services/tinker/``): a client creates an adapter,
then calls ``forward_backward`` with data and a loss it names (``trainer/token_losses.py``) as
often as it likes, gradients adding up, and ``optim_step`` with its own Adam parameters, which
applies them and clears them. The base weights are loaded once and never change; each adapter has
its own factors, gradients and optimizer, so clients cannot disturb one another (PEFT's named
adapters: the active one is set before each call, and calls run one at a time).

A datum is next-token aligned as Tinker's: ``tokens`` [N] go in, position i's target is
``target_tokens[i]`` (the token after it), and its log-prob under the adapted model is what the
losses use and what ``forward_backward`` returns per datum.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sample_buffer.vision import model_class
from trainer.lora import LoraConfig
from trainer.token_losses import CHECKS, LOSSES, NEEDS, LossInputError, check_config

log = logging.getLogger(__name__)

# Tinker's lora_config switches, as the linear layers they adapt (those the model has)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"
SCORING = "scoring"  # a saved adapter loaded for one ``score`` call


@dataclass
class Datum:
    tokens: np.ndarray  # [N] the model's input
    inputs: dict[str, np.ndarray]  # loss_fn_inputs: target_tokens [N] or [N, K], weights, advantages, logprobs ...


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass
class _Adapter:
    config: LoraConfig
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0
    pending: int = 0  # forward_backward calls since the last optim_step
    params: list[torch.nn.Parameter] = field(default_factory=list)


class AdapterPool:
    """``model_path``'s model (float32 on ``device``) with the adapters clients add by name."""

    def __init__(self, model_path: str, device: str = "cpu", micro_batch_tokens: int = 4096) -> None:
        base = model_class(model_path).from_pretrained(model_path, dtype=torch.float32)
        base.config.use_cache = False
        self.device = torch.device(device)
        self.base = base.to(self.device).eval()  # no dropout in the base; adapters' own dropout is their config
        self.base.requires_grad_(False)
        self.model = None  # the PEFT wrapper, made with the first adapter
        self.adapters: dict[str, _Adapter] = {}
        self.vocab_size = base.get_output_embeddings().weight.shape[0]
        self.max_positions = getattr(base.config, "max_position_embeddings", None)
        self.micro_batch_tokens = micro_batch_tokens
        linear = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
        self.linear_layers = sorted(linear)

    # ------------------------------------------------------------------ adapters
    def targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]:
        """The linear layers Tinker's switches name, among those this model has."""
        wanted = (ATTENTION if attn else ()) + (MLP if mlp else ()) + (UNEMBED if unembed else ())
        return [t for t in wanted if t in self.linear_layers]

    def add(self, name: str, config: LoraConfig, seed: int | None = None) -> None:
        """A new adapter (B = 0: the model computes what the base does until it trains)."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        if name in self.adapters:
            raise ValueError(f"adapter {name!r} exists already")
        missing = [t for t in config.target_modules if t not in self.linear_layers]
        if missing:
            raise LossInputError("lora_config", f"{missing} are not linear layers of this model")
        peft = PeftLoraConfig(
            r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=config.target_modules
        )
        with torch.random.fork_rng(devices=[]):  # a seed for A's initialization, not for the process
            if seed is not None:
                torch.manual_seed(seed)
            if self.model is None:
                self.model = get_peft_model(self.base, peft, adapter_name=name)
            else:
                self.model.add_adapter(name, peft)
        self.model.to(self.device)
        self.model.set_adapter(name)
        params = [p for n, p in self.model.named_parameters() if f".{name}." in n and ".lora_" in n]
        self.adapters[name] = _Adapter(config, params=params)

    def remove(self, name: str) -> None:
        self._adapter(name)
        self.model.delete_adapter(name)
        del self.adapters[name]

    def _adapter(self, name: str) -> _Adapter:
        a = self.adapters.get(name)
        if a is None:
            raise KeyError(name)
        return a

    def _activate(self, name: str) -> _Adapter:
        a = self._adapter(name)
        if self.model.active_adapter != name:
            self.model.set_adapter(name)
        return a

    # ------------------------------------------------------------------ training
    def forward_backward(
        self, name: str, data: list[Datum], loss_fn: str, config: dict[str, float], backward: bool = True
    ) -> tuple[list[np.ndarray], float]:
        """Each datum's target log-probs and the summed loss; with ``backward`` its gradients are
        added to the adapter's (until ``optim_step``). Raises ``LossInputError`` naming a bad input
        before anything is computed."""
        fn = LOSSES.get(loss_fn)
        if fn is None:
            raise LossInputError("loss_fn", f"{loss_fn!r} is not served (served: {sorted(LOSSES)})")
        check_config(config)
        a = self._activate(name)
        checked = [self._check(i, d, loss_fn) for i, d in enumerate(data)]
        if len({c[1].dim() for c in checked}) > 1:
            raise LossInputError("data", "target_tokens of one shape in a call: all [N] or all [N, K]")
        self.model.train(backward)  # adapter dropout only while training
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(data)
        total = 0.0
        for rows in self._micro_batches([len(d.tokens) for d in data]):
            with torch.set_grad_enabled(backward):
                lps = self._logprobs([checked[i][0] for i in rows], [checked[i][1] for i in rows])
                loss = sum(fn(lp, checked[i][2], config) for lp, i in zip(lps, rows))
                if backward and loss.requires_grad:
                    loss.backward()
            total += float(loss.detach())
            for lp, i in zip(lps, rows):
                out[i] = lp.detach().float().cpu().numpy()
        if backward:
            a.pending += 1
        return out, total

    def _check(self, i: int, d: Datum, loss_fn: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
        where = f"data[{i}]"
        n = len(d.tokens)
        if n == 0:
            raise LossInputError(f"{where}.model_input", "no tokens")
        if self.max_positions and n > self.max_positions:
            raise LossInputError(f"{where}.model_input", f"{n} tokens, the model takes {self.max_positions} at most")
        tokens = torch.as_tensor(np.asarray(d.tokens), dtype=torch.long)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise LossInputError(f"{where}.model_input", f"a token id outside [0, {self.vocab_size})")
        target = d.inputs.get("target_tokens")
        if target is None:
            raise LossInputError(f"{where}.loss_fn_inputs.target_tokens", "required")
        target = torch.as_tensor(np.array(target), dtype=torch.long)
        if target.shape[0] != n or target.dim() > 2:
            raise LossInputError(
                f"{where}.loss_fn_inputs.target_tokens", f"shape {tuple(target.shape)} for {n} input tokens"
            )
        if int(target.min()) < 0 or int(target.max()) >= self.vocab_size:
            raise LossInputError(f"{where}.loss_fn_inputs.target_tokens", f"an id outside [0, {self.vocab_size})")
        inputs = {}
        for key, v in d.inputs.items():
            t = torch.as_tensor(np.array(v))
            if t.dim() == 0 or t.shape[0] != n:
                raise LossInputError(f"{where}.loss_fn_inputs.{key}", f"shape {tuple(t.shape)} for {n} input tokens")
            inputs[key] = t.to(self.device)
        for key in NEEDS[loss_fn]:  # the loss's own inputs: a value per target, finite
            t = inputs.get(key)
            if t is None:
                raise LossInputError(f"{where}.loss_fn_inputs.{key}", "required by this loss")
            if t.shape != target.shape:
                raise LossInputError(
                    f"{where}.loss_fn_inputs.{key}", f"shape {tuple(t.shape)}, target_tokens {tuple(target.shape)}"
                )
            if not bool(torch.isfinite(t.float()).all()):
                raise LossInputError(f"{where}.loss_fn_inputs.{key}", "a NaN or infinite value")
        if loss_fn in CHECKS:
            try:
                CHECKS[loss_fn](target, inputs)
            except LossInputError as e:
                raise LossInputError(f"{where}.{e.field}", e.message) from None
        return tokens, target, inputs

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Rows in order, grouped while their padded size stays within ``micro_batch_tokens``."""
        groups: list[list[int]] = []
        width = 0
        for i, n in enumerate(lengths):
            if groups and max(width, n) * (len(groups[-1]) + 1) <= self.micro_batch_tokens:
                groups[-1].append(i)
                width = max(width, n)
            else:
                groups.append([i])
                width = n
        return groups

    def _logprobs(self, seqs: list[torch.Tensor], targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """log π(target_i | tokens ≤ i) of each row: [N] (or [N, K] for K targets per position)."""
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = s
            mask[r, : len(s)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
        out = []
        for r, (s, t) in enumerate(zip(seqs, targets)):
            row = logits[r, : len(s)]
            t = t.to(self.device)
            picked = row.gather(-1, t if t.dim() == 2 else t[:, None])
            lp = picked - torch.logsumexp(row, -1, keepdim=True)
            out.append(lp if t.dim() == 2 else lp[:, 0])
        return out

    def optim_step(self, name: str, adam: AdamParams) -> dict[str, float]:
        """Apply the gradients gathered since the last step (AdamW with the caller's parameters), then clear them."""
        a = self._adapter(name)
        if a.optimizer is None:
            a.optimizer = torch.optim.AdamW(a.params, lr=adam.learning_rate)
        for g in a.optimizer.param_groups:  # the client sends them every step (its schedule)
            g.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        grads = [p.grad for p in a.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        )
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(a.params, adam.grad_clip_norm)
        a.optimizer.step()
        a.optimizer.zero_grad(set_to_none=True)
        a.steps += 1
        a.pending = 0
        return {"grad_norm": norm, "steps": float(a.steps)}

    @torch.no_grad()
    def score(self, tokens: list[int], adapter_dir: str | Path | None = None) -> np.ndarray:
        """log π(tokens[i] | tokens < i) for every position (NaN at the first, which has no context)
        under the base model, or under the PEFT adapter in ``adapter_dir`` (loaded for this call only)."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)[None]
        if adapter_dir is None:
            if self.model is None:
                logits = self.base(input_ids=ids).logits
            else:
                with self.model.disable_adapter():
                    logits = self.model(input_ids=ids).logits
        else:
            from peft import PeftModel

            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, str(adapter_dir), adapter_name=SCORING)
            else:
                self.model.load_adapter(str(adapter_dir), adapter_name=SCORING)
            try:
                self.model.set_adapter(SCORING)
                self.model.eval()
                logits = self.model(input_ids=ids).logits
            finally:
                self.model.delete_adapter(SCORING)
        lp = logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        return np.concatenate([[np.nan], lp.cpu().numpy()]).astype(np.float32)

    # ------------------------------------------------------------------ files
    def save_adapter(self, name: str, out_dir: str | Path) -> Path:
        """The adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``):
        what engines load (``/load_lora_adapter``) and ``PeftModel.from_pretrained`` reads."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        self._adapter(name)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # the factors alone: never the base weights of a tied embedding that PEFT would add for lm_head
        state = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"))
        self.model.peft_config[name].save_pretrained(str(out))
        return out

    def save_state(self, name: str, out_dir: str | Path) -> Path:
        """The adapter, its optimizer's state and its step count: what ``load_state`` resumes from."""
        a = self._adapter(name)
        out = self.save_adapter(name, out_dir)
        if a.optimizer is not None:
            torch.save(a.optimizer.state_dict(), out / OPTIMIZER_FILE)
        else:  # no step yet: no optimizer state (not an older save's, when overwriting)
            (out / OPTIMIZER_FILE).unlink(missing_ok=True)
        (out / STATE_FILE).write_text(json.dumps({"steps": a.steps, "lora": a.config.model_dump()}))
        return out

    def load_state(self, name: str, path: str | Path, optimizer: bool) -> LoraConfig:
        """A new adapter ``name`` from ``save_state``'s directory (with its optimizer's state when
        asked and saved); ``ValueError`` when it is not one or does not fit this model."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(path)
        try:
            saved = json.loads((path / STATE_FILE).read_text())
            config = LoraConfig(**saved["lora"])
            state = load_file(str(path / "adapter_model.safetensors"))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path} is not a saved training state: {e}") from None
        self.add(name, config)
        try:
            set_peft_model_state_dict(self.model, state, adapter_name=name)
            a = self.adapters[name]
            a.steps = int(saved.get("steps", 0))
            if optimizer and (path / OPTIMIZER_FILE).exists():
                a.optimizer = torch.optim.AdamW(a.params)
                a.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
        except (RuntimeError, ValueError) as e:  # factors of another shape: nothing half-loaded stays
            self.remove(name)
            raise ValueError(f"{path}: does not fit this model: {e}") from None
        return config
