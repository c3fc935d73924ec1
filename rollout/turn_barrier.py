"""A barrier for synchronous (batch) rollout: nobody passes until every live episode arrives.

Batch rollout, the baseline that queue scheduling beats, generates every response of a step,
then scores them all, then starts the next turn. Episodes end at different turns, so unlike
``asyncio.Barrier`` the party count shrinks: a finished episode ``leave``s.
"""

from __future__ import annotations

import asyncio


class TurnBarrier:
    def __init__(self, parties: int) -> None:
        if parties < 1:
            raise ValueError(f"parties: must be >= 1, got {parties}")
        self.parties = parties
        self._arrived = 0
        self._open = asyncio.Event()

    def _release_if_all_here(self) -> None:
        if self.parties and self._arrived >= self.parties:
            self._arrived = 0
            self._open.set()
            self._open = asyncio.Event()  # the next round waits on a fresh event

    async def wait(self) -> None:
        gate = self._open
        self._arrived += 1
        self._release_if_all_here()
        await gate.wait()

    def leave(self) -> None:
        self.parties -= 1
        self._release_if_all_here()
