"""An environment that runs elsewhere: a pool of environment providers reached over gRPC or HTTP.

The rollout loop sees a ``RemoteEnv`` like any other environment (``reset`` / ``step``); behind
it a ``ProviderPool`` picks a provider for each new episode and keeps the episode on it. What
a wire looks like is the ``ProviderClient`` port's business (``services/env_provider/`` has the
gRPC, REST and OpenEnv WebSocket clients); what is safe to do when a call fails is decided here:

- a ``reset`` that found a provider at fault (or at its limit of episodes) is tried again, on
  another provider if one is up, until the step deadline runs out: nothing has happened in an
  episode that never started;
- a ``step`` is retried only where the provider said its steps are idempotent (it answers a
  repeated ``request_id`` with the answer it already gave); anywhere else a step that failed
  may have been applied, so the episode ends as ``env_error``;
- a provider that failed a call is out of rotation until a health check passes again, tried no
  more often than every ``health_interval_s``: a restarted provider is used again by itself.

An observation that is empty (while the episode goes on), too long or not text, or that shows
more images or larger ones than a prompt may hold (``sample_buffer/vision.py``), ends the
episode with an error that says which; an action longer than the provider takes is refused
before it is sent. An empty action is sent as it is: it is the policy's answer, and the
environment scores it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout.budgets import Budgets
from rollout.envs import base
from rollout.envs.base import StepResult
from sample_buffer.registry import resolve
from sample_buffer.vision import MAX_IMAGE_BYTES, MAX_IMAGES

log = logging.getLogger(__name__)
# The protocols a provider may speak; services/env_provider/clients.py has one client for each.
EnvProtocol = Literal["grpc", "http", "openenv"]
PROTOCOLS: tuple[str, ...] = get_args(EnvProtocol)


class ProviderError(Exception):
    """A provider call that failed, with what kind of failure it was: ``unreachable`` (no
    answer, refused or dropped connection), ``garbage`` (an answer that is not the contract),
    ``refused`` (the provider answered with an error: a bad request, an unknown episode, its
    environment raised), ``observation`` (an observation that is empty, too long or not text)
    ``action`` (an action longer than the provider takes), ``invalid_action`` (one the environment
    refused as invalid, or action_format could not make: the episode ends, scored), ``busy`` (at
    its limit of episodes: another provider may take it) or ``timeout`` (``ProviderTimeout``)."""

    def __init__(self, kind: str, message: str, retryable: bool | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.retryable = kind == "unreachable" if retryable is None else retryable


class ProviderTimeout(ProviderError, TimeoutError):
    """The provider answered that its environment missed the deadline: the episode timed out (the
    provider itself is fine)."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message, retryable=False)


class NoProviderUp(ProviderError):
    """Every provider of the pool is out of rotation (or was tried) now."""


@dataclass
class Observation:
    """What a provider answers to ``reset`` and ``step``."""

    content: str
    role: str = "user"  # "user", or "tool" for a tool's result
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    images: tuple[bytes, ...] = ()  # encoded, shown before the text (a vision-language task's)

    def shown(self) -> str | base.Observation:
        """What the episode sees: the text, or the text with its images."""
        return base.Observation(self.content, self.images) if self.images else self.content


@dataclass
class ProviderInfo:
    """What a provider says about itself (its ``/metadata``, or gRPC ``Describe``)."""

    name: str = ""
    idempotent_steps: bool = False  # a repeated step request_id is answered, not applied again
    budgets: Budgets | None = None  # the environment's latency budgets


class ProviderClient(Protocol):
    """One provider (one address), as the pool sees it. Every call takes a timeout and raises
    ``ProviderError`` (or ``TimeoutError``) on failure."""

    address: str

    async def describe(self, timeout_s: float) -> ProviderInfo: ...

    async def reset(self, episode_id: str, seed: int, timeout_s: float) -> Observation: ...

    async def step(self, episode_id: str, action: str, request_id: str, timeout_s: float) -> Observation: ...

    async def close_episode(self, episode_id: str, timeout_s: float) -> None: ...

    async def healthy(self, timeout_s: float) -> bool: ...

    async def aclose(self) -> None: ...


