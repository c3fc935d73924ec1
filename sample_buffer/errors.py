"""Errors both loops share across their ports (neither may import the other's)."""

from __future__ import annotations

import asyncio


class TransientError(Exception):
    """A call that never reached its target, or found it busy or restarting (no engine in
    rotation, connection lost, server overloaded): worth another try within the caller's
    deadline. ``code`` names the cause for metrics (e.g. ``UNAVAILABLE``)."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code


def raise_if_cancelled() -> None:
    """For a loop that catches a failed call and goes on: not when its task is being cancelled. The
    cancel may reach it as the call's error (a gRPC call cancelled under it), and a loop that took it
    for a failure would go on for ever, with whoever stops it waiting. (A cancel that is lost
    altogether is ``asyncio.wait_for``'s on 3.11: ``sample_buffer/deadlines.py``.)"""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
