"""One episode: render the observation once, generate, step the environment, repeat.

Token-in, token-out: the prompt is rendered once with the chat template; generated tokens go
into the trajectory exactly as the engine produced them and are never re-tokenized; a later
turn (the environment's ``user`` or ``tool`` message) is the text the template adds for it
(``rollout/chat_turns.py``), appended with loss mask 0. Every generation and every
environment call (reset and step) has a deadline; missing one ends the trajectory with
``timeout``, and an environment that raises ends it with ``env_error``. What becomes of such a
member is the rollout loop's call (``RolloutConfig.faulty_members``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
import time
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field

from rollout.budgets import EpisodeClock
from rollout.call_threads import run_in_thread
from rollout.chat_turns import Conversation
from rollout.envs.base import Env, Observation
from rollout.ports import Generation, RolloutObserver
from rollout.sampling import SamplingParams
from rollout.turn_barrier import TurnBarrier
from sample_buffer import routing
from sample_buffer.trajectory import FinishReason, Trajectory
from sample_buffer.vision import MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES, VisionError, content_hash

# generate(input_ids, sampling, trajectory_id, timeout_s[, images=...]) -> Generation (images: a vision prompt's)
GenerateFn = Callable[[list[int], SamplingParams, str, float], Awaitable[Generation]]
_ENDS_EPISODE = (FinishReason.TIMEOUT, FinishReason.ABORT)
log = logging.getLogger(__name__)


class LatencyPenalty(BaseModel):
    """A documented reward shaping for latency: ``reward -= penalty`` per turn over ``target_s``."""

    model_config = ConfigDict(extra="forbid")

    target_s: float = Field(..., gt=0, description="A turn that takes longer (generation + step, seconds) pays.")
    penalty: float = Field(..., ge=0, description="Reward taken off per turn over the target.")


class EpisodeConfig(BaseModel):
    """Per-episode limits and sampling."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(1, ge=1, description="Generations per episode at most.")
    sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="How every turn's generation samples (SamplingParams' defaults)."
    )
    generation_timeout_s: float = Field(60.0, gt=0, description="Deadline of one generation (suspension included).")
    step_timeout_s: float = Field(30.0, gt=0, description="Deadline of one environment step (reward included).")
    latency_penalty: LatencyPenalty | None = Field(
        None,
        description="Let the reward see each turn's latency: a turn (generation and step) longer than target_s "
        "costs `penalty`; trajectories record turns_over_target, and rollmesh_env_turns_over_target_total counts "
        "them, so a policy can learn to answer within its budget. None: latency does not touch the reward.",
    )


async def run_episode(
    env: Env,
    seed: int,
    generate: GenerateFn,
    tokenizer,
    config: EpisodeConfig,
    *,
    trajectory_id: str,
    group_id: str,
    prompt_id: str,
    barrier: TurnBarrier | None = None,
    observer: RolloutObserver | None = None,
    domain: str = "",
    vision=None,
    image_store: dict[str, bytes] | None = None,
) -> Trajectory:
    """Run one episode. With a ``barrier`` (batch rollout) every turn's generation waits for all
    episodes' generations, and every environment step for all episodes' steps. ``vision``: a
    vision-language model's ``sample_buffer.vision.Vision`` (an environment's images need one);
    ``image_store`` receives the images the trajectory references, by content hash (its group's)."""
    try:
        t0 = time.monotonic()
        observer = observer or RolloutObserver()
        traj = await _run_episode(
            env,
            seed,
            generate,
            tokenizer,
            config,
            trajectory_id,
            group_id,
            prompt_id,
            barrier,
            observer,
            vision,
            {} if image_store is None else image_store,
        )
        _report(observer.episode_ended, traj, time.monotonic() - t0, domain)
        return traj
    finally:
        if barrier is not None:
            barrier.leave()
        await close_env(env, config.step_timeout_s)