class RemoteEnvConfig(BaseModel):
    """Episodes on external environment providers (``rollout/envs/remote.py``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["remote"] = Field("remote", description="Selects environments served by providers.")
    protocol: EnvProtocol = Field(
        "grpc",
        description="grpc: rollmesh's EnvProvider service. http: the same over REST (OpenEnv's /reset and /step, "
        "sessions keyed by episode_id). openenv: OpenEnv's WebSocket sessions (/ws), for any server written "
        "for OpenEnv.",
    )
    addresses: list[str] = Field(
        ..., min_length=1, description="Providers to spread episodes over: host:port (grpc) or http(s)://host:port."
    )
    num_seeds: int = Field(
        1000,
        ge=1,
        description="Episodes are seeded 0 .. num_seeds - 1, in the rollout's shuffled order; the "
        "provider maps a seed to its task (a dataset row, a game).",
    )
    env_name: str = Field("", description="Passed to the provider's reset (a provider may host several).")
    call_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of one call to a provider; a step's is also capped by the step deadline."
    )
    health_interval_s: float = Field(
        1.0, gt=0, description="A provider out of rotation is health-checked at most this often."
    )
    step_retries: int = Field(
        2,
        ge=0,
        description="Times a step that got no answer is sent again (0.2 s, then doubling), only to a "
        "provider that declares its steps idempotent; elsewhere the episode ends as env_error at once.",
    )
    max_observation_chars: int = Field(
        65_536, ge=1, description="A longer observation ends the episode as env_error (it would flood the context)."
    )
    max_action_chars: int = Field(65_536, ge=1, description="A longer action is refused before it is sent.")
    action_key: str = Field("content", description="openenv: the action field that carries the model's text.")
    observation_key: str | list[str] = Field(
        "content",
        description="openenv: the observation field with the text the model sees, or several: the first that "
        "holds any ([messages, prompt]: the feedback once there is some, the rules before). A field may hold "
        "text or a list of messages (their contents, one per line).",
    )
    image_key: str = Field(
        "images",
        description="http/openenv: the observation field with images to show before its text (a vision-"
        "language task's): a data URL or base64 string, or a list of them; missing or null: none. URLs are "
        "refused, never fetched.",
    )
    observation_format: str | None = Field(
        None,
        description="openenv: 'module:function' taking the observation (a dict) and returning the text the "
        "model sees, for shapes observation_key cannot say; it replaces observation_key.",
    )
    action_format: str | None = Field(
        None,
        description="http/openenv: 'module:function' turning the model's text into the action the environment "
        "takes (a typed one: an integer, a move): a dict of the action's fields, or the value of action_key. A "
        "ValueError from it means the text is no valid action (as the environment's own validation error: the "
        "episode ends with invalid_action_reward); another exception ends it as env_error.",
    )
    invalid_action_reward: float = Field(
        0.0,
        description="Reward of an episode whose action was not valid (action_format's ValueError, or the "
        "environment's validation error): the policy's mistake, not the provider's. The episode ends there, its "
        "tokens are trained on, the provider stays in rotation (rollmesh_env_invalid_actions_total).",
    )
    token_env: str | None = Field(
        "ROLLMESH_PROVIDER_TOKEN",
        description="Environment variable with the providers' token, their own (never the mesh's); "
        "null: send none (a provider on a closed network that checks none).",
    )

    @field_validator("addresses")
    @classmethod
    def _distinct(cls, addresses: list[str]) -> list[str]:
        if len(set(addresses)) != len(addresses):
            raise ValueError("a provider is listed twice")
        return addresses

    @field_validator("observation_format", "action_format")
    @classmethod
    def _importable(cls, path: str | None, info) -> str | None:
        if path is not None and not callable(resolve(info.field_name, path, {})):
            raise ValueError(f"{info.field_name}: {path!r} is not 'module:function'")
        return path

    @model_validator(mode="after")
    def _typed_actions_over_json(self) -> RemoteEnvConfig:
        if self.action_format and self.protocol == "grpc":
            raise ValueError("action_format: a gRPC provider takes the model's text; typed actions are http/openenv")
        return self

    def build(self, rows=None, reward_fn=None):
        raise ValueError("env.type remote: episodes need a provider pool; the EnvManager builds it (services/)")


@dataclass
class _Member:
    client: ProviderClient
    episodes: int = 0  # in progress on it
    up: bool = True
    next_check: float = 0.0  # monotonic time of the next health check while down
    info: ProviderInfo | None = None


class ProviderPool:
    """Providers in rotation: a new episode goes to the up provider with the fewest episodes."""

    def __init__(self, clients: list[ProviderClient], config: RemoteEnvConfig) -> None:
        self.config = config
        self.members = [_Member(c) for c in clients]
        self.counters: dict[str, int] = {}  # failures by kind, marked down, back up

    def count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    async def pick(self, exclude: set[int] = frozenset()) -> _Member:
        """The least-loaded provider that is up; one that is down is health-checked when its
        interval has passed. ``NoProviderUp`` when none can be used now."""
        now = time.monotonic()
        due = [m for i, m in enumerate(self.members) if not m.up and now >= m.next_check and i not in exclude]
        for m in due:
            m.next_check = now + self.config.health_interval_s
        if due:
            checks = await asyncio.gather(*(self._check(m) for m in due))
            for m, ok in zip(due, checks):
                if ok:
                    m.up = True
                    self.count("back_up")
                    log.info("provider %s is healthy again", m.client.address)
        up = [m for i, m in enumerate(self.members) if m.up and i not in exclude]
        if not up:
            raise NoProviderUp("unreachable", f"none of {len(self.members)} provider(s) is up")
        return min(up, key=lambda m: m.episodes)

    async def _check(self, member: _Member) -> bool:
        try:
            return await member.client.healthy(min(self.config.call_timeout_s, 5.0))
        except Exception:  # a health check that fails in any way says "not yet"
            return False

    def down(self, member: _Member, error: BaseException) -> None:
        """Out of rotation until a health check passes (no sooner than ``health_interval_s``)."""
        if member.up:
            member.up = False
            self.count("marked_down")
            log.warning("provider %s out of rotation: %s", member.client.address, error)
        member.next_check = time.monotonic() + self.config.health_interval_s
        member.info = None  # a restarted provider may say otherwise

    async def aclose(self) -> None:
        await asyncio.gather(*(m.client.aclose() for m in self.members), return_exceptions=True)


class RemoteEnv:
    """One episode on a provider of ``pool``. Build one per episode, like any environment."""

    def __init__(self, pool: ProviderPool, episode_id: str, name: str = "remote") -> None:
        self.pool, self.config, self.episode_id, self.name = pool, pool.config, episode_id, name
        self._member: _Member | None = None
        self._steps = 0

    @property
    def budgets(self) -> Budgets | None:
        """The latency budgets its provider declared (known once the episode is reset)."""
        member = self._member
        return member.info.budgets if member is not None and member.info is not None else None

    async def reset(self, seed: int, timeout_s: float | None = None) -> str | base.Observation:
        """Start the episode on an up provider, trying the others (and the same again once it is
        healthy) until ``timeout_s`` runs out: a reset that failed changed nothing."""
        deadline = time.monotonic() + (timeout_s or self.config.call_timeout_s)
        tried: set[int] = set()  # providers that failed this reset: the others first
        last: BaseException | None = None  # why the last try failed: what a reset out of time says
        while True:
            if time.monotonic() >= deadline:  # no call after it: one with no time left would look like a fault
                raise last if last is not None else TimeoutError("reset: no provider answered in time")
            try:
                member = await self.pool.pick(exclude=tried)
            except NoProviderUp as e:
                if not tried:  # none up (not merely all busy)
                    last = e
                # None is up: wait for a health check to be due; every one tried (busy): a moment.
                wait_s = 0.1 if tried else self.config.health_interval_s
                await asyncio.sleep(min(wait_s, max(0.0, deadline - time.monotonic())))
                tried = set()
                continue
            try:
                if member.info is None:  # once per provider (again after it was down): what it promises
                    member.info = await member.client.describe(self._timeout(deadline))
                obs = await member.client.reset(self.episode_id, seed, self._timeout(deadline))
            except (ProviderError, TimeoutError) as e:
                self._failed(member, e)
                busy = isinstance(e, ProviderError) and e.kind == "busy"
                if not (_at_fault(e) or busy):
                    raise
                last = e
                tried.add(self.pool.members.index(member))
                continue
            member.episodes += 1
            self._member = member
            return self._checked(obs).shown()

    async def step(self, action: str, timeout_s: float | None = None) -> StepResult:
        if self._member is None:
            raise RuntimeError("step() before reset()")
        if len(action) > self.config.max_action_chars:
            raise ProviderError(
                "action", f"{len(action)} characters, more than max_action_chars {self.config.max_action_chars}"
            )
        self._steps += 1
        request_id = f"{self.episode_id}/{self._steps}"
        deadline = time.monotonic() + (timeout_s or self.config.call_timeout_s)
        member, delay = self._member, 0.2
        idempotent = member.info is not None and member.info.idempotent_steps  # as promised at reset
        for attempt in range(self.config.step_retries + 1):
            try:
                obs = await member.client.step(self.episode_id, action, request_id, self._timeout(deadline))
                break
            except (ProviderError, TimeoutError) as e:
                if isinstance(e, ProviderError) and e.kind == "invalid_action":
                    # the policy's mistake, not the provider's: the episode ends as any other does, scored,
                    # its tokens trained on (the model must learn to answer validly), the provider kept
                    self.pool.count("invalid_action")
                    return StepResult(None, self.config.invalid_action_reward, True, {"invalid_action": str(e)})
                self._failed(member, e)
                # A step that failed may have been applied: again only where the provider dedupes it.
                if not (_retryable(e) and idempotent) or attempt == self.config.step_retries:
                    raise
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:  # no try with no time left: it would look like a fault
                    raise
                delay *= 2
        obs = self._checked(obs)
        return StepResult(None if obs.done else obs.shown(), obs.reward, obs.done, obs.info, obs.role)

    async def close(self) -> None:
        """End the episode on its provider (best effort: a provider that is gone has ended it)."""
        member, self._member = self._member, None
        if member is None:
            return
        member.episodes -= 1
        try:
            await member.client.close_episode(self.episode_id, min(self.config.call_timeout_s, 5.0))
        except Exception as e:  # the episode is over either way; a provider expires idle sessions
            log.debug("closing %s on %s: %s", self.episode_id, member.client.address, e)

    # ---------------------------------------------------------------- details
    def _timeout(self, deadline: float) -> float:
        return max(0.001, min(self.config.call_timeout_s, deadline - time.monotonic()))

    def _failed(self, member: _Member, error: BaseException) -> None:
        self.pool.count(f"failed_{error.kind if isinstance(error, ProviderError) else 'no_answer'}")
        if _at_fault(error):
            self.pool.down(member, error)

    def _checked(self, obs: Observation) -> Observation:
        if not isinstance(obs.content, str):
            raise ProviderError("observation", f"not text ({type(obs.content).__name__})")
        if len(obs.content) > self.config.max_observation_chars:
            raise ProviderError(
                "observation",
                f"{len(obs.content)} characters, more than max_observation_chars {self.config.max_observation_chars}",
            )
        if not obs.done and not obs.content.strip() and not obs.images:
            raise ProviderError("observation", "empty while the episode goes on")
        if len(obs.images) > MAX_IMAGES:
            raise ProviderError("observation", f"{len(obs.images)} images, more than a prompt's {MAX_IMAGES}")
        if big := [i for i, x in enumerate(obs.images) if len(x) > MAX_IMAGE_BYTES]:
            raise ProviderError("observation", f"images[{big[0]}]: over {MAX_IMAGE_BYTES} bytes")
        return obs


def _at_fault(error: BaseException) -> bool:
    """The provider, not the request, failed: no answer, no connection, or an answer that is not the
    contract. It leaves the rotation until a health check passes (a busy one stays: it answered)."""
    if isinstance(error, ProviderError):
        return error.kind in ("unreachable", "garbage")
    return isinstance(error, TimeoutError)


def _retryable(error: BaseException) -> bool:
    """A call that got no answer, or could not reach the provider, may succeed if sent again."""
    if isinstance(error, ProviderError):
        return error.retryable
    return isinstance(error, TimeoutError)
