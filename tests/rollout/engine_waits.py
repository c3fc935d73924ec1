"""Wait on the embedded engine's progress instead of sleeping: a sleep that assumed a request
would still be decoding failed once the tiny model got faster (300 tokens in 0.27 s)."""

from __future__ import annotations

import time


def wait_decoding(engine, rid: str, tokens: int = 2, timeout_s: float = 60.0) -> None:
    """Return once request ``rid`` has decoded ``tokens`` tokens and is still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        # Read from the test thread while the engine thread appends: a list copy under the GIL.
        running = {r.rid: len(r.output_ids) for r in list(engine._running)}
        if running.get(rid, 0) >= tokens:
            return
        assert time.monotonic() < deadline, f"request {rid} did not decode {tokens} tokens in {timeout_s} s"
        time.sleep(0.001)
