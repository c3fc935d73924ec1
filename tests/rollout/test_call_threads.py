"""The threads environments' synchronous calls run in: one a call, reused, never shared by two calls."""

from __future__ import annotations

import threading
import time

from rollout import call_threads
from rollout.call_threads import run_in_thread


def _ran(block: threading.Event | None = None) -> tuple[threading.Event, list[threading.Thread]]:
    """Run a call that records its thread (and waits for ``block`` first, if given)."""
    done, where = threading.Event(), []

    def call() -> None:
        where.append(threading.current_thread())
        if block is not None:
            block.wait(10)
        done.set()

    run_in_thread(call)
    return done, where


def test_a_thread_whose_call_returned_takes_the_next_call():
    first, where_1 = _ran()
    assert first.wait(10)
    deadline = time.monotonic() + 10
    while call_threads.idle_threads() == 0:  # it goes idle just after its call returns
        assert time.monotonic() < deadline
        time.sleep(0.001)
    second, where_2 = _ran()
    assert second.wait(10)
    assert where_1[0].daemon and where_2[0] is where_1[0]


def test_a_hung_call_keeps_its_thread_and_holds_up_no_other():
    release = threading.Event()
    hung, where_hung = _ran(block=release)
    deadline = time.monotonic() + 10
    while not where_hung:  # its thread has taken it
        assert time.monotonic() < deadline
        time.sleep(0.001)
    try:
        others = [_ran() for _ in range(3)]
        assert all(done.wait(10) for done, _ in others)  # each ran while the first still hangs
        assert not hung.is_set() and all(where[0] is not where_hung[0] for _, where in others)
    finally:
        release.set()
    assert hung.wait(10)


def test_an_idle_thread_exits(monkeypatch):
    monkeypatch.setattr(call_threads, "IDLE_S", 0.05)
    done, where = _ran()
    assert done.wait(10)
    where[0].join(10)
    assert not where[0].is_alive()
