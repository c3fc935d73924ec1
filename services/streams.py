"""Reading what a running task hands over through a queue, as it arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def until_done(queue: asyncio.Queue, task: asyncio.Future) -> AsyncIterator:
    """Each item ``task`` puts on ``queue``, in order, until the task has ended and the queue is
    empty. A reader that stops (its caller went away) leaves no pending read behind."""
    while not (task.done() and queue.empty()):
        if not queue.empty():
            yield queue.get_nowait()
            continue
        get = asyncio.ensure_future(queue.get())
        try:
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            got = get.done()
            if not got:
                get.cancel()
        if got:
            yield get.result()
