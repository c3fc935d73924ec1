"""Threads for environments' synchronous calls: each call gets a thread of its own at once, as if one
were started for it, but a thread whose call has returned waits for the next call instead of exiting.

A thread per call keeps a hung call from holding a slot that other episodes need (a Python thread
cannot be stopped: it stays with its call). Starting one costs the event loop a wait for the new
thread to run (``Thread.start`` blocks until it has): at a few hundred env calls a second that was
the largest part of an EnvManager's time. Here only a call that finds no idle thread starts one; an
idle thread exits after ``IDLE_S``. Threads are daemons: a hung call never holds up the process's exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

IDLE_S = 30.0  # an idle thread waits this long for a call before it exits

_lock = threading.Lock()
_idle: list[_Worker] = []  # last in, first out: the warmest thread takes the next call


class _Worker(threading.Thread):
    def __init__(self, first: Callable[[], None]) -> None:
        super().__init__(name="env-call", daemon=True)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.calls.put(first)

    def run(self) -> None:
        while True:
            try:
                call = self.calls.get(timeout=IDLE_S)
            except queue.Empty:
                with _lock:
                    if self in _idle:  # still idle: nobody can hand it a call any more
                        _idle.remove(self)
                        return
                continue  # taken from the idle list just now: its call is on the way
            call()  # never raises: the caller's wrapper keeps the outcome
            with _lock:
                _idle.append(self)


def run_in_thread(call: Callable[[], None]) -> None:
    """Run ``call`` (which must not raise) in a thread that does nothing else meanwhile."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        _Worker(call).start()
    else:
        worker.calls.put(call)


def idle_threads() -> int:
    """Threads waiting for a call (for tests and metrics)."""
    with _lock:
        return len(_idle)