def _report(hook, *args) -> None:
    """A metrics fault is logged, never the end of an episode."""
    try:
        hook(*args)
    except Exception:
        log.exception("reporting to the rollout observer failed")


_TOLD_GRACE_S = 1.0
# How engines say a prompt (with the tokens asked for) does not fit: the embedded engine ("fills / exceeds
# the model's context"), vLLM ("maximum context length"), SGLang ("longer than the model's context length").
_CONTEXT_FULL = re.compile(r"model's context|context length", re.IGNORECASE)


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
            return await asyncio.wait_for(fn(arg, timeout_s=timeout_s), timeout_s + _TOLD_GRACE_S)
        return await asyncio.wait_for(fn(arg), timeout_s)
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
    return await asyncio.wait_for(done, timeout_s)


def _env_error(e: BaseException) -> dict:
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
            await asyncio.wait_for(close(), timeout_s)
        else:
            await env_call(lambda _: close(), None, timeout_s)
    except Exception as e:  # the episode is over either way
        log.debug("closing %s: %s", env.name, e)


async def _expanded(vision, ids: list[int], images: tuple[bytes, ...], before: tuple[bytes, ...] = ()) -> list[int]:
    """``ids`` (a turn with one placeholder per image) with each expanded to its image's tokens,
    the images decoded off the event loop. A ``VisionError`` where the text itself holds a
    placeholder (they no longer match), or where the conversation's images (``before``: earlier
    turns', which every request carries again) outgrow a request's limits."""
    if vision is None:
        return ids
    if (n := ids.count(vision.image_token_id)) != len(images):
        raise VisionError("images", f"{n} image placeholders for {len(images)} images")
    if not images:
        return ids
    shown = (*before, *images)
    if len(shown) > MAX_IMAGES:
        raise VisionError("images", f"{len(shown)} images in the conversation; a request carries at most {MAX_IMAGES}")
    if (size := sum(map(len, shown))) > MAX_REQUEST_IMAGE_BYTES:
        raise VisionError(
            "images", f"{size} bytes of images in the conversation; a request carries {MAX_REQUEST_IMAGE_BYTES}"
        )
    measured = await asyncio.to_thread(vision.measure, list(images), "images")
    return vision.expand(ids, [m.tokens for m in measured], "images")


class _Ended(Exception):
    """The episode ends here, for this reason; ``why`` goes into the trajectory's metadata."""

    def __init__(self, finish: FinishReason, **why) -> None:
        super().__init__(finish)
        self.finish, self.why = finish, why


def _observation(obs, vision) -> tuple[str, tuple[bytes, ...]]:
    """An environment's observation as text with one placeholder per image first (as vision-language
    chat templates put them), and its images."""
    if not isinstance(obs, Observation):
        return obs, ()
    text, images = obs.text, tuple(obs.images)
    if images and vision is None:
        raise _Ended(
            FinishReason.ENV_ERROR, error="the environment sent images to a text-only model", error_kind="images"
        )
    return (vision.placeholder * len(images) + text if images else text), images


