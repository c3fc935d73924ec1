"""What the embedded and the simulated engine share: one scheduler thread that owns the running
batch, and commands from any thread that run in it between two steps."""

from __future__ import annotations

from concurrent.futures import Future


class SchedulerCommands:
    """Mixin. The engine sets ``_commands`` (a ``queue.SimpleQueue``), ``_running``, ``_waiting``,
    ``_paused`` and ``weight_version``; its scheduler thread runs what ``_call`` queues."""

    def load(self) -> dict:
        return {
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "paused": self._paused,
            "weight_version": self.weight_version,
        }

    def _call(self, fn) -> Future:
        """Run ``fn`` in the scheduler thread; its result or exception comes back in the future."""
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except Exception as e:  # reported to the caller, the loop goes on
                fut.set_exception(e)

        self._commands.put(run)
        return fut
