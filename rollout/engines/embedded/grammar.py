"""Decoding under a grammar: SGLang's ``json_schema``, ``regex`` and ``ebnf`` sampling params, with
xgrammar's token bitmask on the CPU.

A constrained row's logits are masked to the tokens its grammar allows next before anything is
computed from them, so the token is sampled from the masked, renormalised distribution and the
log-prob the engine reports (μ, and the top log-probs) is that distribution's: what the row was
really sampled from. Unconstrained rows of the same batch are untouched.

Compiling is bounded: a grammar's text is at most ``MAX_GRAMMAR_CHARS`` (``sample_buffer.grammars``),
and the engine server compiles before it queues a request, off its event loop and with a deadline
(``compile_within``); a grammar that does not compile is refused naming its field. Compiled
grammars are kept (the last ``CACHE`` of them): an agent's every turn sends the same schema.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from rollout.engines.contract import EngineError
from rollout.sampling import SamplingParams
from sample_buffer.grammars import compile_grammar

CACHE = 64  # compiled grammars kept
COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer is refused (its compile goes on, alone, in the background)
# Compiles past their deadline that may still run: xgrammar's cannot be stopped, so each one keeps its
# thread (and a core) until it ends. The next grammar gets a fresh thread, not a place behind it;
# while this many run, a new grammar is refused rather than another core given away.
MAX_OVERDUE = 2


class Grammars:
    """The compiled grammars of one engine's tokenizer, and a matcher per constrained request."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            need = "constrained decoding needs xgrammar: pip install rollmesh[grammar]"
            raise EngineError("sampling_params", need) from None

        self._xgr = xgr
        # The model's logits may be wider than the tokenizer's vocabulary (padding): the mask is as wide.
        # A finished answer may end with any token the engine stops at (its generation config's, not
        # only the tokenizer's eos_token).
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        # its own cache has no bound (one compiled grammar per distinct text): ours keeps CACHE
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")  # one compile at a time
        self._pending: dict[tuple[str, str], Future] = {}
        self._overdue: set[Future] = set()  # compiles past their deadline, still running

    def compile_within(self, params: SamplingParams, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """Compile ``params``' grammar (if any) into the cache, or raise ``EngineError`` naming its
        field: it does not compile, or not within ``timeout_s``."""
        key = params.grammar()
        if key is None or self._cached(key) is not None:
            return
        field = f"sampling_params.{key[0]}"
        with self._lock:
            future = self._pending.get(key)
            if future is None:
                if len(self._overdue) >= MAX_OVERDUE:
                    busy = f"{len(self._overdue)} grammars past their compile deadline still compile here; retry later"
                    raise EngineError(field, busy)
                future = self._pending[key] = self._pool.submit(self._compile, key)
        try:
            future.result(timeout_s)
        except FutureTimeout:
            with self._lock:
                if future not in self._overdue and not future.done():
                    # its thread is taken until it ends: the next grammar compiles on a new one
                    self._overdue.add(future)
                    future.add_done_callback(self._overdue.discard)
                    self._pool.shutdown(wait=False)
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            raise EngineError(field, f"did not compile within {timeout_s:g} s") from None

    def matcher(self, params: SamplingParams):
        """A fresh matcher for ``params``' grammar, or None when it has none (compiled here if the
        server did not compile it first: in-process callers)."""
        key = params.grammar()
        if key is None:
            return None
        return self._xgr.GrammarMatcher(self._cached(key) or self._compile(key))

    def _cached(self, key: tuple[str, str]):
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
            return found

    def _compile(self, key: tuple[str, str]):
        kind, text = key
        try:
            compiled = compile_grammar(self._compiler, kind, text)
        except Exception as e:  # xgrammar's errors are RuntimeErrors naming the position
            raise EngineError(f"sampling_params.{kind}", f"does not compile: {str(e).strip()[:500]}") from None
        finally:
            with self._lock:
                self._pending.pop(key, None)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def masked(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """``logits`` [B, V] with each constrained row (a matcher) limited to what its grammar allows
        next (-inf elsewhere); the same tensor when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            matchers[i].fill_next_token_bitmask(bitmask, j)
        out = logits.float().clone()
        # On the CPU, whatever the logits' device: xgrammar's GPU path is a triton kernel, not installed
        picked = out[rows].cpu()
        self._xgr.apply_token_bitmask_inplace(picked, bitmask)
        out[rows] = picked.to(out.device)
        return out
