"""Calls into an environment: each within its deadline, a synchronous one in a thread of its own,
its failure described for the trajectory (``env_error``), its session closed at the end."""

from __future__ import annotations

import asyncio
import inspect
import logging

from rollout.call_threads import run_in_thread
from sample_buffer.deadlines import wait_for

log = logging.getLogger(__name__)

_TOLD_GRACE_S = 1.0


async def env_call(fn, arg, timeout_s: float):
    """``fn(arg)`` within ``timeout_s``. A synchronous call runs in a daemon thread of its own
    (``call_threads``: reused once its call returns): a Python thread cannot be stopped, so one that
    hangs is left behind with its env (each episode builds its own), instead of holding a slot of a
    shared pool that every other episode needs."""
    if inspect.iscoroutinefunction(fn):
        # An environment that calls out (a remote provider) is told its deadline, to pass it on, and
        # is given a moment beyond it to say why it missed it (no provider up is the provider's
        # fault, not a slow step): the outer bound is a backstop.
        if "timeout_s" in inspect.signature(fn).parameters:
            return await wait_for(fn(arg, timeout_s=timeout_s), timeout_s + _TOLD_GRACE_S)
        return await wait_for(fn(arg), timeout_s)
    loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

    def settle(result, error) -> None:
        if not done.done():  # after a timeout nobody waits for it any more
            done.set_exception(error) if error is not None else done.set_result(result)

    def call() -> None:
        try:
            result, error = fn(arg), None
        except BaseException as e:  # handed to the episode, which ends it as env_error
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop closed while this call hung: nobody is waiting
            pass

    run_in_thread(call)
    return await wait_for(done, timeout_s)


def env_error(e: BaseException) -> dict:
    """What the trajectory keeps of an environment's failure: the message, and its kind where the
    environment says (a provider: unreachable, garbage, refused, observation, action)."""
    return {"error": f"{type(e).__name__}: {e}"[:500], "error_kind": getattr(e, "kind", "raised")}


async def close_env(env, timeout_s: float) -> None:
    """An environment with a ``close`` (a remote provider's session) is closed, within its deadline."""
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        if inspect.iscoroutinefunction(close):
            await wait_for(close(), timeout_s)
        else:
            await env_call(lambda _: close(), None, timeout_s)
    except Exception as e:  # the episode is over either way
        log.debug("closing %s: %s", env.name, e)
