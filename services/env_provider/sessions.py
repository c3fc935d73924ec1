"""The episodes an environment provider hosts: one rollmesh environment per episode id.

This is the plain object behind the provider's gRPC and HTTP servers (``server.py``): they
validate and convert, this runs the episodes. What it promises a caller:

- **A retried call is safe.** A ``reset`` for an episode that has not stepped yet answers its
  first observation again; a ``step`` whose ``request_id`` was the last one answered gets that
  answer again instead of being applied twice (``idempotent_steps`` in ``describe``).
- **Nothing waits past its deadline.** A reset or step runs under min(the caller's
  ``timeout_s``, ``step_timeout_s``); one that misses it ends its episode (the environment is in
  an unknown state) and the caller gets ``timeout``.
- **Bounded.** At most ``max_sessions`` episodes at once; one idle for ``session_idle_s`` (its
  caller died) is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.env_calls import close_env, env_call
from rollout.envs import base
from rollout.envs.base import Env
from rollout.envs.remote import Observation, ProviderInfo
from sample_buffer.vision import MAX_IMAGE_BYTES, MAX_IMAGES

log = logging.getLogger(__name__)
MAX_EPISODE_ID = 255  # OpenEnv's limit too


class SessionError(Exception):
    """A call the provider cannot serve. ``code``: ``invalid`` (the request; ``field`` names
    what), ``not_found`` (no such episode), ``busy`` (max_sessions reached), ``timeout`` (the
    environment missed the deadline), ``env`` (the environment raised)."""

    def __init__(self, code: str, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.code, self.field = code, field


@dataclass
class _Session:
    env: Env
    first: Observation
    steps: int = 0
    last_request: str | None = None
    last_answer: asyncio.Future | None = None  # of the last request_id: a retry waits for the same
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    used: float = field(default_factory=time.monotonic)


class ProviderSessions:
    def __init__(
        self,
        make_env: Callable[[], Env],
        name: str,
        *,
        max_sessions: int,
        step_timeout_s: float,
        session_idle_s: float,
        max_action_chars: int,
    ) -> None:
        """``name``: the environment's, where it has no ``name`` of its own."""
        self.make_env = make_env
        probe = make_env()  # what the hosted environment says of itself: its name, its budgets
        self.name, self.budgets = getattr(probe, "name", name), getattr(probe, "budgets", None)
        self.max_sessions, self.step_timeout_s = max_sessions, step_timeout_s
        self.session_idle_s, self.max_action_chars = session_idle_s, max_action_chars
        self.sessions: dict[str, _Session] = {}
        self.counters: dict[str, int] = {}

    def describe(self) -> ProviderInfo:
        return ProviderInfo(name=self.name, idempotent_steps=True, budgets=self.budgets)

    async def reset(self, episode_id: str, seed: int, timeout_s: float = 0.0) -> Observation:
        _check_id(episode_id)
        if episode_id in self.sessions:
            s = self.sessions[episode_id]
            if s.steps:
                raise SessionError("invalid", "episode_id", f"{episode_id!r} has already stepped; reset another id")
            return s.first  # a retried reset whose answer was lost
        if len(self.sessions) >= self.max_sessions:
            self._count("busy")
            raise SessionError("busy", "episode_id", f"{self.max_sessions} episodes running (max_sessions)")
        env = self.make_env()
        first = await self._call(env, "reset", seed, timeout_s)
        if episode_id in self.sessions:  # a concurrent reset of the same id won the race
            return self.sessions[episode_id].first
        text, images = _shown(first, "reset")
        obs = Observation(text, images=images)
        self.sessions[episode_id] = _Session(env, obs)
        self._count("reset")
        return obs

    async def step(self, episode_id: str, action: str, request_id: str = "", timeout_s: float = 0.0) -> Observation:
        s = self._session(episode_id)
        if not isinstance(action, str):
            raise SessionError("invalid", "action", f"expected text, got {type(action).__name__}")
        if len(action) > self.max_action_chars:
            raise SessionError(
                "invalid", "action", f"{len(action)} characters, more than this provider's {self.max_action_chars}"
            )
        if request_id and request_id == s.last_request and s.last_answer is not None:
            self._count("step_repeated")
            return await asyncio.shield(s.last_answer)
        async with s.lock:  # an episode's steps run one at a time, in order
            s.last_request, s.last_answer = request_id, asyncio.get_running_loop().create_future()
            try:
                result = await self._call(s.env, "step", action, timeout_s, episode_id)
                text, images = _shown(result.observation, "step") if result.observation is not None else ("", ())
                obs = Observation(
                    text,
                    getattr(result, "role", "user"),
                    float(result.reward),
                    bool(result.done),
                    dict(result.info or {}),
                    images=images,
                )
            except BaseException as e:
                s.last_answer.set_exception(e)
                s.last_answer.exception()  # retrieved: a retry may never come
                raise
            s.last_answer.set_result(obs)
            s.steps += 1
            s.used = time.monotonic()
            self._count("step")
            return obs

    async def close(self, episode_id: str) -> bool:
        s = self.sessions.pop(episode_id, None)
        if s is None:
            return False
        await close_env(s.env, 5.0)
        return True

    def state(self, episode_id: str) -> dict:
        return {"episode_id": episode_id, "step_count": self._session(episode_id).steps}

    async def expire_idle(self) -> int:
        """Close the episodes nobody stepped for ``session_idle_s``; returns how many."""
        now = time.monotonic()
        idle = [k for k, s in self.sessions.items() if now - s.used > self.session_idle_s and not s.lock.locked()]
        for k in idle:
            await self.close(k)
        self.counters["expired"] = self.counters.get("expired", 0) + len(idle)
        return len(idle)

    async def close_all(self) -> None:
        for k in list(self.sessions):
            await self.close(k)

    # ---------------------------------------------------------------- details
    def _session(self, episode_id: str) -> _Session:
        _check_id(episode_id)
        s = self.sessions.get(episode_id)
        if s is None:
            raise SessionError(
                "not_found",
                "episode_id",
                f"no episode {episode_id!r} (never reset, closed, expired or lost with a restart)",
            )
        s.used = time.monotonic()
        return s

    async def _call(self, env: Env, method: str, arg, timeout_s: float, episode_id: str | None = None):
        limit = min(timeout_s, self.step_timeout_s) if timeout_s and timeout_s > 0 else self.step_timeout_s
        try:
            return await env_call(getattr(env, method), arg, limit)
        except TimeoutError:
            self._count(f"{method}_timeout")
            if episode_id is not None:  # the environment may still be inside that step: the episode is over
                self.sessions.pop(episode_id, None)
            raise SessionError(
                "timeout", "timeout_s", f"the environment's {method} took longer than {limit:g} s; the episode is ended"
            ) from None
        except SessionError:
            raise
        except Exception as e:
            self._count(f"{method}_error")
            log.warning("%s: %s raised %s: %s", self.name, method, type(e).__name__, e)
            raise SessionError("env", method, f"the environment raised {type(e).__name__}: {e}"[:1000]) from None

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


def _check_id(episode_id: str) -> None:
    if not episode_id:
        raise SessionError("invalid", "episode_id", "required: this provider keeps one session per episode id")
    if len(episode_id) > MAX_EPISODE_ID:
        raise SessionError("invalid", "episode_id", f"longer than {MAX_EPISODE_ID} characters")


def _shown(value, method: str) -> tuple[str, tuple[bytes, ...]]:
    """An environment's observation: text, or text with images (``rollout.envs.base.Observation``)."""
    text, images = (value.text, tuple(value.images)) if isinstance(value, base.Observation) else (value, ())
    # the hosted environment's bugs: say so, do not send them on
    if not isinstance(text, str):
        raise SessionError("env", method, f"the environment's observation is {type(text).__name__}, not text")
    if not all(isinstance(x, bytes) for x in images):
        raise SessionError("env", method, "the environment's images are not all encoded bytes")
    if len(images) > MAX_IMAGES or any(len(x) > MAX_IMAGE_BYTES for x in images):
        raise SessionError(
            "env", method, f"the environment shows over {MAX_IMAGES} images or one over {MAX_IMAGE_BYTES} bytes"
        )
    return text, images
