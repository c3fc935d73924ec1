"""The simulated engine: continuous batching in simulated time, with the embedded engine's API.

It answers ``submit``/``abort``/``pause``/``resume``/``load_weights_from_disk`` exactly like
``EmbeddedEngine`` (the same HTTP server wraps either), but no model runs: every running request
gains one token per decode step, and a step lasts ``step_s(batch)`` simulated seconds, i.e.
``step_s / time_scale`` wall seconds. Time advances as a fluid between events (a request
finishing, arriving, aborting), so a 16k-token response costs a handful of loop iterations.

A request's target length is drawn from the length model keyed by its id (the part before
``#``, which the LLMProxy keeps across continuations) and its prompt length; a continued request
counts its already-generated tokens as the trailing run of ``token_id`` in its input.
Prefill time is not modelled: decode dominates long RL rollouts.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from rollout.engines.contract import EngineError, GenerateOutput, PauseMode
from rollout.engines.scheduler import SchedulerCommands
from rollout.engines.sim.config import SimEngineConfig
from rollout.engines.sim.lengths import draw_length, trailing_run
from rollout.sampling import SamplingParams


@dataclass
class _SimRequest:
    rid: str
    prompt_tokens: int
    remaining: int  # tokens still to generate in this request
    stop_at_end: bool  # the response ends inside this request (stop) rather than at max_new_tokens
    future: Future
    t0: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0
    versions: list[int] = field(default_factory=list)


class SimEngine(SchedulerCommands):
    """Simulated continuous batching; see the module docstring."""

    def __init__(self, sim: SimEngineConfig) -> None:
        self.sim = sim
        self.max_running = sim.max_running_requests
        self.model_path = sim.model_path or "sim"
        self.weight_version = 0
        self.checksum = "sim"
        self.vocab_size = 1 << 31
        self.counters: collections.Counter = collections.Counter()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._running: list[_SimRequest] = []
        self._waiting: collections.deque[_SimRequest] = collections.deque()
        self._paused = False
        self._carry = 0.0  # fraction of a decode step already elapsed
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sim-engine", daemon=True)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> SimEngine:
        self._thread.start()
        return self

    # ----------------------------------------------------------------- public API (any thread)
    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        if not input_ids:
            raise EngineError("input_ids", "must not be empty")
        if params.max_new_tokens <= 0:
            raise EngineError("sampling_params.max_new_tokens", f"must be >= 1, got {params.max_new_tokens}")

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams) -> Future:
        self.validate(input_ids, params)
        done = trailing_run(input_ids, self.sim.token_id)
        prompt = len(input_ids) - done
        prompt_key = (
            hashlib.blake2b(str(input_ids[:prompt]).encode(), digest_size=8).hexdigest()
            if self.sim.lengths.prompt_share
            else ""
        )
        target = draw_length(self.sim.lengths, f"{rid.split('#')[0]}:{prompt}", self.sim.seed, prompt_key)
        left = max(1, target - done)
        fut: Future = Future()
        req = _SimRequest(rid, len(input_ids), min(left, params.max_new_tokens), left <= params.max_new_tokens, fut)
        self._commands.put(lambda: self._enqueue(req))
        return fut

    def load_weights_from_disk(self, path: str, weight_version: int | None) -> Future:
        """Check the path, spend the simulated load time in the caller's thread, then swap."""
        if not os.path.exists(path):
            raise EngineError("model_path", f"cannot load {path}: no such file or directory")
        time.sleep(self.sim.weight_load_s / self.sim.time_scale)
        return self._call(lambda: self._swap(weight_version))

    def stage_tensors(self, tensors: dict) -> int:
        return len(tensors)

    def commit_staged(self, weight_version: int | None) -> Future:
        return self._call(lambda: self._swap(weight_version))

    def info(self) -> dict:
        return {
            "model_path": self.model_path,
            "served_model_name": "sim",
            "weight_version": str(self.weight_version),
            "weights_checksum": self.checksum,
            "is_generation": True,
            "device": "simulated",
            "time_scale": self.sim.time_scale,
        }

    # ----------------------------------------------------------------- scheduler thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._advance()
            try:
                self._commands.get(timeout=self._next_event_s())()
                while True:  # everything that arrived meanwhile
                    self._commands.get_nowait()()
            except queue.Empty:
                pass

    def _active(self) -> bool:
        return bool(self._running) and not self._paused

    def _next_event_s(self) -> float:
        """Wall seconds until the first running request finishes (0.5 s when idle)."""
        if not self._active():
            return 0.5
        steps = min(r.remaining for r in self._running) - self._carry
        return max(0.0, steps * self.sim.step_s(len(self._running)) / self.sim.time_scale)

    def _advance(self) -> None:
        """Give every running request the tokens of the decode steps elapsed since the last call."""
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        if not self._active():
            self._carry = 0.0
            return
        steps = self._carry + elapsed * self.sim.time_scale / self.sim.step_s(len(self._running))
        # Wake-ups land on the finishing step up to float error: round up within a millionth.
        whole = math.floor(steps + 1e-6)
        self._carry = max(0.0, steps - whole)
        if whole == 0:
            return
        still = []
        for req in self._running:
            n = min(whole, req.remaining)
            if n and not req.versions:
                req.t_first = time.perf_counter()
            req.remaining -= n
            req.versions += [self.weight_version] * n
            self.counters["generated_tokens"] += n
            if req.remaining == 0:
                self._finish(req, {"type": "stop"} if req.stop_at_end else {"type": "length"})
            else:
                still.append(req)
        self._running = still
        self._admit()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running and not self._paused:
            req = self._waiting.popleft()
            req.t_admit = req.t_admit or time.perf_counter()
            self._running.append(req)

    def _enqueue(self, req: _SimRequest) -> None:
        self._advance()  # the batch grows now: settle the time spent at the old size first
        self._waiting.append(req)
        self._admit()

    def _finish(self, req: _SimRequest, reason: dict) -> None:
        if req.future.done():
            return
        n = len(req.versions)
        self.counters[f"finish_{reason['type']}"] += 1
        req.future.set_result(
            GenerateOutput(
                rid=req.rid,
                output_ids=[self.sim.token_id] * n,
                behavior_logprobs=[-1.0] * n,
                token_versions=req.versions,
                finish_reason=reason,
                prompt_tokens=req.prompt_tokens,
                weight_version=self.weight_version,
                e2e_latency_s=time.perf_counter() - req.t0,
                queue_time_s=max(0.0, (req.t_admit or time.perf_counter()) - req.t0),
                ttft_s=max(0.0, req.t_first - req.t0) if req.t_first else 0.0,
            )
        )

    def _abort(self, rid: str | None, abort_all: bool) -> int:
        self._advance()
        victims = [r for r in list(self._running) + list(self._waiting) if abort_all or r.rid == rid]
        for req in victims:
            self._finish(req, {"type": "abort", "message": "aborted"})
        self._running = [r for r in self._running if r not in victims]
        self._waiting = collections.deque(r for r in self._waiting if r not in victims)
        self._admit()
        return len(victims)

    def _pause(self, mode: PauseMode) -> int:
        self._advance()
        self._paused = True
        if mode == "abort":
            return self._abort(None, abort_all=True)
        if mode == "retract":
            self._waiting.extendleft(reversed(self._running))
            self._running = []
        return len(self._running) + len(self._waiting)

    def _resume(self) -> None:
        self._advance()
        self._paused = False
        self._admit()

    def _swap(self, version: int | None) -> dict:
        self._advance()
        self.weight_version = version if version is not None else self.weight_version + 1
        return {"weight_version": str(self.weight_version), "checksum": self.checksum}