class _Episode:
    """One episode's record so far: the tokens the model read (each image placeholder expanded), what
    the engines are sent (one placeholder per image), which tokens are the policy's, their
    log-probs, versions and experts, and the images."""

    def __init__(self, env, tokenizer, vision, image_store: dict, trajectory_id: str) -> None:
        self.env, self.tokenizer, self.vision, self.image_store = env, tokenizer, vision, image_store
        self.trajectory_id = trajectory_id
        self.images: tuple[bytes, ...] = ()
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[int] = []  # where each generated turn starts
        # MoE routing replay: each forwarded position's experts, from the latest turn (whose forward the newest
        # tokens came from); a turn without them (not asked, or not sent) leaves the trajectory without any
        self.experts, self.turn_without_routing = None, False

    async def begin(self, seed, step_timeout_s: float) -> None:
        try:
            obs = await env_call(self.env.reset, seed, step_timeout_s)
        except TimeoutError:
            raise _Ended(FinishReason.TIMEOUT, timeout="reset") from None
        except Exception as e:
            log.warning("%s: reset failed: %s: %s", self.trajectory_id, type(e).__name__, e)
            raise _Ended(FinishReason.ENV_ERROR, **_env_error(e)) from None
        obs, self.images = _observation(obs, self.vision)
        self.chat = Conversation(self.tokenizer, obs)
        sent = self.chat.prompt_ids()  # the conversation as the engines take it: one placeholder per image
        try:  # what the model reads (and the engine consumes): each placeholder expanded to its image's tokens
            self.tokens = await _expanded(self.vision, sent, self.images)
        except VisionError as e:
            raise _Ended(FinishReason.ENV_ERROR, error=str(e)[:500], error_kind="images") from None
        self.sent = list(sent)
        self.image_store.update({content_hash(x): x for x in self.images})
        self.mask = [0] * len(self.tokens)

    async def generate(self, generate: GenerateFn, sampling: SamplingParams, timeout_s: float) -> Generation:
        try:
            with_images = {"images": self.images} if self.images else {}
            return await generate(
                self.sent if self.images else self.tokens, sampling, self.trajectory_id, timeout_s, **with_images
            )
        except ValueError as e:
            if not _CONTEXT_FULL.search(str(e)):  # a request the config made wrong: not this episode's
                raise
            # The engine refused the turn: the conversation outgrew the model's context.
            log.warning("%s: generation refused: %s", self.trajectory_id, e)
            raise _Ended(FinishReason.ENV_ERROR, error=str(e)[:500], error_kind="context") from None

    def record(self, gen: Generation) -> None:
        """A generated turn: the policy's tokens, trained on."""
        self.turns.append(len(self.tokens))
        self.tokens += gen.output_ids
        self.sent += gen.output_ids
        self.mask += [1] * len(gen.output_ids)
        self.logprobs += gen.behavior_logprobs
        self.versions += gen.token_versions
        if gen.routed_experts is None:
            self.turn_without_routing = True
        else:
            try:
                self.experts = routing.latest(self.experts, gen.routed_experts)
            except routing.RoutingError as e:  # another width than the turn before: not this run's model
                log.warning("%s: %s; its routing is dropped", self.trajectory_id, e)
                self.turn_without_routing = True
        if self.vision is not None and self.vision.image_token_id in gen.output_ids:  # no forward reads it as text
            raise _Ended(FinishReason.ERROR, error="sampled an image placeholder", error_kind="image_token")

    async def step(self, gen: Generation, timeout_s: float, budget: str, report):
        """The environment's answer to the turn; ``report(step_s)`` once it is in (or failed)."""
        action = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        t_step = time.monotonic()
        try:
            if timeout_s <= 0:
                raise TimeoutError(budget)
            return await env_call(self.env.step, action, timeout_s)
        except TimeoutError:  # the provider's own deadline too (ProviderTimeout)
            raise _Ended(FinishReason.TIMEOUT, timeout=budget) from None
        except Exception as e:  # the environment's fault, not the policy's: the member is not trained
            log.warning("%s: step failed: %s: %s", self.trajectory_id, type(e).__name__, e)
            raise _Ended(FinishReason.ENV_ERROR, **_env_error(e)) from None
        finally:
            report(time.monotonic() - t_step)

    async def observe(self, gen: Generation, result) -> None:
        """The environment's next observation, as the next turn's prompt tokens (not trained on)."""
        observation, shown = _observation(result.observation, self.vision)
        try:
            next_turn = self.chat.next_turn(
                gen.output_ids, gen.finish_reason == FinishReason.STOP, result.role, observation
            )
        except Exception as e:  # a role the chat does not have, a template that refuses the turn
            raise _Ended(FinishReason.ENV_ERROR, **_env_error(e)) from None
        try:  # the turn's images (a screenshot after an action) expanded as the first turn's
            seen = await _expanded(self.vision, next_turn, shown, self.images)
        except VisionError as e:
            raise _Ended(FinishReason.ENV_ERROR, error=str(e)[:500], error_kind="images") from None
        self.images += shown
        self.image_store.update({content_hash(x): x for x in shown})
        self.tokens += seen
        self.sent += next_turn
        self.mask += [0] * len(seen)


