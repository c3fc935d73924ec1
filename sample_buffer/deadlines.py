"""Waiting with a deadline, for both loops and every service (neither loop may import the other's).

``asyncio.wait_for`` on Python 3.11 loses a cancel: when what it awaits finishes in the same turn of
the event loop as its caller is cancelled, it returns the result, and the caller goes on as if it
had never been cancelled. A loop that waits, sleeps and waits again then never ends, and whoever
cancelled it waits for it for ever (a test's teardown did, in two CI runs: the controller's buffer
poll and the rollout loop's tasks go round like that). Python 3.12 rebuilt ``wait_for`` on
``asyncio.timeout``, which keeps the cancel; ``wait_for`` here is that. ruff refuses
``asyncio.wait_for`` everywhere else (pyproject.toml, banned-api).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``aw``'s result, or ``TimeoutError`` after ``timeout`` seconds (None: no limit; <= 0: at its
    first wait), with ``aw`` cancelled then; ``asyncio.wait_for``'s arguments. A cancel of the
    caller always reaches the caller."""
    async with asyncio.timeout(timeout):
        return await aw
