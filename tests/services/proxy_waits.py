"""Wait for a generation to be decoding behind the LLMProxy instead of sleeping a fixed time: a
0.3 s sleep before an update assumed 300 tokens took longer, and once they took 0.27 s the update
came after the request had finished."""

from __future__ import annotations

import asyncio


async def decoding(proxy, timeout_s: float = 30.0, tokens_time_s: float = 0.05) -> None:
    """Return once the proxy has a request in flight, plus a few tokens' time for it to decode.

    The proxy cannot see tokens before a request ends, so the few tokens are a short wait; callers
    ask for a generation that takes ten or more times as long (600-1000 tokens of the tiny model)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not proxy.in_flight:
        assert loop.time() < deadline, f"no generation reached the proxy in {timeout_s} s"
        await asyncio.sleep(0.002)
    await asyncio.sleep(tokens_time_s)
