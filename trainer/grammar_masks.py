"""Constrained decoding, replayed: the trainer's π sees the distribution the engine sampled from.

A turn decoded under a grammar (``metadata.turn_grammars``: SGLang's ``json_schema`` / ``regex`` /
``ebnf``) had each token sampled from the policy's distribution masked to what the grammar allowed
next, renormalised; μ, its log-prob, is that masked distribution's. Scored unmasked, π would put
mass on tokens that could never be sampled and the ratio π/μ would be biased on every such token.
So the trainer replays each constrained turn's grammar over its recorded tokens (xgrammar's
matcher, built from the same tokenizer, vocabulary width and stop tokens as the engine's) and masks
its logits the same way before the softmax: π and μ are then the same distribution's, at equal
weights equal within the engines' numerics (``tests/trainer/test_grammar_masks.py``).

The masks depend on the tokens alone, not the weights: they are replayed once per batch, on the
CPU, and kept as xgrammar's packed bitmask (a bit a vocabulary entry, ``V / 8`` bytes a token).
A turn that cannot be replayed (xgrammar missing, a grammar that no longer compiles, a token the
grammar refuses: another tokenizer) has its tokens left out of the loss and counted
(``grammar_tokens_excluded``): never trained on a biased ratio, never a crashed step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sample_buffer.grammars import compile_grammar, stop_token_ids

log = logging.getLogger(__name__)

CACHE = 64  # compiled grammars kept (an agent's every turn sends the same schema)


@dataclass
class RowMasks:
    """One trajectory's constrained tokens and, for each, what its grammar allowed."""

    positions: torch.Tensor  # [n] long: positions in the trajectory's tokens
    bits: torch.Tensor  # [n, ceil(V / 32)] int32: xgrammar's bitmask, bit v set where token v was allowed
    excluded: int = 0  # constrained tokens that could not be replayed, left out of the loss
    replay_s: float = 0.0  # how long the replay took

    @classmethod
    def none(cls, excluded: int = 0, replay_s: float = 0.0) -> RowMasks:
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.int32), excluded, replay_s)


class ReplayError(RuntimeError):
    """A constrained turn whose masks cannot be rebuilt here."""


def allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``bits`` [n, W] int32 (bit j of word w: token 32 w + j) as a bool mask [n, vocab]. Read a byte
    at a time (little-endian: byte k of word w holds tokens 32 w + 8 k ...): a quarter of the memory
    an int32 a bit would take, which at a 49k vocabulary and a thousand tokens is 200 MB."""
    as_bytes = bits.contiguous().view(torch.uint8)  # [n, 4 W]
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    unpacked = ((as_bytes[:, :, None] >> shifts) & 1).reshape(bits.shape[0], -1).bool()
    if unpacked.shape[1] < vocab:  # logits wider than the grammar's vocabulary (padding rows): never allowed
        unpacked = torch.nn.functional.pad(unpacked, (0, vocab - unpacked.shape[1]))
    return unpacked[:, :vocab]


def mask_logits(scaled: torch.Tensor, index: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``scaled`` [N, V] (logits at their temperature) with each row ``index[k]`` limited to what
    ``bits[k]`` allows, in place (a copy of all N rows cost a forward a sixth more). The lowest
    finite float, not -inf, stands for a refused token: its probability is exactly 0 all the same,
    and an entropy's ``p · log p`` stays 0 instead of NaN. Applied after the temperature (a finite
    minimum divided by a temperature below 1 overflows)."""
    if not len(index):
        return scaled
    refused = ~allowed(bits.to(scaled.device), scaled.shape[-1])
    rows = scaled.index_select(0, index).masked_fill(refused, torch.finfo(scaled.dtype).min)
    return scaled.index_put_((index,), rows)


def constrained_spans(metadata: dict, loss_mask, length: int) -> list[tuple[int, int, str, str]]:
    """``(start, end, field, text)`` of each turn decoded under a grammar: its tokens are the
    generated ones (``loss_mask`` 1) in [start, end)."""
    grammars, starts = metadata.get("turn_grammars"), metadata.get("turn_starts") or []
    if not grammars:
        return []
    ends = [*starts[1:], length]
    return [(s, e, g[0], g[1]) for s, e, g in zip(starts, ends, grammars, strict=True) if g is not None]


class GrammarReplay:
    """The masks of constrained turns, rebuilt with the engine's tokenizer info for ``model_path``."""

    def __init__(self, model_path: str, vocab_size: int) -> None:
        self.model_path, self.vocab_size = model_path, vocab_size
        self._compiler = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()

    def _xgr(self):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ReplayError("xgrammar is not installed (pip install rollmesh[grammar])") from None
        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            stops = sorted(stop_token_ids(self.model_path))  # the engine's: a finished answer ends with one
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stops)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return xgr

    def _grammar(self, xgr, field: str, text: str):
        key = (field, text)
        if (found := self._compiled.get(key)) is not None:
            self._compiled.move_to_end(key)
            return found
        try:  # compiled as the engine compiles it
            compiled = compile_grammar(self._compiler, field, text)
        except Exception as e:
            raise ReplayError(f"{field} does not compile: {str(e).strip()[:200]}") from None
        self._compiled[key] = compiled
        while len(self._compiled) > CACHE:
            self._compiled.popitem(last=False)
        return compiled

    def row_masks(self, token_ids, loss_mask, spans: list[tuple[int, int, str, str]]) -> RowMasks:
        """The masks of one trajectory's constrained tokens (``spans``: ``constrained_spans``)."""
        xgr = self._xgr()
        positions: list[int] = []
        blocks: list[torch.Tensor] = []
        for start, end, field, text in spans:
            turn = [p for p in range(start, end) if loss_mask[p]]
            if not turn:
                continue
            matcher = xgr.GrammarMatcher(self._grammar(xgr, field, text))
            bits = xgr.allocate_token_bitmask(len(turn), self.vocab_size)
            for k, p in enumerate(turn):
                matcher.fill_next_token_bitmask(bits, k)
                if not matcher.accept_token(int(token_ids[p])):
                    raise ReplayError(f"token {int(token_ids[p])} at {p} is outside its turn's {field}")
            positions += turn
            blocks.append(bits)
        if not blocks:
            return RowMasks.none()
        return RowMasks(torch.tensor(positions, dtype=torch.long), torch.cat(blocks))