async def _run_episode(
    env, seed, generate, tokenizer, config, trajectory_id, group_id, prompt_id, barrier, observer, vision, image_store
):
    ids = {"trajectory_id": trajectory_id, "group_id": group_id, "prompt_id": prompt_id}
    started = time.monotonic()
    ep = _Episode(env, tokenizer, vision, image_store, trajectory_id)
    try:
        await ep.begin(seed, config.step_timeout_s)
    except _Ended as e:  # before its first generation
        return Trajectory(
            **ids,
            token_ids=[],
            loss_mask=[],
            behavior_logprobs=[],
            token_versions=[],
            reward=0.0,
            start_version=0,
            finish_reason=e.finish,
            metadata={"env": env.name, **e.why},
        )
    # The environment's budgets (a remote one's are known once it is reset) within the config's limits.
    clock = EpisodeClock(config.step_timeout_s, config.generation_timeout_s, getattr(env, "budgets", None), started)
    sampling, penalty = clock.sampling(config.sampling), config.latency_penalty
    if vision is not None:  # its image placeholder is input only: one sampled ends the turn (and the member)
        sampling = sampling.model_copy(update={"stop_token_ids": [*sampling.stop_token_ids, vision.image_token_id]})
    reward, finish, why, over_target = 0.0, FinishReason.STOP, {}, 0
    try:
        for _ in range(config.max_turns):
            timeout_s, budget = clock.generation()
            if timeout_s <= 0:
                raise _Ended(FinishReason.TIMEOUT, timeout=budget)
            t_gen = time.monotonic()
            gen = await ep.generate(generate, sampling, timeout_s)
            generate_s = time.monotonic() - t_gen
            ep.record(gen)
            if gen.finish_reason in _ENDS_EPISODE:
                _report(observer.turn, env.name, generate_s, None)
                finish = gen.finish_reason
                why = {"timeout": budget} if finish == FinishReason.TIMEOUT else {}
                break
            if barrier is not None:
                await barrier.wait()  # generate all, then step all
            result = await ep.step(gen, *clock.step(), functools.partial(_report, observer.turn, env.name, generate_s))
            if barrier is not None and not (result.done or result.observation is None):
                await barrier.wait()  # step all, then generate the next turn together
            reward += result.reward
            if penalty is not None and time.monotonic() - t_gen > penalty.target_s:  # the turn, as its user waits
                reward -= penalty.penalty
                over_target += 1
            finish = gen.finish_reason
            if result.done or result.observation is None:
                break
            await ep.observe(gen, result)
    except _Ended as e:
        finish, why = e.finish, e.why
    return Trajectory(
        **ids,
        token_ids=ep.tokens,
        loss_mask=ep.mask,
        behavior_logprobs=ep.logprobs,
        token_versions=ep.versions,
        reward=reward,
        start_version=ep.versions[0] if ep.versions else 0,
        finish_reason=finish,
        routed_experts=None if ep.turn_without_routing else ep.experts,
        images=tuple(content_hash(x) for x in ep.images),
        metadata={
            "env": env.name,
            "turn_starts": ep.turns,
            # the temperature each turn was sampled at: μ is at it, so the trainer's π must be too
            "turn_temperatures": [sampling.temperature] * len(ep.turns),
            # and under its grammar, if any: μ is the masked distribution's, so the trainer masks π too
            **({"turn_grammars": [list(grammar)] * len(ep.turns)} if (grammar := sampling.grammar()) else {}),
            **why,
            **({} if ep.chat.exact else {"chat_render": "alone"}),
            **({"turns_over_target": over_target} if penalty is not None else {}),
        },
    )
