"""Scoring: the log-probs an engine's model gives tokens it is handed (a prefill; nothing generated).

A teacher's call in on-policy distillation: the student sampled the tokens, the teacher's proxy
says how likely each was under the teacher (``trainer/distillation.py``). One engine call a
sequence, the least loaded engine, retried on another when one fails (taken out of rotation as a
failed generation's is), all within the call's deadline. A teacher is frozen: no lanes, adapters or
versions of its own, but a suspended proxy holds scoring at its gate as it holds generation.
"""

from __future__ import annotations

import time

from rollout.engines.contract import MAX_TOP_LOGPROBS
from rollout.engines.http_engine import EngineRejected, EngineUnavailable, ScoreResult
from rollout.proxy.pool import EnginePool
from rollout.proxy.request import NoEngineAvailable, RequestInvalid
from sample_buffer.deadlines import wait_for


class ScoreTimeout(TimeoutError):
    """The deadline passed before an engine answered (gRPC DEADLINE_EXCEEDED)."""


class Scoring:
    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    async def score(
        self, input_ids: list[int], start: int, timeout_s: float = 0.0, route: str = "", top_k: int = 0
    ) -> ScoreResult:
        """The log-prob of each token of ``input_ids`` from ``start`` (>= 1) on, and with ``top_k``
        each position's most likely tokens. ``route``: an affinity key (a group's sequences share
        their prompt: one engine's prefix cache serves them)."""
        if not input_ids:
            raise RequestInvalid("input_ids", "must not be empty")
        if not 1 <= start < len(input_ids):
            raise RequestInvalid("start", f"must be in [1, {len(input_ids)}) for {len(input_ids)} tokens, got {start}")
        if not 0 <= top_k <= MAX_TOP_LOGPROBS:
            raise RequestInvalid("top_k", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_k}")
        deadline = time.perf_counter() + (timeout_s or self.pool.config.request_timeout_s)
        failed: set[str] = set()
        while True:
            await self._open(deadline)
            slot = self.pool.router.pick(route, frozenset(failed))
            if slot is None:
                raise NoEngineAvailable(f"no engine in rotation ({len(failed)} failed this request)")
            client = self.pool.clients[slot.name]
            if not hasattr(client, "score"):
                raise RequestInvalid("input_ids", f"{type(client).__name__}'s engines do not score tokens")
            remaining = deadline - time.perf_counter()
            slot.in_flight += 1
            slot.outstanding_tokens += len(input_ids)
            slot.requests_total += 1
            try:
                # The engine's own timeout a little later than the deadline: a slow answer is this call's
                # timeout, not a failed engine taken out of rotation.
                call = client.score(input_ids, start, remaining + self.pool.config.abort_grace_s, top_k)
                out = await wait_for(call, remaining)
            except TimeoutError:
                self.pool.counters["score_timeouts"] += 1
                raise ScoreTimeout(f"no engine scored {len(input_ids)} tokens within the deadline") from None
            except EngineUnavailable as e:
                self.pool.take_out(slot, str(e))
                failed.add(slot.name)
                if len(failed) > self.pool.config.max_retries:
                    raise NoEngineAvailable(f"{len(failed)} engines failed this request; last: {e}") from e
                self.pool.counters["retries"] += 1
                continue
            except EngineRejected as e:
                field = e.field or "input_ids"
                raise RequestInvalid(field, str(e).removeprefix(f"{field}: ")) from e
            finally:
                slot.in_flight -= 1
                slot.outstanding_tokens -= len(input_ids)
            self.pool.counters["scored_tokens"] += len(out.logprobs)
            return out

    async def _open(self, deadline: float) -> None:
        gate = self.pool.base.gate
        if gate.is_set():
            return
        try:
            await wait_for(gate.wait(), max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            raise ScoreTimeout("the proxy stayed suspended past the deadline") from None
