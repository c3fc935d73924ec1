"""What the embedded and the simulated engine share: one scheduler thread that owns the running
batch, and commands from any thread that run in it between two steps."""

from __future__ import annotations

from concurrent.futures import Future

from rollout.engines.contract import PauseMode


class SchedulerCommands:
    """Mixin. The engine sets ``_commands`` (a ``queue.SimpleQueue``), ``_thread``, ``_stop``,
    ``_running``, ``_waiting``, ``_paused`` and ``weight_version``, and implements ``_abort``,
    ``_pause``, ``_resume`` and ``_finish``; its scheduler thread runs what ``_call`` queues."""

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout_s)
        for req in list(self._running) + list(self._waiting):
            self._finish(req, {"type": "abort", "message": "engine shut down"})

    def abort(self, rid: str | None = None, abort_all: bool = False) -> Future:
        """Abort one request (or all): it returns its partial output with finish type 'abort'."""
        return self._call(lambda: self._abort(rid, abort_all))

    def pause(self, mode: PauseMode = "abort") -> Future:
        return self._call(lambda: self._pause(mode))

    def resume(self) -> Future:
        return self._call(self._resume)

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
