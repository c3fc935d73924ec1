"""Rewards scored in worker processes: a CPU-heavy verifier never holds the caller's GIL, and one
that hangs or crashes costs that one score, never the run.

``RewardPool(name, workers, timeout_s)`` is a reward function (``pool(response, answer)``) like
the ones in ``rollout/rewards.py``, so an environment calls it as it calls any reward. Each call
borrows a worker (at most ``workers`` run at once; a call waits for a free one), sends it the
response and answer, and waits up to ``timeout_s`` (the wait for a worker included: ``busy`` when
none came free). A verifier that raises scores 0 (``raised``);
one that runs past its timeout is killed and its worker replaced (``timeout``); a worker that dies
(a crash, ``os._exit``, the OOM killer) is replaced (``crashed``). Every failure is counted by
cause in ``failures``. Workers start on first use, with the ``spawn`` method: the caller may run
threads (gRPC, the event loop) that ``fork`` would copy half-locked.

The call blocks its thread; environments step in threads (``rollout/episode.py``), so the
event loop goes on meanwhile.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

FAILURE_CAUSES = ("raised", "timeout", "crashed", "busy")


def _serve(name: str, conn: Connection) -> None:
    """A worker: score each (response, answer) it is sent with the reward ``name``."""
    from rollout.rewards import resolve_reward

    fn = resolve_reward(name)
    while True:
        try:
            response, answer = conn.recv()
        except EOFError:  # the pool closed
            return
        try:
            conn.send(("ok", float(fn(response, answer))))
        except Exception as e:
            conn.send(("raised", f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(name, child), daemon=True, name=f"reward-{name}")
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    def __init__(self, name: str, workers: int = 2, timeout_s: float = 30.0) -> None:
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.name, self.workers, self.timeout_s = name, workers, timeout_s
        self.failures: Counter[str] = Counter({cause: 0 for cause in FAILURE_CAUSES})
        self.calls = 0
        self._ctx = mp.get_context("spawn")
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._closed = False
        for _ in range(workers):
            self._idle.put(None)  # a slot; its worker starts on first use

    def __call__(self, response: str, answer: str) -> float:
        return self.scored(response, answer)[0]

    def scored(self, response: str, answer: str, timeout_s: float | None = None) -> tuple[float, str]:
        """The score and, when a fault cut it to 0, its cause ("" otherwise). ``timeout_s``: the
        caller's own bound, when shorter than the pool's; it covers the wait for a free worker too
        (none in time: ``busy``)."""
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        deadline = time.monotonic() + limit
        try:
            worker = self._idle.get(timeout=limit)  # the concurrency limit: a call waits for a free worker
        except queue.Empty:
            with self._lock:
                self.failures["busy"] += 1
            return 0.0, "busy"
        try:
            if self._closed:
                raise RuntimeError(f"reward pool {self.name}: closed")
            worker = worker or self._start()
            reward, cause, worker = self._score(worker, response, answer, max(0.01, deadline - time.monotonic()))
            return reward, cause
        finally:
            self._idle.put(worker)

    def _score(self, worker: _Worker, response: str, answer: str, limit: float) -> tuple[float, str, _Worker | None]:
        with self._lock:
            self.calls += 1
        try:
            worker.conn.send((response, answer))
            if not worker.conn.poll(limit):
                return self._failed("timeout", worker, f"no score within {limit:g} s: killed")
            status, value = worker.conn.recv()
        except (EOFError, OSError) as e:  # the worker died under the call
            return self._failed(
                "crashed", worker, f"the worker died ({type(e).__name__}; exit code {worker.proc.exitcode})"
            )
        if status != "ok":
            with self._lock:
                self.failures["raised"] += 1
            log.warning("reward %s raised: %s (scored 0)", self.name, value)
            return 0.0, "raised", worker
        return value, "", worker

    def _failed(self, cause: str, worker: _Worker, why: str) -> tuple[float, str, None]:
        worker.kill()
        with self._lock:
            self.failures[cause] += 1
            if worker in self._all:  # not when the pool closed meanwhile
                self._all.remove(worker)
        log.warning("reward %s: %s (scored 0; the worker is replaced)", self.name, why)
        return 0.0, cause, None  # its slot starts a fresh worker on next use

    def _start(self) -> _Worker:
        worker = _Worker(self._ctx, self.name)
        with self._lock:
            self._all.append(worker)
        return worker

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a call still waiting for a slot starts no worker
            workers, self._all = self._all, []
        for w in workers:
            w.kill()
