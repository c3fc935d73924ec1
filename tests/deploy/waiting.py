"""Waiting, bounded, for what a deployment test watches happen (a job's steps, a container's health)."""

from __future__ import annotations

import time


def wait_for(what, timeout_s: float, message, every_s: float = 0.5):
    """``what()``'s first truthy value, polled every ``every_s``; TimeoutError with ``message`` (or
    ``message()``: the state at the end) if none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(every_s)
    raise TimeoutError(message() if callable(message) else message)
